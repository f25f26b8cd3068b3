"""The fault-injection suite's CI subset (``python -m benchmarks.faults --ci``).

Runs every scenario of ``benchmarks/faults`` briefly -- real client processes,
real faults -- on a MariaDB and a Redis of its own (own ports, and its own
runtime dir ``<runtime>/faults`` inside the one ``scripts/servers.py`` owns, so
``servers.py stop`` ends them too), because it restarts and SIGKILLs its
server: the servers the rest of the suite uses are never touched. If they
cannot be started the test fails; it never skips. Marked ``once``: it does
not depend on the database under test, so the test command runs it in one
pass only. The full run (>= 200,000 acquires) is ``python -m benchmarks.faults``;
see docs/faults.md.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from benchmarks.faults.__main__ import CI_MINIMUM, run_all, table
from benchmarks.faults.runner import Servers, own_runtime_dir

pytestmark = [pytest.mark.slow, pytest.mark.once, pytest.mark.timeout(900)]

MARIADB_PORT = int(os.environ.get("FAULTS_CI_MARIADB_PORT", "33091"))
REDIS_PORT = int(os.environ.get("FAULTS_CI_REDIS_PORT", "63811"))


def test_no_invariant_breaks_under_faults(capsys):
    servers = Servers(str(own_runtime_dir()), MARIADB_PORT, REDIS_PORT)
    began = time.monotonic()

    results = run_all(servers, ci=True)

    elapsed = time.monotonic() - began
    with capsys.disabled():
        print(f"\nFault suite (CI subset), {elapsed:.0f}s:\n{table(results)}")
    details = json.dumps(
        [
            {k: r[k] for k in ("scenario", "violations", "examples", "leaked", "counter_drift")}
            for r in results
        ],
        indent=1,
    )
    assert len(results) == 13, "every scenario runs"
    assert sum(r["attempts"] for r in results) >= CI_MINIMUM
    assert all(r["violation_total"] == 0 for r in results), details
    assert all(r["leaked"] == 0 for r in results), details
    assert all(r["counter_drift"] == {} for r in results), details
    # Each scenario's fault really happened, and was survived.
    by_name = {r["scenario"]: r for r in results}
    for name, result in by_name.items():
        assert result["grants"] > 0, name
        if name != "baseline":
            assert result["faults"], f"{name}: no fault was injected"
    assert by_name["lost-response"]["lost_responses_recovered"] > 0
    assert by_name["paused-holder"]["stale_writes_refused"] > 0
    assert by_name["celery-redelivery"]["task_states"] == {
        "SUCCESS": by_name["celery-redelivery"]["tasks"]
    }
