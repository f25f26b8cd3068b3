"""Django's own tasks with real workers: a backlog drained through one
semaphore by django-tasks-db's ``db_worker`` processes.

``python -m benchmarks.own_tasks`` enqueues ``--tasks`` tasks that each hold
one permit of a capacity ``--capacity`` semaphore for ``--hold`` seconds,
then starts ``--workers`` workers (more than the capacity: a refused run
stands by, then is deferred, so the others keep working), and reports,
for it and for the same tasks without a semaphore on ``--capacity``
workers (``unlimited``: what the workers do by themselves, the practical
ideal):

- **drain**: from the first run's start to the last run's end, against the
  ideal ``tasks x hold / capacity``;
- **failed**: results that ended ``FAILED`` (want of room never fails one);
- **most at once**: from the recorded starts and ends of the runs, never
  above the capacity;
- **deferred**: results a worker took more than once (deferred, resumed).

``--smoke`` is small enough for the test suite.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.own_tasks", description=__doc__)
    mariadb = os.environ.get("SEMAPHORE_MARIADB_PORT", "33061")
    parser.add_argument(
        "--database-url", default=f"mysql://semaphore:semaphore@127.0.0.1:{mariadb}/bench_tasks"
    )
    parser.add_argument("--tasks", type=int, default=500)
    parser.add_argument("--hold", type=float, default=0.02)
    parser.add_argument("--capacity", type=int, default=4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--smoke", action="store_true", help="40 tasks of 10 ms on 4 workers")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still stop the workers
    if args.smoke:
        args.tasks, args.hold, args.workers = 40, 0.01, 4

    from benchmarks.db import Target, ensure_database

    ensure_database(Target.parse(args.database_url))
    os.environ.update(
        BENCH_DATABASE_URL=args.database_url, BENCH_HOLD=str(args.hold), BENCH_DJANGO_TASKS="1"
    )
    from django.core.management import call_command

    from benchmarks import own_tasks_app

    call_command("migrate", verbosity=0, interactive=False)
    results = [
        drain(own_tasks_app.free, "unlimited", args.capacity, args),
        drain(own_tasks_app.held, "limited", args.workers, args),
    ]
    for result in results:
        print(format_result(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    limited = results[-1]
    return 0 if limited["failed"] == 0 and limited["most_at_once"] <= args.capacity else 1


def drain(task: Any, mode: str, workers: int, args: argparse.Namespace) -> dict[str, Any]:
    from django_tasks_db.models import DBTaskResult

    from benchmarks.own_tasks_app import NAME
    from django_semaphore.models import ParkedTask, Semaphore

    DBTaskResult.objects.all().delete()
    ParkedTask.objects.all().delete()
    Semaphore.objects.filter(name=NAME).delete()
    Semaphore.objects.create(name=NAME, capacity=args.capacity)
    ids = [str(task.enqueue().id) for _ in range(args.tasks)]
    running = _start_workers(workers)
    try:
        deadline = time.monotonic() + args.timeout
        results = DBTaskResult.objects.filter(id__in=ids)
        while results.filter(status__in=["READY", "RUNNING"]).exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"not drained within {args.timeout} s")
            time.sleep(0.2)
    finally:
        for worker in running:
            worker.kill()
            worker.wait()
    rows = list(results.values_list("status", "return_value", "worker_ids"))
    spans = [value for status, value, _ in rows if status == "SUCCESSFUL"]
    ideal = args.tasks * args.hold / args.capacity
    took = max(end for _, end in spans) - min(start for start, _ in spans)
    return {
        "mode": mode,
        "tasks": args.tasks,
        "hold": args.hold,
        "capacity": args.capacity,
        "workers": workers,
        "ran": len(spans),
        "failed": sum(status == "FAILED" for status, _, _ in rows),
        "drain_s": round(took, 3),
        "ideal_s": ideal,
        "x_ideal": round(took / ideal, 3),
        "most_at_once": _most_at_once(spans),
        "deferred": sum(len(worker_ids) > 1 for _, _, worker_ids in rows),
    }


def _start_workers(count: int) -> list[subprocess.Popen[bytes]]:
    environment = {**os.environ, "DJANGO_SETTINGS_MODULE": "benchmarks.settings"}
    command = [
        sys.executable, "-m", "django", "db_worker", "--no-startup-delay", "--interval", "0.05",
    ]  # fmt: skip
    return [
        subprocess.Popen(command, env=environment, cwd=ROOT, stdout=subprocess.DEVNULL)
        for _ in range(count)
    ]


def _most_at_once(spans: list[list[float]]) -> int:
    # An end sorts before a start at the same instant: they did not overlap.
    events = sorted(
        itertools.chain(((start, 1) for start, _ in spans), ((end, -1) for _, end in spans))
    )
    return max(itertools.accumulate(change for _, change in events))


def format_result(result: dict[str, Any]) -> str:
    return (
        f"{result['mode']:9} {result['workers']} workers: "
        f"{result['ran']}/{result['tasks']} ran, {result['failed']} failed; drain "
        f"{result['drain_s']}s ({result['x_ideal']}x ideal {result['ideal_s']}s); most at once "
        f"{result['most_at_once']} (capacity {result['capacity']}); deferred {result['deferred']}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
