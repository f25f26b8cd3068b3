"""One tenant's burst against another's on one shared semaphore, with a real
prefork worker on Redis.

``python -m benchmarks.starvation``: customer A sends ``--backlog`` (1,000)
tasks holding ``bench-exports`` (capacity ``--capacity``, 4) for ``--hold``
(20 ms) each, then customer B sends ``--tasks`` (10). The customers' own
caps (``bench-export:customer:*``) are as large as the backlog: only the
shared semaphore binds. Reported: when B's last task finished after B's
first send, in A's rounds (a round: ``--capacity`` of A's tasks side by
side, measured as A's drain time over its rounds), and how many of A's
tasks started before B's last one. Served first come, first served, B
waits behind A's whole burst. ``--line``: a plain task waits in the
broker's queue (``broker``); a ``PermitTask`` is parked as it is sent, in
the semaphores' line (``sent``), where each customer may take its share
key (``shares``, ``docs/shares.md``): B within a few rounds.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.parked import ROOT, add_server_arguments, worker
from benchmarks.tenants import _starts, _until, measure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.starvation", description=__doc__)
    add_server_arguments(parser)
    parser.add_argument("--backlog", type=int, default=1000)
    parser.add_argument("--tasks", type=int, default=10)
    parser.add_argument("--capacity", type=int, default=4)
    parser.add_argument("--hold", type=float, default=0.02)
    parser.add_argument("--concurrency", type=int, default=8, help="worker processes")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--line",
        choices=("broker", "sent", "shares"),
        default="broker",
        help="where tasks without room wait: the broker's queue (a plain task), the "
        "semaphores' line from when they are sent (PermitTask), the line with each "
        "customer its share key",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    return measure(args, "starvation", run, format_result)


def run(args: argparse.Namespace, parked_app: Any) -> dict[str, Any]:
    from django_semaphore.guards import engine_writes
    from django_semaphore.models import ParkedTask, PermitRequest, Semaphore

    counts = parked_app.counts
    parked_app.app.conf.task_default_queue = os.environ["BENCH_QUEUE"]
    counts.delete(parked_app.STARTS)
    own = args.backlog + args.tasks
    names = {
        parked_app.EXPORTS: args.capacity,
        "bench-export:customer:A": own,
        "bench-export:customer:B": own,
    }
    with engine_writes():  # a wholesale reset of the benchmark's database
        ParkedTask.objects.all().delete()
        PermitRequest.objects.all().delete()
        Semaphore.objects.filter(name__in=names).delete()
    for name, capacity in names.items():
        Semaphore.objects.create(name=name, capacity=capacity)
    log = ROOT / ".runtime" / "benchmarks" / "starvation-worker.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    export = {
        "broker": parked_app.export,
        "sent": parked_app.export_when_sent,
        "shares": parked_app.export_shared,
    }[args.line]
    with worker(args.concurrency, log, parked_app):
        for _ in range(args.backlog):
            export.delay("A", time.time())
        for _ in range(args.tasks):
            export.delay("B", time.time())
        every = args.backlog + args.tasks
        _until(lambda: counts.llen(parked_app.STARTS) >= every, args.timeout, "every task ran")
        time.sleep(args.hold)  # the last ones end
    a, b = _starts(counts, parked_app, "A"), _starts(counts, parked_app, "B")
    rounds = args.backlog / args.capacity
    a_round = (a[-1][0] + args.hold - a[0][0]) / rounds
    b_sent = min(enqueued for _, enqueued in b)
    b_done = b[-1][0] + args.hold - b_sent
    return {
        "line": args.line,
        "backlog": args.backlog,
        "tasks": args.tasks,
        "a_round_ms": round(a_round * 1000, 1),
        "b_done_after_s": round(b_done, 2),
        "b_done_in_a_rounds": round(b_done / a_round, 1),
        "a_started_before_b_last": sum(1 for started, _ in a if started < b[-1][0]),
        "a_drained_s": round(a[-1][0] + args.hold - a[0][0], 2),
    }


def format_result(r: dict[str, Any]) -> str:
    return (
        f"{r.get('line', 'broker')}: "
        f"B's {r['tasks']} tasks behind A's {r['backlog']}: all done {r['b_done_after_s']} s "
        f"after B's first send = {r['b_done_in_a_rounds']} of A's rounds "
        f"({r['a_round_ms']} ms each); {r['a_started_before_b_last']} of A's tasks started "
        f"before B's last; A drained in {r['a_drained_s']} s"
    )


if __name__ == "__main__":
    raise SystemExit(main())
