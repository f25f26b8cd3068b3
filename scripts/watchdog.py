"""Run a test command and fail it, fast, if it hangs.

    python scripts/watchdog.py [--grace S] [--pass-budget S] [--budget S] -- COMMAND...

pytest-timeout fails a test that runs past its timeout, but not a pytest
that hangs where no test runs (at exit, waiting for a child it never
reaped) or a test stuck where its signal cannot reach (in C, with the
signal blocked). The watchdog covers those: every pytest process the
command starts reports its current test and that test's timeout
(``tests/conftest.py``, through ``SEMAPHORE_PROGRESS_DIR``). The watchdog
stops the run when

- a test runs ``--grace`` seconds past its own timeout,
- a pytest has run its tests and is still alive ``--grace`` seconds later,
- one pytest process (a pass) runs past ``--pass-budget``, or
- the whole command runs past ``--budget``.

It then says which test was running, dumps the stacks of every pytest
process and of their children (SIGUSR1, ``tests/children.py``), kills
every process of the run (``SEMAPHORE_RUN_ID``) apart from the servers,
which the caller stops, and exits 1. Otherwise it exits with the command's
status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import servers

POLL = 2.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grace", type=float, default=120.0)
    parser.add_argument("--pass-budget", type=float, default=1800.0)
    parser.add_argument("--budget", type=float, default=4800.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    run_id = os.environ.get(servers.RUN_MARKER)
    if not command or not run_id:
        parser.error(f"give a command after --, with {servers.RUN_MARKER} set")

    watch = servers.runtime_dir() / "watch" / run_id
    shutil.rmtree(watch, ignore_errors=True)  # an earlier command's reports
    progress, stacks = watch / "progress", watch / "stacks"
    for directory in (progress, stacks):
        directory.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SEMAPHORE_PROGRESS_DIR": str(progress)}
    env["SEMAPHORE_STACKS_DIR"] = str(stacks)
    began = time.monotonic()
    process = subprocess.Popen(command, env=env)
    while process.poll() is None:
        reason = overrun(progress, time.monotonic() - began, options)
        if reason:
            stop_run(run_id, reason, progress, stacks)
            process.wait()
            return 1
        time.sleep(POLL)
    shutil.rmtree(watch, ignore_errors=True)  # kept only when the watchdog fired
    return process.returncode


def overrun(progress: Path, elapsed: float, options: argparse.Namespace) -> str | None:
    """Why the run must stop now, or None."""
    if elapsed > options.budget:
        return f"the command has run {elapsed:.0f}s, past its budget of {options.budget:.0f}s"
    now = time.time()
    for state in reports(progress):
        pid, test = state["pid"], state.get("test")
        if not servers._alive(pid):
            continue
        if test and now - state["since"] > state["timeout"] + options.grace:
            return (
                f"pytest {pid}: {test} has run {now - state['since']:.0f}s, "
                f"{options.grace:.0f}s past its timeout of {state['timeout']:.0f}s"
            )
        if state.get("finished") and now - state["finished"] > options.grace:
            return (
                f"pytest {pid} ran its tests {now - state['finished']:.0f}s ago and has not "
                "exited (it waits for a child process or thread)"
            )
        if now - state["started"] > options.pass_budget:
            return (
                f"pytest {pid} (a pass) has run {now - state['started']:.0f}s, past its "
                f"budget of {options.pass_budget:.0f}s; in {test or 'no test'}"
            )
    return None


def reports(progress: Path) -> list[dict[str, Any]]:
    found = []
    for path in progress.glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            found.append(json.loads(path.read_text()))
    return found


def stop_run(run_id: str, reason: str, progress: Path, stacks: Path) -> None:
    say(f"watchdog: {reason}: stopping run {run_id}")
    pytests = [state["pid"] for state in reports(progress) if servers._alive(state["pid"])]
    dumped = [pid for root in pytests for pid in (root, *descendants(root))]
    for pid in dumped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)  # a process with no handler for it ends
    time.sleep(2)
    for pid in dumped:
        path = stacks / f"stacks-{pid}.txt"
        if path.exists() and path.stat().st_size:
            say(f"watchdog: stacks of pid {pid}:\n{path.read_text(errors='replace')}")
    # What the command started, and what of the run left its parent (a
    # daemonized worker); not the servers, which the caller stops, nor
    # whatever beside the watchdog shares the run id (a pipe reading it).
    keep = servers.leftover_processes(servers.runtime_dir())
    ours = set(descendants(os.getpid()))
    for pid, line in servers.processes_of_run(run_id, grace=0).items():
        if pid not in keep and (pid in ours or parents().get(pid) == 1):
            say(f"watchdog: killing pid {pid}: {line[:200]}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def parents() -> dict[int, int]:
    """pid -> parent pid, of every process."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            found[int(stat.parent.name)] = int(stat.read_text().rpartition(")")[2].split()[1])
    return found


def descendants(root: int) -> list[int]:
    """Every process under ``root``."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents().items():
        children.setdefault(parent, []).append(pid)
    found, frontier = [], [root]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
