"""``python -m benchmarks.late_room``: why acquires are refused under contention.

Issue 26's replay. Client processes acquire three semaphores at once
without waiting (``timeout=0``) and release at once, recording when each
call started and ended. At every refusal it counts the holders the refusing
grant could see (granted before the refusal started, released after it) and
how many of them were already inside their release: holders that were done
but still counted. Reports the refusals, those holders, and the release's
latency.

    BENCH_DATABASE_URL=mysql://semaphore:semaphore@127.0.0.1:33061/bench \\
        python -m benchmarks.late_room --clients 16 --capacity 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
import uuid
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.settings")

NAMES = ["late-a", "late-b", "late-c"]


def client(start: float, end: float, results: Any) -> None:
    import django

    django.setup()
    from django_semaphore import acquire, release
    from django_semaphore.exceptions import SemaphoreExhausted

    demand = dict.fromkeys(NAMES, 1)
    events: list[tuple[float, ...]] = []
    time.sleep(max(0.0, start - time.time()))
    while time.time() < end:
        key = uuid.uuid4().hex
        asked = time.time()
        try:
            acquire(demand, external_id=key, owner="late-room", timeout=0)
        except SemaphoreExhausted:
            events.append((asked,))
            continue
        granted = releasing = time.time()
        release(key)
        events.append((asked, granted, releasing, time.time()))
    results.put(events)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.late_room", description=__doc__)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=10)
    parser.add_argument("--duration", type=float, default=5.0)
    args = parser.parse_args()

    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connections

    from django_semaphore import set_capacity
    from django_semaphore.models import Semaphore

    call_command("migrate", verbosity=0)
    for name in NAMES:
        Semaphore.objects.get_or_create(name=name, defaults={"capacity": args.capacity})
        set_capacity(name, args.capacity)
    connections.close_all()  # the clients are forked: none may share a connection
    results: Any = multiprocessing.Queue()
    start = time.time() + 2
    workers = [
        multiprocessing.Process(target=client, args=(start, start + args.duration, results))
        for _ in range(args.clients)
    ]
    for worker in workers:
        worker.start()
    events = [event for _ in workers for event in results.get(timeout=args.duration + 60)]
    for worker in workers:
        worker.join(timeout=30)
    holds = [e for e in events if len(e) == 4]
    refusals = [e[0] for e in events if len(e) == 1]
    releases = sorted(e[3] - e[2] for e in holds)
    print(f"{len(holds)} cycles, {len(refusals)} refused")
    if releases:
        p50, p99 = releases[len(releases) // 2], releases[int(len(releases) * 0.99)]
        print(f"release latency: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
    if refusals:
        seen = [[h for h in holds if h[1] <= asked < h[3]] for asked in refusals]
        pairs = zip(seen, refusals, strict=True)
        done = [[h for h in holders if h[2] <= asked] for holders, asked in pairs]
        print(
            f"at a refusal: {statistics.mean(map(len, seen)):.1f} holders counted, "
            f"{statistics.mean(map(len, done)):.1f} of them already releasing; "
            f"{sum(1 for d in done if d)} of {len(refusals)} refusals had one"
        )


if __name__ == "__main__":
    main()
