"""The benchmarks' smoke modes run, end to end.

No timing is asserted: only that every scenario produced sane figures and that
neither the app nor the seed design reported an error. The main benchmark runs
on each database under test (its raw SQL, server CPU and mutex peers differ by
vendor); the parked one in one pass only (see its test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

ROOT = Path(__file__).resolve().parent.parent


def smoke_database_url(tmp_path: Path) -> str:
    """A database of the benchmark's own beside the one under test."""
    settings = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{tmp_path / 'bench-smoke.sqlite3'}"
    name = f"{settings['NAME']}_bench_smoke"
    password = f":{settings['PASSWORD']}" if settings.get("PASSWORD") else ""
    scheme = "mysql" if connection.vendor == "mysql" else "postgres"
    host = settings.get("HOST") or "127.0.0.1"
    return f"{scheme}://{settings['USER']}{password}@{host}:{settings['PORT']}/{name}"


# Slow: scenario 7 times its waiters' queueing against a warm-up, and once
# failed beside the side-by-side passes (its errors are shown below now).
@pytest.mark.slow
def test_smoke_mode_produces_sane_results(tmp_path):
    output = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    command = [
        sys.executable,
        "-m",
        "benchmarks",
        "--smoke",
        "--database-url",
        smoke_database_url(tmp_path),
        "--json",
        str(output),
    ]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    results = json.loads(output.read_text())
    cells = results["cells"]
    scenarios = {cell["scenario"].split()[0] for cell in cells}
    assert {"1", "2", "3", "4", "5", "6", "7", "mutex"} <= scenarios
    for cell in cells:
        assert cell["cycles_per_s"] >= 0
        if cell["scenario"].startswith("7"):  # waiters never granted: statements only
            # The waiters' own errors, whole: pytest cuts a cell's repr short.
            assert cell["errors"] == 0, (cell["system"], cell["extra"].get("errors"), cell["extra"])
            assert cell["extra"]["statements_per_s"] > 0, cell
        elif cell["system"].startswith(("app", "seed")):
            assert cell["errors"] == 0, cell
            # Its counts first: pytest cuts a cell's repr short.
            assert cell["cycles"] > 0, (cell["system"], cell["rejections"], cell["extra"])
            assert cell["p50_ms"] <= cell["p99_ms"] <= cell["max_ms"], cell
            assert cell["client_cpu_ms"] > 0, cell
            # Statements per cycle, counted at the driver (benchmarks/roundtrips.py).
            assert cell["round_trips"] >= 2, cell
            # The test command's servers run on this machine: /proc has them.
            if connection.vendor != "sqlite":
                assert cell["server_cpu_ms"] is not None, cell
                assert cell["server_cpu_ms"] >= 0, cell
    assert any(check["figure"].startswith("errors") for check in results["checks"])
    assert "cycles/s" in run.stdout  # the table was printed


# Slow: its figures (woken by the sweep, stand-by waits) want a quiet machine.
@pytest.mark.slow
@pytest.mark.once
def test_parked_benchmark_smoke_mode_drains_without_failures(tmp_path):
    """``python -m benchmarks.parked --smoke``: a real prefork worker on the
    test Redis; tasks with the defaults park, all run once, none fails, no
    stall needs the sweep; a family's members cost a process one stand-by;
    identical sends under ``discard`` from processes at once run one task.

    Marked ``once``: what it adds is the benchmark's own Celery and Redis
    plumbing, the same on any database; parking and waking on each database's
    locks are tested per database in test_parked and test_tenants, and the
    benchmark's database set-up by the main smoke above."""
    from django.conf import settings

    output = tmp_path / "parked.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    redis_url = settings.CELERY_BROKER_URL.rsplit("/", 1)[0] + "/6"
    command = [
        sys.executable, "-m", "benchmarks.parked", "--smoke",
        "--modes", "unlimited,default,retried,family,discard",
        "--database-url", smoke_database_url(tmp_path), "--redis-url", redis_url,
        "--json", str(output),
    ]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    results = {r["mode"]: r for r in json.loads(output.read_text())["results"]}
    assert set(results) == {"unlimited", "default", "retried", "family", "discard"}
    parked = results["default"]  # no park=: tasks park by default
    assert (parked["ran"], parked["ran_twice"], parked["failed"]) == (40, 0, 0), parked
    assert parked["woken_by_sweep"] == 0, parked
    assert (parked["left_in_broker"], parked["parked_left"]) == (0, 0), parked
    assert parked["messages_per_task"] <= 2, parked
    family = results["family"]  # stand-by learned per family: one wait a process at most
    assert (family["ran"], family["failed"]) == (20, 0), family
    assert family["standby_waits_per_process_max"] <= 1, family
    discard = results["discard"]  # identical sends at once: one ran, all told its id
    assert (discard["ran"], discard["told_ids"], discard["failed"]) == (1, 1, 0), discard
    assert discard["told_the_run"], discard


