"""Families (issue 17): members created by first use under many processes,
and what an acquire on an existing member costs against a declared semaphore.

1. **Creation**: ``--members`` names of the family ``bench:customer:*``
   (capacity 2), none existing, split into one chunk per process; each
   process acquires and releases every name of its own chunk and of the next
   process's, in a random order, so every name is raced by two processes.
   Counted: rows created, duplicate names, errors by type (any exception is
   one: with capacity 2 and two racers, no acquire can even be refused).
2. **Acquire cost**: the same processes loop acquire/release for
   ``--duration`` seconds, each on a semaphore of its own (a member, or a
   declared semaphore), then all on one (capacity 10; a refusal is counted
   and retried at once, as in ``python -m benchmarks``): cycles/s and
   acquire p50/p99, the median of ``--repeat`` rounds, and the ratios
   member / declared.

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

FAMILY = "bench:customer:*"
DECLARED = "bench-declared"
HOT_CAPACITY = 10


def configure(database_url: str) -> None:
    """Django settings for a standalone run (each client process too)."""
    import django
    import environ
    from django.conf import settings

    if settings.configured:
        return
    database = environ.Env.db_url_config(database_url)
    if database["ENGINE"].endswith("sqlite3"):
        database["OPTIONS"] = {"transaction_mode": "IMMEDIATE", "timeout": 30}
    elif database["ENGINE"].endswith("mysql"):
        database["OPTIONS"] = {"charset": "utf8mb4"}
    settings.configure(
        DATABASES={"default": database},
        INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django_semaphore"],
        USE_TZ=True,
        TIME_ZONE="UTC",
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        DJANGO_SEMAPHORE={"SEMAPHORES": {FAMILY: 2}},
    )
    django.setup()


def member(i: int) -> str:
    return FAMILY.replace("*", str(i))


# --- phase 1: creation by first use ------------------------------------------------


def create_loop(database_url: str, names: list[str], start: Any, results: Any) -> None:
    """Acquire and release each of ``names`` once; sends back (latencies, errors)."""
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
        results.put((latencies, errors))
        connections.close_all()


def create_members(database_url: str, members: int, processes: int) -> dict[str, Any]:
    """Phase 1: every name raced by two processes; the rows checked after."""
    from django.db.models import Count

    from django_semaphore.models import Semaphore

    chunks = [list(range(p, members, processes)) for p in range(processes)]
    plans = []
    for p in range(processes):
        mine = [member(i) for i in chunks[p] + chunks[(p + 1) % processes]]
        random.Random(p).shuffle(mine)
        plans.append(mine)
    latencies, errors, seconds = _run(database_url, create_loop, plans)
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
        "in_use_after": sum(rows.values_list("in_use", flat=True)),
        "seconds": round(seconds, 2),
        "acquires_per_second": round(len(latencies) / seconds, 1),
        **_percentiles(latencies),
    }


# --- phase 2: acquire cost ----------------------------------------------------------


def cycle_loop(database_url: str, name: str, start: Any, duration: float, results: Any) -> None:
    """Acquire and release ``name`` for ``duration`` seconds."""
    configure(database_url)
    from django.db import connections

    from django_semaphore import acquire, release
    from django_semaphore.exceptions import SemaphoreExhausted

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
        results.put((latencies, errors))
        connections.close_all()


def cycles(database_url: str, names: list[str], duration: float) -> dict[str, Any]:
    latencies, errors, _ = _run(database_url, cycle_loop, names, extra=(duration,))
    counted = Counter(errors)
    rejected = counted.pop("rejected", 0)
    return {
        "cycles_per_second": round(len(latencies) / duration, 1),
        "rejected": rejected,
        "errors": dict(counted),
        **_percentiles(latencies),
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median cycles/s, with every run's cycles/s beside it."""
    ranked = sorted(runs, key=lambda run: run["cycles_per_second"])
    errors: Counter[str] = Counter()
    for run in runs:
        errors.update(run["errors"])
    return {
        **ranked[len(ranked) // 2],
        "runs": [run["cycles_per_second"] for run in runs],
        "errors": dict(errors),
    }


def acquire_cost(database_url: str, processes: int, duration: float, repeat: int) -> dict[str, Any]:
    """Phase 2: own semaphore per process, then one shared, member against
    declared; ``repeat`` rounds, alternating which of the two runs first (a
    shared machine's load drifts), the median run kept."""
    from django_semaphore.models import Semaphore

    Semaphore.objects.bulk_create(
        [Semaphore(name=f"{DECLARED}-{p}", capacity=2) for p in range(processes)]
        + [Semaphore(name=DECLARED, capacity=HOT_CAPACITY)]
    )
    # Created by phase 1; from now on with a capacity of its own.
    Semaphore.objects.set_capacity(member(0), HOT_CAPACITY)
    cells = {
        "own, member": [member(p + 1) for p in range(processes)],
        "own, declared": [f"{DECLARED}-{p}" for p in range(processes)],
        "one, member": [member(0)] * processes,
        "one, declared": [DECLARED] * processes,
    }
    runs: dict[str, list[dict[str, Any]]] = {cell: [] for cell in cells}
    for round_ in range(repeat):
        for shape in ("own", "one"):
            order = ("member", "declared") if round_ % 2 == 0 else ("declared", "member")
            for kind in order:
                cell = f"{shape}, {kind}"
                runs[cell].append(cycles(database_url, cells[cell], duration))
    results: dict[str, Any] = {cell: _median(cell_runs) for cell, cell_runs in runs.items()}
    for shape in ("own", "one"):
        mine, declared = results[f"{shape}, member"], results[f"{shape}, declared"]
        results[f"{shape}: member / declared cycles"] = round(
            mine["cycles_per_second"] / declared["cycles_per_second"], 2
        )
        results[f"{shape}: member / declared p50"] = round(mine["p50_ms"] / declared["p50_ms"], 2)
    return results


# --- plumbing -------------------------------------------------------------------------


def _run(
    database_url: str, target: Any, plans: list[Any], extra: tuple[Any, ...] = ()
) -> tuple[list[float], list[str], float]:
    """One spawned process per plan, all started together once each is set
    up; (latencies, errors, seconds from the start)."""
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(len(plans) + 1), context.Queue()
    workers = [
        context.Process(target=target, args=(database_url, plan, start, *extra, results))
        for plan in plans
    ]
    for worker in workers:
        worker.start()
    start.wait(timeout=120)
    began = time.perf_counter()
    latencies: list[float] = []
    errors: list[str] = []
    for _ in workers:
        mine, theirs = results.get(timeout=3600)
        latencies += mine
        errors += theirs
    seconds = time.perf_counter() - began
    for worker in workers:
        worker.join()
        if worker.exitcode:
            errors.append(f"process exit {worker.exitcode}")
    return latencies, errors, seconds


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
