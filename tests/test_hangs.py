"""A hang fails the run in minutes, with stacks, and leaves no process behind.

Each test runs the deliberately hung tests of ``tests/hung.py`` in a pytest
of its own, with a run id of its own (so only its processes are looked for
and stopped), on SQLite: what is proved is the harness, not a database.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from benchmarks.faults.runner import servers_module

pytestmark = [pytest.mark.once, pytest.mark.timeout(240)]

servers = servers_module()
REPO = Path(__file__).resolve().parent.parent
# Far below CI's limit: the point is that a hang ends the run in minutes.
WITHIN = 120
# The hung test's timeout and the watchdog's grace: long enough for the hung
# child to be spawned and set up (its stacks must show it hanging), no longer.
TIMEOUT = "8"
GRACE = "6"


def run(command: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    run_id = f"hang-{uuid.uuid4().hex[:8]}"
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"DATABASE_URL", "SEMAPHORE_PROGRESS_DIR", "SEMAPHORE_STACKS_DIR"}
    }
    env.update(SEMAPHORE_RUN_ID=run_id, SEMAPHORE_RUNTIME_DIR=str(tmp_path))
    began = time.monotonic()
    result = subprocess.run(
        command,
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=WITHIN + 60,
    )
    elapsed = time.monotonic() - began
    assert servers.processes_of_run(run_id, grace=5) == {}, "the hang left processes running"
    return result, elapsed


def pytest_command(test: str) -> list[str]:
    return [sys.executable, "-m", "pytest", f"tests/hung.py::{test}", "-p", "no:cacheprovider"]


def test_a_hung_child_fails_its_test_at_the_timeout_with_both_stacks(tmp_path):
    result, elapsed = run([*pytest_command("test_a_child_hangs"), "--timeout", TIMEOUT], tmp_path)

    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert elapsed < WITHIN, output
    assert "Timeout" in output, output  # pytest-timeout's stacks of the test process
    assert "hang_forever" in output, output  # the child's, from its stacks file


def test_the_watchdog_stops_a_test_stuck_past_its_timeout(tmp_path):
    """``--timeout 0``: pytest-timeout never fires, as when a signal cannot
    reach the test; the watchdog stops it ``--grace`` seconds later."""
    watched = [sys.executable, "scripts/watchdog.py", "--grace", GRACE, "--"]
    test = pytest_command("test_a_child_hangs")
    result, elapsed = run([*watched, *test, "--timeout", "0"], tmp_path)

    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert elapsed < WITHIN, output
    assert "tests/hung.py::test_a_child_hangs has run" in output, output
    assert "in test_a_child_hangs" in output, output  # the test process's stacks
    assert "in hang_forever" in output, output  # the child's


def test_the_watchdog_stops_a_pytest_that_never_exits(tmp_path):
    """The hang of issue 23: every test passed, then pytest waited at exit
    for what it had started."""
    watched = [sys.executable, "scripts/watchdog.py", "--grace", GRACE, "--"]
    test = pytest_command("test_a_thread_keeps_pytest_from_exiting")
    result, elapsed = run([*watched, *test], tmp_path)

    output = result.stdout + result.stderr
    assert "1 passed" in output, output
    assert result.returncode == 1, output
    assert elapsed < WITHIN, output
    assert "has not exited" in output, output
    assert "in hang_forever" in output, output  # the thread it waits for