@pytest.mark.slow
@pytest.mark.once
def test_own_tasks_benchmark_smoke_mode_drains_without_failures(tmp_path):
    """``python -m benchmarks.own_tasks --smoke``: real django-tasks-db
    workers drain a backlog through one semaphore; none fails, never more
    than the capacity at once. Marked ``once``: the database's part is
    tested per database in test_django_tasks."""
    output = tmp_path / "own_tasks.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    command = [
        sys.executable, "-m", "benchmarks.own_tasks", "--smoke",
        "--database-url", smoke_database_url(tmp_path), "--json", str(output),
    ]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    unlimited, limited = json.loads(output.read_text())
    assert (unlimited["ran"], unlimited["failed"]) == (40, 0), unlimited
    assert (limited["ran"], limited["failed"]) == (40, 0), limited
    assert 1 <= limited["most_at_once"] <= limited["capacity"], limited


def test_rates_checker_counts_every_window_over_the_limit():
    from benchmarks.rates import SECOND, windows_over

    # A window starts at every grant and ends before the grant a second
    # later: [0, 1 s) and [1 us, 1 s + 1 us) hold 2 each, [1 s, 2 s) holds 3.
    times = [0, 1, SECOND, SECOND + 1, SECOND + 2]
    assert windows_over(times, 2) == {"grants": 5, "windows_over": 1, "max_in_window": 3}
    assert windows_over(times, 3)["windows_over"] == 0
    assert windows_over([], 1) == {"grants": 0, "windows_over": 0, "max_in_window": 0}


def rates_database_url(tmp_path: Path) -> str:
    """A database of its own: the main smoke may empty its own meanwhile."""
    return smoke_database_url(tmp_path).replace("_bench_smoke", "_bench_rates_smoke")


@pytest.mark.once  # test_rates checks the same limit on every database
def test_rates_benchmark_smoke_mode_keeps_its_limits(tmp_path):
    """``python -m benchmarks.rates --smoke``, the app's figures: the grant
    log never holds more than the rate in a window (an invariant, not a
    timing), and every cell ran without errors."""
    output = tmp_path / "rates.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    command = [
        sys.executable, "-m", "benchmarks.rates", "--smoke", "--figures", "limit,pair,history",
        "--database-url", rates_database_url(tmp_path), "--json", str(output),
    ]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    figures = json.loads(output.read_text())["figures"]
    limit = figures["limit"]
    assert limit["grants"] > 0, limit
    assert (limit["windows_over"], limit["errors"]) == (0, 0), limit
    assert limit["max_in_window"] <= limit["rate"], limit
    for side in ("mine", "base"):
        assert figures["pair"][side]["cycles_per_s"] > 0, figures["pair"]
        assert figures["pair"][side]["errors"] == 0, figures["pair"]
    history = figures["history"]
    assert history["seeded"]["slots"] == history["history"], history
    for part in ("wide", "limited"):
        assert history[part]["mine"]["errors"] == history[part]["base"]["errors"] == 0, history
    assert history["wide"]["mine"]["cycles_per_s"] > 0, history
    for counted in history["limited"]["windows"].values():
        assert counted["grants"] > 0, history
        assert counted["windows_over"] == 0, history


@pytest.mark.once
def test_rates_benchmark_celery_smoke_mode_runs_real_workers(tmp_path):
    """The Celery figure of ``python -m benchmarks.rates --smoke``: two real
    worker nodes with ``rate_limit`` on the test Redis ran tasks, and left
    nothing of theirs in Redis. Marked ``once``: it touches no database."""
    import redis
    from django.conf import settings

    output = tmp_path / "rates-celery.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    redis_url = settings.CELERY_BROKER_URL.rsplit("/", 1)[0] + "/7"
    command = [
        sys.executable, "-m", "benchmarks.rates", "--smoke", "--figures", "celery",
        "--database-url", rates_database_url(tmp_path), "--redis-url", redis_url,
        "--json", str(output),
    ]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    (celery,) = json.loads(output.read_text())["figures"]["celery"]
    assert celery["grants"] > 0, celery
    left = redis.Redis.from_url(redis_url).keys("*bench-rates*")
    assert left == [], left


@pytest.mark.once
def test_why_benchmark_answers_for_the_last_of_a_line(tmp_path):
    """``python -m benchmarks.why``, small: why_waiting, ``--why`` and both
    admin pages answer for the last parked task of a line (the benchmark
    checks the answer: it lacks room, every other task older)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    command = [
        sys.executable, "-m", "benchmarks.why", "--parked", "200", "--repeat", "2",
        "--database-url", smoke_database_url(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for what in ("why_waiting", "--why", "admin page", "semaphore page"):
        assert f"  {what} " in run.stdout
