"""Leases: what the process heartbeat costs, and what a crash costs.

``python -m benchmarks.leases`` (MariaDB by default) reports:

- **heartbeat**: one process holding ``--leases`` leases (``permit()``
  blocks, each in its own thread) for ``--seconds``: the statements its one
  heartbeat thread sends, per second and alias, against the target of at
  most one per ``LEASE/3`` seconds (every statement of that thread is counted,
  through an execute wrapper on its connections);
- **crash**: a process holding a ``permit()`` under the same ``LEASE`` is
  killed with SIGKILL; how long until an ``acquire`` of its semaphore is
  granted again, with no beat and no liveness checker running (target:
  ``LEASE + 5`` s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.leases", description=__doc__)
    mariadb = os.environ.get("SEMAPHORE_MARIADB_PORT", "33061")
    parser.add_argument(
        "--database-url", default=f"mysql://semaphore:semaphore@127.0.0.1:{mariadb}/bench_leases"
    )
    parser.add_argument("--lease", type=int, default=6, help="the LEASE setting, seconds")
    parser.add_argument("--leases", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--hold", help=argparse.SUPPRESS)  # the crash's holder process
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from benchmarks.db import Target, ensure_database

    if args.hold is None:
        ensure_database(Target.parse(args.database_url))
    os.environ["BENCH_DATABASE_URL"] = args.database_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.settings")
    import django
    from django.conf import settings

    django.setup()
    settings.DJANGO_SEMAPHORE = {**settings.DJANGO_SEMAPHORE, "LEASE": args.lease}
    if args.hold is not None:
        return hold_until_killed(args.hold)

    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    results = {"heartbeat": heartbeat(args), "crash": crash(args)}
    print(json.dumps(results, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"config": vars(args) | {"json": None}, **results}))
    return 0


def heartbeat(args: argparse.Namespace) -> dict[str, Any]:
    from django.db import connections
    from django.db.backends.signals import connection_created

    from django_semaphore import permit
    from django_semaphore.integrations.leases import HEARTBEAT
    from django_semaphore.models import Semaphore

    name = f"bench-leases-{uuid.uuid4().hex[:8]}"
    Semaphore.objects.create(name=name, capacity=args.leases)
    statements: list[float] = []

    def count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        statements.append(time.monotonic())
        return execute(sql, params, many, context)

    def on_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == "semaphore-heartbeat":
            connection.execute_wrappers.append(count)

    connection_created.connect(on_connection)
    held = threading.Barrier(args.leases + 1)
    done = threading.Event()

    def holder() -> None:
        try:
            with permit(name):
                held.wait()
                done.wait()
        finally:
            connections.close_all()

    threads = [threading.Thread(target=holder, daemon=True) for _ in range(args.leases)]
    for thread in threads:
        thread.start()
    held.wait(timeout=60)
    started = time.monotonic()
    holding = HEARTBEAT.holding
    beating = sum(thread.name == "semaphore-heartbeat" for thread in threading.enumerate())
    time.sleep(args.seconds)
    counted = [at for at in statements if at >= started]
    done.set()
    for thread in threads:
        thread.join(timeout=60)
    connection_created.disconnect(on_connection)
    per_second = len(counted) / args.seconds
    return {
        "lease_s": args.lease,
        "leases": holding,
        "seconds": args.seconds,
        "statements": len(counted),
        "statements_per_s_per_alias": round(per_second, 3),
        "target_per_s": round(3 / args.lease, 3),
        "heartbeat_threads": beating,
    }


def crash(args: argparse.Namespace) -> dict[str, Any]:
    from django_semaphore import acquire
    from django_semaphore.models import PermitRequest, Semaphore

    name = f"bench-leases-crash-{uuid.uuid4().hex[:8]}"
    Semaphore.objects.create(name=name, capacity=1)
    command = [sys.executable, "-m", "benchmarks.leases", "--database-url", args.database_url]
    command += ["--lease", str(args.lease), "--hold", name]
    holder = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None
        key = holder.stdout.readline().decode().strip()
        if not key:
            raise SystemExit("The holder never held its permit.")
        os.kill(holder.pid, signal.SIGKILL)
        killed = time.monotonic()
        acquire(name, external_id=uuid.uuid4().hex, timeout=args.lease + 30)
        granted_after = time.monotonic() - killed
    finally:
        with contextlib.suppress(ProcessLookupError):
            holder.kill()
        holder.wait(timeout=30)
    return {
        "lease_s": args.lease,
        "granted_again_after_s": round(granted_after, 2),
        "target_s": args.lease + 5,
        "release_reason": PermitRequest.objects.get(external_id=key).release_reason,
    }


def hold_until_killed(name: str) -> int:
    """The crash's holder: says its key once it holds, then waits to be killed."""
    from django_semaphore import permit

    with permit(name) as grant:
        print(grant.external_id, flush=True)
        time.sleep(600)
    return 1


if __name__ == "__main__":
    sys.exit(main())
