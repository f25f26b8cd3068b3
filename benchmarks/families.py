"""Families (issue 17): members created by first use under many processes,
and what an acquire on an existing member costs against a declared semaphore.

1. **Creation**: ``--members`` names of the family ``bench:customer:*``
   (capacity 2), none existing, split into one chunk per process; each
   process acquires and releases every name of its own chunk and of the next
   process's, in a random order, so every name is raced by two processes.
   Counted: rows created, duplicate names, errors by type (any exception is
   one: with capacity 2 and two racers, no acquire can even be refused).
2. **Acquire cost**: half the processes on members, half on declared
   semaphores, side by side (the same load for both), looping acquire/release
   for ``--duration`` seconds: each on a semaphore of its own, then each
   half on one (capacity 10; a refusal is counted and retried at once, as in
   ``python -m benchmarks``). ``--repeat`` rounds added up: cycles/s,
   acquire p50/p99, and the ratios member / declared.

Usage (the database is created if missing and migrated; the family's and
the benchmark's semaphores are deleted first)::

    python -m benchmarks.families \\
        --database-url mysql://semaphore:semaphore@127.0.0.1:33061/bench \\
        --members 10000 --processes 16

``tests/test_benchmark_families.py`` runs a small version on the database under test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import sys
import time
import uuid
from collections import Counter
from typing import Any

from benchmarks import cleanup_load

FAMILY = "bench:customer:*"
DECLARED = "bench-declared"
HOT_CAPACITY = 10
# A worker that has reported nothing in this long has hung (creating the
# largest family takes minutes).
WORKER_BOUND = 1800


def configure(database_url: str) -> None:
    """Django settings for a standalone run (each client process too)."""
    cleanup_load.configure(database_url, {"SEMAPHORES": {FAMILY: 2}})


def member(i: int) -> str:
    return FAMILY.replace("*", str(i))


# --- phase 1: creation by first use ------------------------------------------------


def create_loop(database_url: str, names: list[str], start: Any, results: Any) -> None:
    """Acquire and release each of ``names`` once; sends back ("create", latencies, errors)."""
    configure(database_url)
    from django.db import connections

    from django_semaphore import acquire, release

    latencies: list[float] = []
    errors: list[str] = []
    try:
        start.wait()
        for name in names:
            key = uuid.uuid4().hex
            began = time.perf_counter()
            try:
                acquire(name, external_id=key, owner="bench creator")
            except Exception as exc:
                errors.append(type(exc).__name__)
                continue
            latencies.append(time.perf_counter() - began)
            try:
                release(key)
            except Exception as exc:
                errors.append(type(exc).__name__)
    finally:
        results.put(("create", latencies, errors))
        connections.close_all()


def create_members(database_url: str, members: int, processes: int) -> dict[str, Any]:
    """Phase 1: every name raced by two processes; the rows checked after."""
    from django.db.models import Count, F

    from django_semaphore.models import Semaphore

    chunks = [list(range(p, members, processes)) for p in range(processes)]
    plans = []
    for p in range(processes):
        mine = [member(i) for i in chunks[p] + chunks[(p + 1) % processes]]
        random.Random(p).shuffle(mine)
        plans.append(mine)
    groups, seconds = _run(database_url, create_loop, plans)
    latencies = [t for mine, _ in groups.values() for t in mine]
    errors = [e for _, theirs in groups.values() for e in theirs]
    rows = Semaphore.objects.filter(family=FAMILY)
    duplicates = (
        Semaphore.objects.filter(name__startswith="bench:customer:")
        .values("name")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .count()
    )
    return {
        "members": members,
        "processes": processes,
        "acquires": sum(len(plan) for plan in plans),
        "created": rows.count(),
        "duplicates": duplicates,
        "errors": dict(Counter(errors)),
        "in_use_after": sum(rows.values_list(F("in_use"), flat=True)),
        "seconds": round(seconds, 2),
        "acquires_per_second": round(len(latencies) / seconds, 1),
        **_percentiles(latencies),
    }


# --- phase 2: acquire cost ----------------------------------------------------------


def cycle_loop(
    database_url: str, plan: tuple[str, str], start: Any, duration: float, results: Any
) -> None:
    """Acquire and release the semaphore of ``plan`` (group, name) for
    ``duration`` seconds; sends back (group, latencies, errors)."""
    configure(database_url)
    from django.db import connections

    from django_semaphore import acquire, release
    from django_semaphore.exceptions import SemaphoreExhausted

    group, name = plan
    latencies: list[float] = []
    errors: list[str] = []
    try:
        start.wait()
        stop_at = time.monotonic() + duration
        while time.monotonic() < stop_at:
            key = uuid.uuid4().hex
            began = time.perf_counter()
            try:
                acquire(name, external_id=key, owner="bench cycle")
            except SemaphoreExhausted:
                errors.append("rejected")  # no room: counted apart, retried at once
                continue
            except Exception as exc:
                errors.append(type(exc).__name__)
                continue
            latencies.append(time.perf_counter() - began)
            release(key)
    finally:
        results.put((group, latencies, errors))
        connections.close_all()


def acquire_cost(database_url: str, processes: int, duration: float, repeat: int) -> dict[str, Any]:
    """Phase 2, side by side: half the processes on members, half on declared
    semaphores *at the same time*, so both see the same load (on a shared
    machine, load drifts between runs far more than the difference sought).
    First each process on a semaphore of its own, then each half on one
    semaphore (capacity 10). ``repeat`` rounds, added up."""
    from django_semaphore import set_capacity
    from django_semaphore.models import Semaphore

    half = max(1, processes // 2)
    Semaphore.objects.bulk_create(
        [Semaphore(name=f"{DECLARED}-{p}", capacity=2) for p in range(half)]
        + [Semaphore(name=DECLARED, capacity=HOT_CAPACITY)]
    )
    # Created by phase 1; from now on with a capacity of its own.
    set_capacity(member(0), HOT_CAPACITY)
    shapes = {
        "own": [("member", member(p + 1)) for p in range(half)]
        + [("declared", f"{DECLARED}-{p}") for p in range(half)],
        "one": [("member", member(0))] * half + [("declared", DECLARED)] * half,
    }
    results: dict[str, Any] = {"processes per side": half, "rounds": repeat}
    for shape, plans in shapes.items():
        totals: dict[str, tuple[list[float], list[str]]] = {
            "member": ([], []),
            "declared": ([], []),
        }
        for _ in range(repeat):
            for group, (latencies, errors) in _run(
                database_url, cycle_loop, plans, extra=(duration,)
            )[0].items():
                totals[group][0].extend(latencies)
                totals[group][1].extend(errors)
        for group, (latencies, errors) in totals.items():
            counted = Counter(errors)
            rejected = counted.pop("rejected", 0)
            results[f"{shape}, {group}"] = {
                "cycles_per_second": round(len(latencies) / (duration * repeat), 1),
                "rejected": rejected,
                "errors": dict(counted),
                **_percentiles(latencies),
            }
        mine, declared = results[f"{shape}, member"], results[f"{shape}, declared"]
        for figure, key in (("cycles", "cycles_per_second"), ("p50", "p50_ms")):
            results[f"{shape}: member / declared {figure}"] = _ratio(mine[key], declared[key])
    return results


# --- plumbing -------------------------------------------------------------------------


def _run(
    database_url: str, target: Any, plans: list[Any], extra: tuple[Any, ...] = ()
) -> tuple[dict[str, tuple[list[float], list[str]]], float]:
    """One spawned process per plan, all started together once each is set
    up; (group -> (latencies, errors), seconds from the start)."""
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(len(plans) + 1), context.Queue()
    # Daemons: one left behind by a failed run never keeps the driver from exiting.
    workers = [
        context.Process(
            target=target, args=(database_url, plan, start, *extra, results), daemon=True
        )
        for plan in plans
    ]
    for worker in workers:
        worker.start()
    try:
        start.wait(timeout=120)
        began = time.perf_counter()
        groups: dict[str, tuple[list[float], list[str]]] = {}
        # Drained before the joins: a child cannot exit while its results fill the pipe.
        for _ in workers:
            group, latencies, errors = results.get(timeout=WORKER_BOUND)
            mine = groups.setdefault(group, ([], []))
            mine[0].extend(latencies)
            mine[1].extend(errors)
        seconds = time.perf_counter() - began
        for worker in workers:
            worker.join(timeout=30)
            if worker.exitcode:
                groups.setdefault("exit", ([], []))[1].append(f"process exit {worker.exitcode}")
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
    return groups, seconds


def _ratio(mine: float, declared: float) -> float | None:
    """``None`` when a side has nothing to compare (a smoke run too short
    for two grants on it)."""
    return round(mine / declared, 2) if declared else None


def _percentiles(latencies: list[float]) -> dict[str, float]:
    if len(latencies) < 2:
        return {"p50_ms": 0.0, "p99_ms": 0.0}
    cuts = statistics.quantiles(latencies, n=100)
    return {"p50_ms": round(cuts[49] * 1000, 2), "p99_ms": round(cuts[98] * 1000, 2)}


def reset() -> None:
    from django.core.management import call_command

    from django_semaphore.models import PermitRequest, Semaphore

    call_command("migrate", verbosity=0)
    Semaphore.objects.filter(name__startswith="bench").delete()
    PermitRequest.objects.filter(owner__startswith="bench").delete()


def run(
    database_url: str, members: int, processes: int, duration: float, repeat: int = 1
) -> dict[str, Any]:
    """Both phases on a fresh family; the figures as one dict."""
    configure(database_url)
    reset()
    created = create_members(database_url, members, processes)
    cost = acquire_cost(database_url, processes, duration, repeat)
    from django.db import connection

    return {"database": connection.vendor, "creation": created, "acquire": cost}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.families", description=__doc__)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--members", type=int, default=10_000)
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per cost cell")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cost cell (median)")
    args = parser.parse_args(argv)
    from benchmarks import db

    db.ensure_database(db.Target.parse(args.database_url))
    results = run(args.database_url, args.members, args.processes, args.duration, args.repeat)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
