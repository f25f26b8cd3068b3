"""``python -m benchmarks``: every scenario, one table, one JSON file.

python -m benchmarks                        # MariaDB on loopback, processes
python -m benchmarks --postgres             # the same on PostgreSQL
python -m benchmarks --postgres --prepared  # ... with prepared statements
python -m benchmarks --mode threads         # clients as threads of one process
python -m benchmarks --smoke                # a few seconds: does it still run?
python -m benchmarks --fast-commit          # commits that do not wait for the disk
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from benchmarks import db, report
from benchmarks.scenarios import SCENARIOS, Bench, Options

MARIADB = "mysql://semaphore:semaphore@127.0.0.1:33061/bench"
POSTGRES = "postgres://semaphore@127.0.0.1:54321/bench"
REDIS = "redis://127.0.0.1:63791/0"
# Default output: beside the servers' data, out of version control.
RESULTS = Path(__file__).resolve().parent.parent / ".runtime" / "benchmarks"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--database-url", help=f"default: {MARIADB}")
    parser.add_argument("--postgres", action="store_true", help=f"use {POSTGRES}")
    parser.add_argument("--redis-url", default=os.environ.get("SEMAPHORE_REDIS_URL", REDIS))
    parser.add_argument("--mode", choices=["processes", "threads"], default="processes")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per cell")
    parser.add_argument("--clients", default="1,4,16", help="scenario 1 client counts")
    parser.add_argument("--history", type=int, default=1_000_000, help="released rows")
    parser.add_argument("--held", type=int, default=5_000, help="permits held")
    parser.add_argument(
        "--scenarios", default="", help=f"comma-separated subset of {','.join(SCENARIOS)}"
    )
    parser.add_argument(
        "--cleanup-batch", type=int, help="CLEANUP_BATCH_SIZE for scenario 6 (default: the app's)"
    )
    parser.add_argument(
        "--prepared",
        action="store_true",
        help="PostgreSQL: Django's server_side_binding with prepare_threshold 5, as psycopg "
        "runs the raw clients",
    )
    commit = parser.add_mutually_exclusive_group()
    commit.add_argument(
        "--fast-commit",
        action="store_const",
        const="fast",
        dest="commit",
        help="a measuring mode, never a recommendation: commits that do not wait for the "
        "disk (PostgreSQL synchronous_commit=off per session; MariaDB "
        "innodb_flush_log_at_trx_commit=2, a global set for the run and restored after)",
    )
    commit.add_argument(
        "--durable",
        action="store_const",
        const="durable",
        dest="commit",
        help="commits that wait for the log to be written (synchronous_commit=on; "
        "innodb_flush_log_at_trx_commit=1); default: the server's own settings",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per cell (median kept)")
    parser.add_argument("--smoke", action="store_true", help="tiny, a few seconds in all")
    parser.add_argument(
        "--json", type=Path, help="where to write results (default: .runtime/benchmarks/)"
    )
    parser.add_argument("--label", default="", help="a note stored with the results")
    parser.add_argument(
        "--markdown",
        type=Path,
        metavar="JSON",
        help="print a results file as Markdown, run nothing",
    )
    return parser.parse_args(argv)


def options_from(args: argparse.Namespace) -> Options:
    url = args.database_url or (POSTGRES if args.postgres else MARIADB)
    clients = [int(n) for n in args.clients.split(",")]
    options = Options(
        url=url,
        redis_url=args.redis_url,
        mode=args.mode,
        duration=args.duration,
        clients=clients,
        mutex_clients=[1, max(clients)] if max(clients) > 1 else [1],
        many=max(clients),
        multi_clients=max(clients),
        history=args.history,
        held=args.held,
        repeat=max(1, args.repeat),
        scenarios=[s for s in args.scenarios.split(",") if s],
    )
    if args.smoke:
        options.duration = min(args.duration, 0.3)
        options.clients = options.mutex_clients = [2]
        options.many = options.multi_clients = 2
        options.history, options.held, options.repeat = 300, 20, 1
        options.waiting_threads, options.waiting_processes = 8, 2
    return options


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.markdown:
        print(report.markdown(json.loads(args.markdown.read_text())))
        return 0
    options = options_from(args)
    target = db.Target.parse(options.url)
    # Before any connection: the workers and Django's settings read it too.
    os.environ["BENCH_COMMIT"] = args.commit or ""
    db.ensure_database(target)
    commit_set_by, restore_commit = db.apply_commit_mode(target)
    try:
        return _run(args, options, target, commit_set_by)
    finally:
        restore_commit()


def _run(args: argparse.Namespace, options: Options, target: db.Target, commit_set_by: str) -> int:
    os.environ["BENCH_DATABASE_URL"] = options.url
    if args.cleanup_batch:
        os.environ["BENCH_CLEANUP_BATCH"] = str(args.cleanup_batch)
    if args.prepared:
        os.environ["BENCH_PREPARED"] = "1"
    os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.settings"
    import django

    django.setup()

    load_before = os.getloadavg()
    started = time.monotonic()
    say = lambda line: print(line, flush=True)  # noqa: E731
    commit = db.commit_settings(target)
    say(
        f"benchmark on {db.server_version(target)} ({target.vendor}), {options.mode},"
        f" commits: {args.commit or 'server settings'} {commit}"
    )
    bench = Bench(options, say)
    try:
        cells = bench.run()
    finally:
        bench.pool.close()
        bench.data.close()
    report.add_ratios(cells)
    checked = report.checks(cells, options.held, options.history)
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "database": db.server_version(target),
        "vendor": target.vendor,
        "options": {k: v for k, v in asdict(options).items() if k not in {"url", "redis_url"}},
        "label": args.label,
        "prepared": args.prepared,
        "commit_mode": args.commit or "server",
        "commit_settings": commit,
        "commit_set_by": commit_set_by,
        "smoke": args.smoke,
        "commit": _git_commit(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.monotonic() - started, 1),
    }
    print()
    print(report.table(cells))
    print()
    print(report.checks_text(checked))
    print(
        f"\nload average before {meta['load_before']}, after {meta['load_after']}"
        f" on {meta['cpus']} CPUs; {meta['seconds']}s in all"
    )
    path = args.json or RESULTS / f"latest-{target.vendor}-{options.mode}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"meta": meta, "cells": report.as_json(cells), "checks": checked}, indent=1)
    )
    print(f"results: {path}")
    return 0


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
