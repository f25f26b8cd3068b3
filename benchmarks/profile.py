"""``python -m benchmarks.profile``: where one acquire+release cycle's time goes.

One process, one client at a time, scenario 1's hot semaphore (capacity 10,
no contention): the seed design's SQL and the app's ``acquire()/release()``,
each for ``--cycles`` cycles after a warm-up. For each it prints

- the statements one cycle sends, in order (counted at the driver, as the
  benchmark's "round trips" column: ``benchmarks/roundtrips.py``);
- client CPU per cycle without a profiler, then cProfile's top functions by
  cumulative and by own CPU time (the thread's, so waits for the server are
  left out), per cycle (cProfile inflates Python's share:
  read the ranking and the proportions, not the absolute figures);
- the server's own count of what it ran: MariaDB ``performance_schema``
  statement digests when it is on, else the session's ``SHOW SESSION STATUS``
  deltas (``Questions``, ``Com_*``, ``Handler_*``) on the client's own
  connection; PostgreSQL ``pg_stat_statements`` when loaded, else
  ``pg_stat_database`` and ``pg_stat_user_tables`` deltas.

python -m benchmarks.profile                      # MariaDB, 2,000 cycles each
python -m benchmarks.profile --postgres --fast-commit
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import db, roundtrips
from benchmarks.__main__ import MARIADB, POSTGRES

NAME, CAPACITY = "hot", 10
ROOT = str(Path(__file__).resolve().parent.parent) + "/"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    parser.add_argument("--database-url", help=f"default: {MARIADB}")
    parser.add_argument("--postgres", action="store_true", help=f"use {POSTGRES}")
    parser.add_argument("--cycles", type=int, default=2000, help="profiled cycles per system")
    parser.add_argument("--top", type=int, default=15, help="functions listed per ranking")
    parser.add_argument("--prepared", action="store_true", help="as python -m benchmarks")
    commit = parser.add_mutually_exclusive_group()
    commit.add_argument("--fast-commit", action="store_const", const="fast", dest="commit")
    commit.add_argument("--durable", action="store_const", const="durable", dest="commit")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    url = args.database_url or (POSTGRES if args.postgres else MARIADB)
    target = db.Target.parse(url)
    os.environ["BENCH_COMMIT"] = args.commit or ""
    os.environ["BENCH_DATABASE_URL"] = url
    os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.settings"
    if args.prepared:
        os.environ["BENCH_PREPARED"] = "1"
    db.ensure_database(target)
    _, restore = db.apply_commit_mode(target)
    try:
        import django

        django.setup()
        roundtrips.install()
        print(
            f"# {db.server_version(target)}, commits: {args.commit or 'server settings'}"
            f" {db.commit_settings(target)}, {args.cycles} cycles each, one client\n"
        )
        from benchmarks import systems

        for system in (systems.SEED, systems.APP):
            profile_one(target, system, args.cycles, args.top)
    finally:
        restore()
    return 0


def profile_one(target: db.Target, system: str, cycles: int, top: int) -> None:
    from benchmarks.fixtures import Data
    from benchmarks.systems import ClientSpec, make_client

    data = Data(target)
    data.create_schema()
    data.reset()
    data.create_semaphores([NAME], CAPACITY)
    client = make_client(ClientSpec(system=system, url=target.url, index=0, names=[NAME]))
    client.setup()

    server = ServerCounters(target, client)
    server.start()  # before the warm-up: PostgreSQL reports its counters late
    warm = max(200, cycles // 10)

    def cycle() -> None:
        if not client.acquire():
            raise RuntimeError(f"{system}: refused on an idle semaphore")
        client.release()

    for _ in range(warm):  # warm: caches, prepared statements
        cycle()
    print(f"## {system}\n")
    with roundtrips.record() as acquire_log:
        client.acquire()
    with roundtrips.record() as release_log:
        client.release()
    print(f"One cycle: {len(acquire_log)} + {len(release_log)} round trips\n")
    for label, log in (("acquire", acquire_log), ("release", release_log)):
        for i, statement in enumerate(log, 1):
            print(f"    {label} {i}. {statement[:200]}")
    print()

    began, cpu, sent = time.perf_counter(), time.thread_time(), roundtrips.count()
    for _ in range(cycles):
        cycle()
    wall, cpu = time.perf_counter() - began, time.thread_time() - cpu
    print(
        f"Without a profiler: {cycles / wall:,.0f} cycles/s, client CPU"
        f" {cpu / cycles * 1e6:,.0f} µs per cycle,"
        f" {(roundtrips.count() - sent) / cycles:.2f} round trips per cycle\n"
    )
    # CPU time, not wall time: the waits for the server drop out.
    profiler = cProfile.Profile(time.thread_time)
    profiler.runcall(_repeat, cycle, cycles)
    server.stop()
    client.close()
    data.close()
    print_profile(pstats.Stats(profiler), cycles, top)
    server.report(warm + 1 + 2 * cycles)


def _repeat(cycle: Callable[[], None], times: int) -> None:
    for _ in range(times):
        cycle()


def print_profile(stats: pstats.Stats, cycles: int, top: int) -> None:
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = stats.total_tt  # type: ignore[attr-defined]
    print(f"cProfile: {total / cycles * 1e6:,.0f} µs of CPU per cycle under the profiler\n")
    layers: dict[str, float] = {}
    for (path, _, _), (_, _, own, _, _) in raw.items():
        layer = _layer(path)
        layers[layer] = layers.get(layer, 0.0) + own
    print("| layer (own CPU, under the profiler) | µs/cycle | share |")
    print("|---|--:|--:|")
    for layer, own in sorted(layers.items(), key=lambda item: -item[1]):
        print(f"| {layer} | {own / cycles * 1e6:.0f} | {own / total:.0%} |")
    print()
    for title, index in (("cumulative", 3), ("own", 2)):
        rows = sorted(raw.items(), key=lambda item: item[1][index], reverse=True)
        rows = [r for r in rows if r[0][2] not in {"_repeat", "cycle", "<built-in method exec>"}]
        print(f"| by {title} time | calls/cycle | own µs/cycle | cumulative µs/cycle |")
        print("|---|--:|--:|--:|")
        for (path, line, func), (_, calls, own, cum, _) in rows[:top]:
            print(
                f"| `{_where(path, line, func)}` | {calls / cycles:.1f}"
                f" | {own / cycles * 1e6:.1f} | {cum / cycles * 1e6:.1f} |"
            )
        print()


LAYERS = [  # the first prefix that matches names a function's layer
    ("django_semaphore/", "the app (django_semaphore)"),
    ("django/db/models/sql/", "Django ORM: SQL compilation"),
    ("django/db/models/", "Django ORM: models, querysets, fields"),
    ("django/db/backends/", "Django database backend"),
    ("django/db/transaction", "Django transactions (atomic)"),
    ("django/", "Django, other"),
    ("MySQLdb/", "driver (MySQLdb, Python side)"),
    ("psycopg/", "driver (psycopg, Python side)"),
    ("benchmarks/", "the benchmark's client and counters"),
]


def _layer(path: str) -> str:
    if path == "~":
        return "C functions (driver's C calls, builtins)"
    short = _where(path, 0, "")
    for prefix, layer in LAYERS:
        if short.startswith(prefix):
            return layer
    return "Python standard library, other"


def _where(path: str, line: int, func: str) -> str:
    if path == "~":
        return func
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    elif path.startswith(ROOT):
        path = path[len(ROOT) :]
    return f"{path}:{line} {func}"


class ServerCounters:
    """What the server says it ran during the profiled cycles."""

    def __init__(self, target: db.Target, client: Any) -> None:
        self.target = target
        self.client = client
        self.admin = db.connect(target, autocommit=True)
        self.before: dict[str, Any] = {}
        self.after: dict[str, Any] = {}
        self.kind = self._kind()

    def _kind(self) -> str:
        cursor = self.admin.cursor()
        if self.target.vendor == "mysql":
            cursor.execute("SELECT @@performance_schema")
            return "digests" if cursor.fetchone()[0] else "session status"
        if self.target.vendor == "postgresql":
            cursor.execute(
                "SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements'"
                " AND current_setting('shared_preload_libraries') LIKE '%pg_stat_statements%'"
            )
            return "pg_stat_statements" if cursor.fetchone() else "pg_stat tables"
        return ""

    def _client_cursor(self) -> Any:
        if hasattr(self.client, "cursor"):
            return self.client.cursor  # the seed's own connection
        from django.db import connection

        return connection.cursor()

    def read(self) -> dict[str, Any]:
        if self.kind == "session status":
            cursor = self._client_cursor()
            cursor.execute(
                "SHOW SESSION STATUS WHERE Variable_name = 'Questions'"
                " OR Variable_name LIKE 'Com\\_%' OR Variable_name LIKE 'Handler\\_%'"
            )
            return {name: int(value) for name, value in cursor.fetchall() if value.isdigit()}
        cursor = self.admin.cursor()
        if self.kind == "digests":
            cursor.execute(
                "SELECT DIGEST_TEXT, COUNT_STAR, SUM_TIMER_WAIT / 1e6, SUM_ROWS_EXAMINED"
                " FROM performance_schema.events_statements_summary_by_digest"
                " WHERE SCHEMA_NAME = DATABASE()"
            )
            return {row[0]: row[1:] for row in cursor.fetchall()}
        if self.kind == "pg_stat_statements":
            cursor.execute(
                "SELECT query, calls, total_exec_time * 1000, total_plan_time * 1000, rows"
                " FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database"
                " WHERE datname = current_database())"
            )
            return {row[0]: row[1:] for row in cursor.fetchall()}
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT xact_commit, xact_rollback, tup_returned, tup_fetched, tup_inserted,"
            " tup_updated, tup_deleted FROM pg_stat_database WHERE datname = current_database()"
        )
        names = ["xact_commit", "xact_rollback", "tup_returned", "tup_fetched"]
        names += ["tup_inserted", "tup_updated", "tup_deleted"]
        out = dict(zip(names, cursor.fetchone(), strict=True))
        cursor.execute(
            "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del, seq_scan,"
            " seq_tup_read, idx_scan, idx_tup_fetch FROM pg_stat_user_tables"
        )
        keys = ["ins", "upd", "hot_upd", "del", "seq_scan", "seq_read", "idx_scan", "idx_fetch"]
        for relname, *values in cursor.fetchall():
            for key, value in zip(keys, values, strict=True):
                out[f"{relname}.{key}"] = value or 0
        return out

    def start(self) -> None:
        self.before = self.read()

    def stop(self) -> None:
        if self.kind == "pg_stat tables":
            # A backend reports its counters when idle, at most once a second.
            self.client.close()
            time.sleep(1.5)
        self.after = self.read()

    def report(self, cycles: int) -> None:
        """``cycles``: the cycles between start and stop (warm-up, the recorded
        one, unprofiled, profiled)."""
        print(f"Server ({self.kind}), per cycle:\n")
        if self.kind in {"digests", "pg_stat_statements"}:
            print("| statement | calls/cycle | server µs/cycle |")
            print("|---|--:|--:|")
            rows = []
            for text, (calls, *rest) in self.after.items():
                old = self.before.get(text, (0, 0))
                delta = calls - old[0]
                if delta > 0:
                    rows.append((sum(rest[:-1]) - sum(old[1:-1]), delta, text))
            for time_us, delta, text in sorted(rows, reverse=True)[:20]:
                print(
                    f"| `{' '.join(str(text).split())[:150]}` | {delta / cycles:.2f}"
                    f" | {float(time_us) / cycles:.1f} |"
                )
        else:
            print("| counter | per cycle |")
            print("|---|--:|")
            for name, value in self.after.items():
                delta = value - self.before.get(name, 0)
                if delta and name != "Questions":
                    print(f"| {name} | {delta / cycles:.2f} |")
            if "Questions" in self.after:
                # Each SHOW SESSION STATUS counts itself once.
                questions = self.after["Questions"] - self.before["Questions"] - 1
                print(f"| **Questions** (statements sent) | **{questions / cycles:.2f}** |")
        print()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
