"""The released-request clean-up over a big table, with acquires running.

Fills the database with N requests released 9 days ago (each with its
permit, on the semaphore being acquired), then runs ``sweep.clean_released``
while client processes acquire and release that semaphore in a loop, and
reports:

- the clean-up: total time, rows per second, batches, and the longest batch
  (wall time of one batch: its SELECT ... FOR UPDATE, two DELETEs and COMMIT,
  an upper bound on how long it held any row lock);
- acquire latency before (baseline) and during the clean-up: median, p99, worst.

Usage (the database must exist; it is migrated, and its semaphore tables are
emptied first)::

    python -m benchmarks.cleanup_load \\
        --database-url mysql://semaphore:semaphore@127.0.0.1:33061/cleanup_bench \\
        --rows 1000000 --clients 4

``tests/test_sweep_load.py`` runs the same thing with 100,000 rows.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SEMAPHORE = "cleanup-bench"
AGE_DAYS = 9  # older than the 7-day RELEASED_RETENTION


def configure(database_url: str, app_settings: dict[str, Any] | None = None) -> None:
    """Django settings for a standalone run (the client processes too), with
    ``app_settings`` as ``DJANGO_SEMAPHORE``."""
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
        DJANGO_SEMAPHORE=app_settings or {},
    )
    django.setup()


# --- filling ------------------------------------------------------------------------


def fill_old_released(rows: int, alias: str = "default") -> int:
    """Insert ``rows`` requests released ``AGE_DAYS`` ago, one permit each, on
    the semaphore ``SEMAPHORE`` (created with capacity 8 if missing); the
    fencing counter is moved past their tokens. Returns the semaphore id."""
    from django.db import connections, transaction

    from django_semaphore.guards import engine_writes
    from django_semaphore.models import Permit, PermitRequest, Semaphore

    connection = connections[alias]
    semaphore, _ = Semaphore.objects.using(alias).get_or_create(
        name=SEMAPHORE, defaults={"capacity": 8}
    )
    request_table = connection.ops.quote_name(PermitRequest._meta.db_table)
    permit_table = connection.ops.quote_name(Permit._meta.db_table)
    vendor = connection.vendor
    prefix = uuid.uuid4().hex[:8]
    with connection.cursor() as cursor:
        first_id = _max_id(cursor, request_table) + 1
        if vendor == "mysql":
            # The recursive CTE below counts to ``rows``.
            variable = (
                "max_recursive_iterations" if _is_mariadb(cursor) else "cte_max_recursion_depth"
            )
            cursor.execute(f"SET SESSION {variable} = %s", [rows + 1])
        old = {
            "mysql": f"UTC_TIMESTAMP(6) - INTERVAL {AGE_DAYS} DAY",
            "postgresql": f"STATEMENT_TIMESTAMP() - INTERVAL '{AGE_DAYS} days'",
            "sqlite": f"STRFTIME('%Y-%m-%d %H:%M:%f', 'now', '-{AGE_DAYS} days')",
        }[vendor]
        key = f"CONCAT('{prefix}-', n)" if vendor == "mysql" else f"'{prefix}-' || n"
        select = f"SELECT {key}, 'bench', 'RELEASED', NULL, NULL, {old}, {old}, {old}, 'released'"
        with transaction.atomic(using=alias):
            cursor.execute(
                f"INSERT INTO {request_table} (external_id, owner, state, ttl, expires_at,"
                " created_at, updated_at, released_at, release_reason) "
                + _numbers(vendor, rows, select)
            )
            cursor.execute(
                f"INSERT INTO {permit_table} (semaphore_id, request_id, count, state,"
                f" fencing_token) SELECT %s, id, 1, 'RELEASED', id FROM {request_table}"
                " WHERE id >= %s",
                [semaphore.pk, first_id],
            )
            top = _max_id(cursor, request_table)
            with engine_writes():  # the permits above were written with raw SQL too
                Semaphore.objects.using(alias).filter(
                    pk=semaphore.pk, fencing_counter__lt=top
                ).update(fencing_counter=top)
    if vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {request_table}")
            cursor.execute(f"ANALYZE {permit_table}")
    return semaphore.pk


def _max_id(cursor: Any, table: str) -> int:
    cursor.execute(f"SELECT COALESCE(MAX(id), 0) FROM {table}")
    return int(cursor.fetchone()[0])


def _is_mariadb(cursor: Any) -> bool:
    cursor.execute("SELECT VERSION()")
    return "mariadb" in str(cursor.fetchone()[0]).lower()


def _numbers(vendor: str, rows: int, select: str) -> str:
    """``select`` run over the numbers 1..rows, each as ``n``."""
    if vendor == "postgresql":
        return f"{select} FROM generate_series(1, {rows}) AS numbers(n)"
    return (
        "WITH RECURSIVE numbers(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM numbers"
        f" WHERE n < {rows}) {select} FROM numbers"
    )


# --- acquiring clients -----------------------------------------------------------------


def acquire_loop(
    database_url: str | None, stop: Any, results: Any, client: int, pause: float = 0.0
) -> None:
    """Acquire and release ``SEMAPHORE`` until ``stop`` is set; sends back
    (start time, acquire seconds, release seconds, error) per cycle."""
    if database_url is not None:
        configure(database_url)
    from django.db import connections

    from django_semaphore import acquire, release

    samples: list[tuple[float, float, float, str]] = []
    try:
        while not stop.is_set():
            key = f"load-{client}-{uuid.uuid4().hex}"
            started = time.time()
            try:
                acquire(SEMAPHORE, external_id=key, owner=f"client {client}", ttl=60, timeout=10)
            except Exception as exc:
                samples.append((started, time.time() - started, 0.0, repr(exc)))
                continue
            acquired = time.time()
            release(key)
            samples.append((started, acquired - started, time.time() - acquired, ""))
            if pause:
                time.sleep(pause)
    finally:
        results.put(samples)
        for connection in connections.all():
            connection.close()


@dataclass
class Load:
    """Client processes (or threads) acquiring while something else runs."""

    database_url: str | None
    clients: int
    threads: bool = False
    samples: list[tuple[float, float, float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        if self.threads:
            self._stop: Any = threading.Event()
            self._results: Any = __import__("queue").Queue()
            start: Callable[..., Any] = threading.Thread
        else:
            self._stop, self._results = context.Event(), context.Queue()
            start = context.Process
        # Daemons: one left behind by a failed run never keeps the driver from exiting.
        self._workers = [
            start(
                target=acquire_loop,
                args=(self.database_url, self._stop, self._results, i),
                daemon=True,
            )
            for i in range(self.clients)
        ]

    def __enter__(self) -> Load:
        for worker in self._workers:
            worker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        try:
            # Drained before the joins: a child cannot exit while its samples fill the pipe.
            for _ in self._workers:
                self.samples.extend(self._results.get(timeout=120))
            for worker in self._workers:
                worker.join(timeout=30)
        finally:
            for worker in self._workers:
                if isinstance(worker, multiprocessing.process.BaseProcess) and worker.is_alive():
                    worker.kill()

    def between(self, start: float, end: float) -> list[tuple[float, float, float, str]]:
        return [s for s in self.samples if start <= s[0] < end]


def latency_summary(samples: list[tuple[float, float, float, str]]) -> dict[str, float]:
    acquires = sorted(s[1] for s in samples if not s[3])
    if not acquires:
        return {"count": 0, "errors": len(samples)}
    return {
        "count": len(acquires),
        "errors": sum(1 for s in samples if s[3]),
        "p50_ms": 1000 * statistics.median(acquires),
        "p99_ms": 1000 * acquires[min(len(acquires) - 1, int(len(acquires) * 0.99))],
        "max_ms": 1000 * acquires[-1],
        "release_max_ms": 1000 * max(s[2] for s in samples if not s[3]),
    }


class LockWaitMonitor:
    """MariaDB: polls ``INNODB_LOCK_WAITS`` from its own connection and keeps
    the longest wait seen whose blocker is the clean-up's session. Sampling
    (every 10 ms): a wait shorter than that may be missed; a long one is not."""

    def __init__(self, blocker_thread_id: int, interval: float = 0.01) -> None:
        self.blocker = blocker_thread_id
        self.interval = interval
        self.samples = 0
        self.waits_seen = 0
        self.longest_ms = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll)

    def __enter__(self) -> LockWaitMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        from django.db import connections

        sql = (
            "SELECT r.trx_mysql_thread_id, TIMESTAMPDIFF(MICROSECOND, r.trx_wait_started, NOW(6))"
            " FROM information_schema.INNODB_LOCK_WAITS w"
            " JOIN information_schema.INNODB_TRX r ON r.trx_id = w.requesting_trx_id"
            " JOIN information_schema.INNODB_TRX b ON b.trx_id = w.blocking_trx_id"
            " WHERE b.trx_mysql_thread_id = %s"
        )
        try:
            with connections["default"].cursor() as cursor:
                while not self._stop.is_set():
                    cursor.execute(sql, [self.blocker])
                    rows = cursor.fetchall()
                    self.samples += 1
                    self.waits_seen += len(rows)
                    for _, micros in rows:
                        self.longest_ms = max(self.longest_ms, (micros or 0) / 1000)
                    time.sleep(self.interval)
        finally:
            connections.close_all()


# --- the run ---------------------------------------------------------------------------


@dataclass
class CleanupRun:
    rows: int
    fill_seconds: float
    cleanup_seconds: float
    deleted: int
    permits: int
    batches: int
    longest_batch_ms: float
    lock_hold_ms: dict[str, float]
    slow_batches: int
    lock_waits: str
    waits_behind_cleanup: int | None  # None: not sampled (only on MariaDB)
    baseline: dict[str, float]
    during: dict[str, float]
    errors: list[str]

    def lines(self) -> list[str]:
        def fmt(summary: dict[str, float]) -> str:
            if not summary.get("count"):
                return f"no acquires ({summary.get('errors', 0)} errors)"
            return (
                f"{summary['count']:.0f} acquires, p50 {summary['p50_ms']:.1f} ms, "
                f"p99 {summary['p99_ms']:.1f} ms, worst {summary['max_ms']:.1f} ms "
                f"(worst release {summary['release_max_ms']:.1f} ms), "
                f"{summary['errors']:.0f} errors"
            )

        return [
            f"filled {self.rows:,} old released requests (+ permits) in {self.fill_seconds:.1f} s",
            f"clean-up: {self.deleted:,} requests + {self.permits:,} permits in "
            f"{self.cleanup_seconds:.1f} s ({self.deleted / max(self.cleanup_seconds, 1e-9):,.0f} "
            f"requests/s), {self.batches} batches, longest batch {self.longest_batch_ms:.0f} ms",
            "row locks held per batch (FOR UPDATE to COMMIT): "
            + ", ".join(f"{k} {v:.0f} ms" for k, v in self.lock_hold_ms.items())
            + f", {self.slow_batches} batches over 250 ms",
            self.lock_waits,
            f"acquires before: {fmt(self.baseline)}",
            f"acquires during: {fmt(self.during)}",
        ]


def run(
    rows: int,
    clients: int,
    *,
    database_url: str | None = None,
    threads: bool = False,
    baseline_seconds: float = 5.0,
    batch_size: int | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> CleanupRun:
    """Fill, measure a baseline, then clean up under load. Needs Django set up."""
    from django.db import connection

    from django_semaphore import sweep

    started = time.monotonic()
    fill_old_released(rows)
    fill_seconds = time.monotonic() - started
    log(f"filled {rows:,} rows in {fill_seconds:.1f} s")
    batch_ends: list[float] = []

    def progress(report: sweep.CleanupReport) -> None:
        batch_ends.append(time.monotonic())
        if report.batches % 250 == 0:
            log(f"  {report.deleted:,} deleted")

    lock_starts: list[float] = []

    def note_lock_start(execute: Any, sql: str, *args: Any) -> Any:
        # The batch's id SELECT (FOR UPDATE where the database has it; on
        # SQLite the write lock is taken by BEGIN IMMEDIATE just before).
        if sql.lstrip().upper().startswith("SELECT") and " LIMIT " in sql.upper():
            lock_starts.append(time.monotonic())
        return execute(sql, *args)

    with Load(database_url, clients, threads=threads) as load:
        time.sleep(1.0)  # clients connected and warm
        baseline_start = time.time()
        time.sleep(baseline_seconds)
        cleanup_start_wall, cleanup_start = time.time(), time.monotonic()
        monitor = _lock_wait_monitor(connection)
        with monitor, connection.execute_wrapper(note_lock_start):
            report = sweep.clean_released(
                time_budget=None, batch_size=batch_size, progress=progress
            )
        cleanup_seconds = time.monotonic() - cleanup_start
        cleanup_end_wall = time.time()
    previous, longest = cleanup_start, 0.0
    for end in batch_ends:
        longest, previous = max(longest, end - previous), end
    # Each batch locks its rows with its id SELECT and holds them
    # until its COMMIT, which returns just before the progress callback.
    holds = sorted(
        1000 * (end - max(start for start in lock_starts if start < end)) for end in batch_ends
    )
    return CleanupRun(
        rows=rows,
        fill_seconds=fill_seconds,
        cleanup_seconds=cleanup_seconds,
        deleted=report.deleted,
        permits=report.permits,
        batches=report.batches,
        longest_batch_ms=1000 * longest,
        lock_hold_ms={
            "p50": statistics.median(holds),
            "p99": holds[int(len(holds) * 0.99)],
            "max": holds[-1],
        }
        if holds
        else {},
        slow_batches=sum(1 for hold in holds if hold > 250),
        lock_waits=(
            f"{monitor.samples} samples of INNODB_LOCK_WAITS: {monitor.waits_seen} waits behind"
            f" the clean-up seen, longest {monitor.longest_ms:.0f} ms"
            if isinstance(monitor, LockWaitMonitor)
            else "lock waits not sampled on this database"
        ),
        waits_behind_cleanup=monitor.waits_seen if isinstance(monitor, LockWaitMonitor) else None,
        baseline=latency_summary(load.between(baseline_start, cleanup_start_wall)),
        during=latency_summary(load.between(cleanup_start_wall, cleanup_end_wall)),
        errors=sorted({s[3] for s in load.samples if s[3]}),
    )


def _lock_wait_monitor(connection: Any) -> Any:
    import contextlib

    if connection.vendor != "mysql":
        return contextlib.nullcontext()
    with connection.cursor() as cursor:
        if not _is_mariadb(cursor):
            return contextlib.nullcontext()
        cursor.execute("SELECT CONNECTION_ID()")
        return LockWaitMonitor(int(cursor.fetchone()[0]))


def explain_batch_select() -> str:
    """The plan of one batch's SELECT (MySQL/MariaDB, PostgreSQL)."""
    from django.db import connection, transaction

    from django_semaphore.conf import app_settings
    from django_semaphore.models import PermitRequest
    from django_semaphore.states import State
    from django_semaphore.sweep import batches

    old = PermitRequest.objects.filter(
        state=State.RELEASED, released_at__lte=batches._ago(app_settings.RELEASED_RETENTION)
    ).order_by("released_at")
    if connection.vendor == "sqlite":
        return ""
    query = old.select_for_update(skip_locked=True).values_list("pk", flat=True)[:800]
    with transaction.atomic():
        return str(query.explain())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL"))
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--baseline-seconds", type=float, default=10.0)
    parser.add_argument("--batch-size", type=int, default=None)
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("--database-url (or BENCH_DATABASE_URL) is required")
    configure(args.database_url)
    from django.core.management import call_command
    from django.db import connection

    from django_semaphore.guards import engine_writes
    from django_semaphore.models import CapacityChange, Permit, PermitRequest, Semaphore

    call_command("migrate", verbosity=0)
    with engine_writes():  # a wholesale reset of the benchmark's database
        Permit.objects.all().delete()
        PermitRequest.objects.all()._raw_delete("default")
        CapacityChange.objects.all().delete()
        Semaphore.objects.filter(name=SEMAPHORE).delete()
    with connection.cursor() as cursor:
        cursor.execute("SELECT VERSION()" if connection.vendor != "sqlite" else "SELECT 'sqlite'")
        version = cursor.fetchone()[0]
    print(f"{connection.vendor} {version}, {args.rows:,} rows, {args.clients} client processes")
    result = run(
        args.rows,
        args.clients,
        database_url=args.database_url,
        baseline_seconds=args.baseline_seconds,
        batch_size=args.batch_size,
        log=print,
    )
    for line in result.lines():
        print(line)
    for error in result.errors:
        print("error:", error)
    print(explain_batch_select())
    return 1 if result.errors or result.deleted != args.rows else 0


if __name__ == "__main__":
    sys.exit(main())
