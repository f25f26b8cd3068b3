"""``python -m benchmarks.families`` runs, small, on the database under test.

No timing is asserted: only that every name raced by two processes was
created once, and that nothing raised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_benchmark_smoke import ROOT, smoke_database_url

pytestmark = pytest.mark.slow


def test_members_created_by_racing_processes_once_without_errors(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    command = [sys.executable, "-m", "benchmarks.families", "--database-url"]
    command += [smoke_database_url(tmp_path), "--members", "120", "--processes", "3"]
    # Long enough for every cell to grant, on SQLite's one writer too.
    command += ["--duration", "2", "--repeat", "1"]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    results = json.loads(run.stdout)
    creation = results["creation"]
    assert (creation["created"], creation["duplicates"], creation["errors"]) == (120, 0, {})
    assert creation["in_use_after"] == 0
    for cell in ("own, member", "own, declared", "one, member", "one, declared"):
        assert results["acquire"][cell]["errors"] == {}
        assert results["acquire"][cell]["cycles_per_second"] > 0
