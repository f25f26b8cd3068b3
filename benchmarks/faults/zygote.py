"""Forks client processes from one process that has already set Django up.

Booting Django takes about a second of CPU per process; on a small machine
that would eat a short scenario, and a SIGKILLed client's replacement would
start late. The zygote sets Django up once (no connection opened, no thread
started, so forking is safe) and forks a client for each JSON config line
it reads on stdin. It reports ``spawned <slot> <pid>`` and
``exited <pid> <status>`` (negative: killed by that signal) on stdout.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import traceback


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.faults.settings")
    import django

    django.setup()
    import django_semaphore.api  # noqa: F401  (imported once, before forking)
    from benchmarks.faults import client

    # The runner arms faults with SIGUSR1 at any live client, a replacement
    # too, which installs its handler only once it has connected: until then
    # the default action would kill it, counted as a crash. Forked children
    # inherit this, so an early arm is dropped (the runner arms again).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    out = sys.stdout
    stdin = sys.stdin.fileno()
    buffer = b""
    children = 0
    closed = False
    while not closed or children:
        ready, _, _ = select.select([] if closed else [stdin], [], [], 0.02)
        if ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                closed = True
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                config = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(client, config)
                children += 1
                out.write(f"spawned {config['slot']} {pid}\n")
                out.flush()
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children = 0
                break
            if pid == 0:
                break
            children -= 1
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            out.write(f"exited {pid} {code}\n")
            out.flush()


def _child(client: object, config: dict[str, object]) -> None:
    code = 1
    try:
        os.setpgrp()  # signals meant for the zygote's group are not ours
        client.Client(config).run()  # type: ignore[attr-defined]
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        from django.db import connections

        try:
            connections.close_all()
        finally:
            os._exit(code)


if __name__ == "__main__":
    main()
