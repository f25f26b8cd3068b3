"""One tenant's backlog against another's latency, with a real prefork worker
on Redis (issue 25).

``python -m benchmarks.tenants``: tenant A has ``--backlog`` (500) tasks
parked behind its own cap of 1 (``bench-export:customer:A``, held by the
driver throughout), on a shared ``bench-exports`` of capacity ``--capacity``
(10). Then ``--tasks`` (20) tasks of tenant B, each holding
``{"bench-exports": 1, "bench-export:customer:B": 1}`` for ``--hold``
(20 ms), are enqueued ``--every`` (50 ms) apart, so that some find B's own
cap held and stand by or park. Reported: the delay from enqueueing each B
task to its start, p50/p99 (one machine's clock), and how many of A's tasks
ran meanwhile (0: A's cap is held). Before issue 25 a refused B task parked
behind A's backlog and ran only after it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.parked import FAMILY, ROOT, _quantile, add_server_arguments, worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tenants", description=__doc__)
    add_server_arguments(parser)
    parser.add_argument("--backlog", type=int, default=500)
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--capacity", type=int, default=10)
    parser.add_argument("--hold", type=float, default=0.02)
    parser.add_argument("--every", type=float, default=0.05)
    parser.add_argument("--concurrency", type=int, default=8, help="worker processes")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    return measure(args, "tenants", run, format_result)


def measure(
    args: argparse.Namespace,
    kind: str,
    run: Callable[[argparse.Namespace, Any], dict[str, Any]],
    format_result: Callable[[dict[str, Any]], str],
) -> int:
    """Set the benchmark's database and Celery app up (``parked_app``), run
    it, print its result and write it to ``--json``."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from benchmarks.db import Target, ensure_database

    ensure_database(Target.parse(args.database_url))
    os.environ.update(
        BENCH_DATABASE_URL=args.database_url,
        BENCH_REDIS_URL=args.redis_url,
        BENCH_HOLD=str(args.hold),
        BENCH_FAMILY=FAMILY,
        BENCH_QUEUE=f"bench-{kind}-{uuid.uuid4().hex[:8]}",
    )
    from django.core.management import call_command

    from benchmarks import parked_app

    call_command("migrate", verbosity=0, interactive=False)
    result = run(args, parked_app)
    print(format_result(result), flush=True)
    if args.json:
        config = vars(args) | {"json": None}
        args.json.write_text(json.dumps({"config": config, "result": result}, indent=1))
    return 0


def run(args: argparse.Namespace, parked_app: Any) -> dict[str, Any]:
    from django_semaphore import acquire
    from django_semaphore.guards import engine_writes
    from django_semaphore.models import ParkedTask, PermitRequest, Semaphore

    counts = parked_app.counts
    parked_app.app.conf.task_default_queue = os.environ["BENCH_QUEUE"]
    counts.delete(parked_app.STARTS)
    cap_a = "bench-export:customer:A"
    names = {parked_app.EXPORTS: args.capacity, cap_a: 1, "bench-export:customer:B": 1}
    with engine_writes():  # a wholesale reset of the benchmark's database
        ParkedTask.objects.all().delete()
        PermitRequest.objects.all().delete()
        Semaphore.objects.filter(name__in=names).delete()
    for name, capacity in names.items():
        Semaphore.objects.create(name=name, capacity=capacity)
    acquire(cap_a, external_id=f"bench-a-held-{uuid.uuid4().hex}")  # A at its cap
    log = ROOT / ".runtime" / "benchmarks" / "tenants-worker.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with worker(args.concurrency, log, parked_app):
        for _ in range(args.backlog):
            parked_app.export.delay("A", time.time())
        _until(lambda: ParkedTask.objects.count() >= args.backlog, args.timeout, "A parked")
        for _ in range(args.tasks):
            parked_app.export.delay("B", time.time())
            time.sleep(args.every)
        _until(lambda: len(_delays(counts, parked_app, "B")) >= args.tasks, args.timeout, "B ran")
    delays = sorted(_delays(counts, parked_app, "B"))
    return {
        "backlog": args.backlog,
        "tasks": args.tasks,
        "b_ran": len(delays),
        "a_ran": len(_delays(counts, parked_app, "A")),
        "enqueue_to_start_p50_ms": round(_quantile(delays, 0.5) * 1000, 1),
        "enqueue_to_start_p99_ms": round(_quantile(delays, 0.99) * 1000, 1),
        "enqueue_to_start_max_ms": round(delays[-1] * 1000, 1),
        "a_parked_left": ParkedTask.objects.count(),
    }


def _until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting until {what}")
        time.sleep(0.05)


def _delays(counts: Any, parked_app: Any, tenant: str) -> list[float]:
    return [started - enqueued for started, enqueued in _starts(counts, parked_app, tenant)]


def _starts(counts: Any, parked_app: Any, tenant: str) -> list[tuple[float, float]]:
    """(start, enqueued) of each of ``tenant``'s runs, wall clock, by start."""
    rows = (row.decode().split() for row in counts.lrange(parked_app.STARTS, 0, -1))
    return sorted(
        (float(started), float(enqueued)) for who, enqueued, started in rows if who == tenant
    )


def format_result(r: dict[str, Any]) -> str:
    return (
        f"{r['b_ran']}/{r['tasks']} B tasks behind {r['backlog']} parked A tasks: "
        f"enqueue->start p50 {r['enqueue_to_start_p50_ms']} ms, "
        f"p99 {r['enqueue_to_start_p99_ms']} ms, max {r['enqueue_to_start_max_ms']} ms; "
        f"A ran {r['a_ran']}, {r['a_parked_left']} still parked"
    )


if __name__ == "__main__":
    raise SystemExit(main())
