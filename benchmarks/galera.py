"""``python -m benchmarks.galera``: the app on the 3-node Galera cluster.

Spawned clients acquire, hold for a moment and release one capacity-3
semaphore: all connected to node 1, then spread over the three nodes (with
the default 3 attempts per acquire, then 10).
An oracle outside the database counts holders; afterwards every node must
show one fencing token per grant, none twice. Prints a table and writes
``benchmarks/results/galera.json``; exits 1 on any over-grant, raw error or
token mismatch, or when fewer than ``--min-attempts`` acquires ran.

    eval "$(python3 scripts/servers.py start galera)"
    python -m benchmarks.galera                  # 3 x 90 s
    python -m benchmarks.galera --duration 5 --min-attempts 0   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import queue
import random
import sys
import time
import uuid
from contextlib import suppress
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks import db

DATABASE = "bench_galera"
DEFAULT_URLS = ",".join(
    f"mysql://semaphore:semaphore@127.0.0.1:{port}/semaphore" for port in (33071, 33072, 33073)
)
RESULTS = Path(__file__).resolve().parent / "results" / "galera.json"
SEMAPHORE = "galera-bench"
SPAWN = multiprocessing.get_context("spawn")


@dataclass
class Shared:
    """Counters shared by the client processes: the oracle and the tallies."""

    guard: Any
    holders: Any
    peak: Any
    over: Any  # grants that made the holders exceed capacity
    attempts: Any
    grants: Any
    exhausted: Any
    conflicts: Any  # grant transactions failed by deadlock / certification
    gave_up: Any  # acquires that raised LockContention after every retry
    errors: Any  # anything else, as text

    @classmethod
    def create(cls) -> Shared:
        values = [SPAWN.Value("q", 0, lock=False) for _ in range(8)]
        return cls(SPAWN.Lock(), *values, errors=SPAWN.Queue())


@dataclass
class ModeResult:
    mode: str
    clients: int
    seconds: float
    attempts: int
    grants: int
    exhausted: int
    conflicts: int
    gave_up: int
    peak_holders: int
    over_capacity_grants: int
    errors: list[str]
    tokens_checked_on_nodes: int

    @property
    def grants_per_second(self) -> float:
        return self.grants / self.seconds

    @property
    def conflicts_per_grant(self) -> float:
        return self.conflicts / max(1, self.grants)


def client(
    url: str, shared: Shared, capacity: int, hold: float, duration: float, retries: int
) -> None:
    """One spawned client on the node ``url`` points at."""
    os.environ["BENCH_DATABASE_URL"] = url
    os.environ["BENCH_RETRY_ATTEMPTS"] = str(retries)
    os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.settings"
    import django

    django.setup()
    from django.db import connections

    from django_semaphore import acquire, backends, release
    from django_semaphore.exceptions import LockContention, SemaphoreExhausted

    counts = dict.fromkeys(("attempts", "grants", "exhausted", "conflicts", "gave_up"), 0)
    classify = backends.classify

    def counting_classify(connection: Any, exc: Any) -> Any:
        failure = classify(connection, exc)
        counts["conflicts"] += failure is backends.Failure.CONTENTION
        return failure

    backends.classify = counting_classify  # type: ignore[assignment]
    deadline = time.monotonic() + duration
    try:
        while time.monotonic() < deadline:
            key = uuid.uuid4().hex
            counts["attempts"] += 1
            try:
                acquire(SEMAPHORE, external_id=key, owner="bench")
            except SemaphoreExhausted:
                counts["exhausted"] += 1
                time.sleep(random.uniform(0, 0.003))
                continue
            except LockContention:
                counts["gave_up"] += 1
                continue
            counts["grants"] += 1
            with shared.guard:
                shared.holders.value += 1
                shared.peak.value = max(shared.peak.value, shared.holders.value)
                shared.over.value += shared.holders.value > capacity
            time.sleep(hold)
            with shared.guard:
                shared.holders.value -= 1
            release(key)
    except Exception as exc:
        shared.errors.put(f"{type(exc).__name__}: {exc}")
    finally:
        with shared.guard:
            for name, count in counts.items():
                getattr(shared, name).value += count
        connections.close_all()


def node_url(url: str) -> str:
    return url.rsplit("/", 1)[0] + f"/{DATABASE}"


def prepare(urls: list[str], capacity: int) -> None:
    """A fresh database (replicated to every node), migrated, with the semaphore."""
    target = db.Target.parse(urls[0])
    conn = db.connect(target, database="", autocommit=True)
    with conn.cursor() as cursor:
        cursor.execute(f"DROP DATABASE IF EXISTS {DATABASE}")
        cursor.execute(f"CREATE DATABASE {DATABASE} CHARACTER SET utf8mb4")
    conn.close()
    os.environ["BENCH_DATABASE_URL"] = node_url(urls[0])
    os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.settings"
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from django_semaphore.models import Semaphore

    Semaphore.objects.create(name=SEMAPHORE, capacity=capacity)


def reset(urls: list[str]) -> None:
    """Between modes: no permits, counter back to 0."""
    from django_semaphore.guards import engine_writes
    from django_semaphore.models import Permit, PermitRequest, Semaphore

    with engine_writes():  # a wholesale reset, not a Django developer's write
        Permit.objects.all().delete()
        PermitRequest.objects.all().delete()
        Semaphore.objects.filter(name=SEMAPHORE).update(fencing_counter=0)


def tokens_agree(urls: list[str], grants: int) -> int:
    """On every node: the counter equals the grants and the tokens are 1..grants."""
    from django_semaphore.models import Permit, Semaphore

    for url in urls:
        conn = db.connect(db.Target.parse(node_url(url)), autocommit=True)
        with conn.cursor() as cursor:
            cursor.execute("SET SESSION wsrep_sync_wait = 1")
            cursor.execute(
                f"SELECT id, fencing_counter FROM {Semaphore._meta.db_table} WHERE name = %s",
                [SEMAPHORE],
            )
            semaphore_id, counter = cursor.fetchone()
            cursor.execute(
                f"SELECT fencing_token FROM {Permit._meta.db_table} WHERE semaphore_id = %s"
                " ORDER BY fencing_token",
                [semaphore_id],
            )
            tokens = [token for (token,) in cursor.fetchall()]
        conn.close()
        if counter != grants or tokens != list(range(1, grants + 1)):
            raise SystemExit(f"{url}: counter {counter}, {len(tokens)} tokens for {grants} grants")
    return len(urls)


# (label, clients spread over the three nodes?, RETRY_ATTEMPTS)
MODES = [
    ("one node", False, 3),
    ("three nodes", True, 3),
    ("three nodes, RETRY_ATTEMPTS=10", True, 10),
]


def run_mode(
    mode: tuple[str, bool, int],
    urls: list[str],
    clients: int,
    capacity: int,
    hold: float,
    duration: float,
) -> ModeResult:
    label, spread, retries = mode
    reset(urls)
    shared = Shared.create()
    nodes = [urls[i % 3] for i in range(clients)] if spread else [urls[0]] * clients
    workers = [
        SPAWN.Process(
            target=client,
            args=(node_url(url), shared, capacity, hold, duration, retries),
            daemon=True,  # one that hangs never keeps the driver from exiting
        )
        for url in nodes
    ]
    began = time.monotonic()
    for worker in workers:
        worker.start()
    deadline = began + duration + 300
    errors = []
    # Drained while joining: a child cannot exit while what it put fills the pipe.
    while any(worker.is_alive() for worker in workers) and time.monotonic() < deadline:
        with suppress(queue.Empty):
            errors.append(shared.errors.get(timeout=0.2))
    seconds = time.monotonic() - began
    while not shared.errors.empty():
        errors.append(shared.errors.get())
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            errors.append("a client process hung")
    if any(worker.exitcode != 0 for worker in workers):
        errors.append("a client process failed")
    return ModeResult(
        mode=label,
        clients=clients,
        seconds=round(min(seconds, duration), 1),
        attempts=shared.attempts.value,
        grants=shared.grants.value,
        exhausted=shared.exhausted.value,
        conflicts=shared.conflicts.value,
        gave_up=shared.gave_up.value,
        peak_holders=shared.peak.value,
        over_capacity_grants=shared.over.value,
        errors=errors,
        tokens_checked_on_nodes=tokens_agree(urls, shared.grants.value),
    )


def table(results: list[ModeResult], capacity: int) -> str:
    lines = [
        f"| clients on | clients | attempts | grants/s | conflicts per grant | gave up "
        f"| peak holders (capacity {capacity}) | over-capacity grants | raw errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.mode} | {r.clients} | {r.attempts:,} | {r.grants_per_second:,.0f} "
            f"| {r.conflicts_per_grant:.2f} | {r.gave_up} | {r.peak_holders} "
            f"| {r.over_capacity_grants} | {len(r.errors)} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.galera", description=__doc__)
    parser.add_argument("--urls", default=os.environ.get("SEMAPHORE_GALERA_URLS", DEFAULT_URLS))
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--capacity", type=int, default=3)
    parser.add_argument("--hold", type=float, default=0.005, help="seconds a permit is held")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds per mode")
    parser.add_argument("--min-attempts", type=int, default=50_000)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    urls = args.urls.split(",")
    if len(urls) != 3:
        parser.error("--urls must list the 3 nodes")

    prepare(urls, args.capacity)
    results = []
    for mode in MODES:
        print(f"{mode[0]}: {args.clients} clients, {args.duration:g}s ...", file=sys.stderr)
        results.append(run_mode(mode, urls, args.clients, args.capacity, args.hold, args.duration))
    print(table(results, args.capacity))
    attempts = sum(r.attempts for r in results)
    failed = [r for r in results if r.errors or r.over_capacity_grants]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "when": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                "settings": vars(args) | {"output": str(args.output)},
                "results": [
                    asdict(r)
                    | {
                        "grants_per_second": round(r.grants_per_second, 1),
                        "conflicts_per_grant": round(r.conflicts_per_grant, 3),
                    }
                    for r in results
                ],
            },
            indent=2,
        )
        + "\n"
    )
    if failed:
        print(f"FAILED: {[asdict(r) for r in failed]}", file=sys.stderr)
        return 1
    if attempts < args.min_attempts:
        print(f"only {attempts} attempts, fewer than {args.min_attempts}", file=sys.stderr)
        return 1
    print(f"{attempts:,} acquire attempts, 0 over-capacity grants", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
