"""``python -m benchmarks.faults [--ci] [--only a,b]``: run the fault scenarios
on this suite's own MariaDB and Redis, check every history, print the table.

Exit status 1 when any violation or leak was found, or too few acquires ran.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.faults import db
from benchmarks.faults.runner import REPO, Servers, own_runtime_dir, run_scenario
from benchmarks.faults.scenarios import SCENARIOS

FULL_MINIMUM = 200_000
CI_MINIMUM = 20_000
RESULTS = REPO / "benchmarks" / "faults" / "results"


def run_all(
    servers: Servers, *, ci: bool, only: list[str] | None = None, log: Any = print
) -> list[dict[str, Any]]:
    servers.start()
    env = db.env_for(servers.url)
    db.create(servers.url, env)
    # Inside the suite's runtime dir, so even an interrupted run leaves
    # nothing in /tmp.
    work = Path(tempfile.mkdtemp(prefix="histories-", dir=servers.runtime_dir))
    results = []
    try:
        for scenario in SCENARIOS:
            if only and scenario.name not in only:
                continue
            log(f"{scenario.name}: {scenario.what}")
            result = run_scenario(scenario, servers, work / scenario.name, ci, log)
            log(f"  {summary(result)}")
            results.append(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def summary(result: dict[str, Any]) -> str:
    faults = ", ".join(f"{k} {v}" for k, v in result["faults"].items()) or "none"
    return (
        f"{result['attempts']} acquires, {result['grants']} grants in {result['seconds']}s; "
        f"faults: {faults}; violations {result['violation_total']} {result['violations']}; "
        f"leaked {result['leaked']}; TTL-reclaimed overlaps {result['ttl_reclaimed_overlaps']}"
    )


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| scenario | acquire attempts | grants | faults injected | violations"
        " | leaked after sweep |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for r in results:
        faults = "; ".join(f"{k}: {v}" for k, v in r["faults"].items()) or "—"
        lines.append(
            f"| {r['scenario']} | {r['attempts']:,} | {r['grants']:,} | {faults} "
            f"| {r['violation_total']} | {r['leaked']} |"
        )
    total = sum(r["attempts"] for r in results)
    grants = sum(r["grants"] for r in results)
    bad = sum(r["violation_total"] for r in results)
    leaked = sum(r["leaked"] for r in results)
    lines.append(f"| **total** | **{total:,}** | **{grants:,}** | | **{bad}** | **{leaked}** |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__)
    parser.add_argument("--ci", action="store_true", help="the short subset the tests run")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--runtime-dir", default=str(own_runtime_dir()))
    parser.add_argument("--mariadb-port", type=int, default=33081)
    parser.add_argument("--redis-port", type=int, default=63801)
    args = parser.parse_args(argv)
    servers = Servers(args.runtime_dir, args.mariadb_port, args.redis_port)
    began = time.monotonic()
    results = run_all(servers, ci=args.ci, only=[n for n in args.only.split(",") if n])
    elapsed = time.monotonic() - began
    print()
    print(table(results))
    total = sum(r["attempts"] for r in results)
    bad = sum(r["violation_total"] + r["leaked"] for r in results)
    print(f"\n{total:,} acquire attempts in {elapsed:.0f}s; violations + leaks: {bad}")
    RESULTS.mkdir(exist_ok=True)
    name = "latest-ci.json" if args.ci else "latest.json"
    (RESULTS / name).write_text(
        json.dumps({"elapsed": round(elapsed), "results": results}, indent=1) + "\n"
    )
    minimum = CI_MINIMUM if args.ci else FULL_MINIMUM
    if bad or (not args.only and total < minimum):
        for r in results:
            for example in r["examples"]:
                print(f"{r['scenario']}: {example}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
