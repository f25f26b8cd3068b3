"""The Celery scenario: a real prefork worker (8 processes) on this suite's
Redis, tasks holding permits keyed by their task id, pool processes SIGKILLed
mid-task. With ``acks_late`` and ``reject_on_worker_lost`` the broker
redelivers the task; its new run must re-attach to the same permit (same
request, same fencing token) rather than take a second one."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.faults import checker, db
from benchmarks.faults.history import read
from benchmarks.faults.scenarios import SEMAPHORES, Scenario

CONCURRENCY = 8
REPO = Path(__file__).resolve().parents[2]  # the worker runs from the checkout


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def run(scenario: Scenario, servers: Any, out: Path, ci: bool, log: Any) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    url = servers.url
    db.reset(url, SEMAPHORES)
    queue = f"faults-{uuid.uuid4().hex[:8]}"
    env = db.env_for(
        url,
        FAULTS_REDIS_URL=servers.redis_url,
        FAULTS_CELERY_QUEUE=queue,
        FAULTS_CELERY_HISTORY=str(out),
        C_FORCE_ROOT="1",
    )
    nodename = f"{queue}@{os.uname().nodename}"
    worker_log = out / "worker.log"
    with worker_log.open("wb") as output:
        worker = subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", "benchmarks.faults.celery_app", "worker",
                "--pool=prefork", f"--concurrency={CONCURRENCY}", f"--queues={queue}",
                f"--hostname={nodename}", "--without-gossip", "--without-mingle",
                "--without-heartbeat", "--loglevel=WARNING",
            ],
            env=env, cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
    seconds = scenario.seconds(ci)
    count = int(seconds * 12)
    submit = subprocess.run(
        [sys.executable, "-m", "benchmarks.faults.celery_run", "submit", str(count)],
        env=env, cwd=REPO, check=True, capture_output=True, text=True,
    )  # fmt: skip
    task_ids = json.loads(submit.stdout.strip().splitlines()[-1])
    began = time.monotonic()
    kills = 0
    try:
        # Kill pool processes while tasks run; then let everything finish.
        while time.monotonic() - began < seconds:
            time.sleep(scenario.every * random.uniform(0.5, 1.5))
            busy = [pid for pid in _children(worker.pid) if _running_task(out, pid)]
            if busy:
                os.kill(random.choice(busy), signal.SIGKILL)
                kills += 1
        states = _wait(env, REPO, task_ids, timeout=180)
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    elapsed = time.monotonic() - began
    time.sleep(checker.seconds_until_expired(url) + 0.1)  # every TTL runs out, then one sweep
    before_sweep = checker.held(url)
    # Before the sweep, whose verifier would correct (and count) a drift.
    drift = checker.counter_drift(url)
    swept = json.loads(
        subprocess.run(
            [sys.executable, "-m", "benchmarks.faults.sweep_once"],
            env=env, cwd=REPO, check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]
    )  # fmt: skip
    histories = sorted(out.glob("task-*.jsonl"))
    result = checker.check(url, histories, drift)
    result.pop("faults_fired")
    with db.cursor(url) as cur:
        # When each key was granted and released, in the audit's (commit) order.
        cur.execute(
            "SELECT ext, MIN(CASE WHEN op = 'I' THEN id END), MIN(CASE WHEN op = 'U' THEN id END)"
            " FROM faults_audit WHERE tbl = 'R' GROUP BY ext"
        )
        spans = {ext: (granted, released) for ext, granted, released in cur.fetchall()}
    extra = _check_redelivery(histories, task_ids, states, spans)
    for kind, n in extra.pop("violations").items():
        result["violations"][kind] = result["violations"].get(kind, 0) + n
        result["violation_total"] += n
    result.update(extra)
    result.update(
        scenario=scenario.name,
        what=scenario.what,
        seconds=round(elapsed, 1),
        clients=CONCURRENCY,
        faults={"pool processes SIGKILLed mid-task": kills},
        held_before_sweep=before_sweep,
        sweep=swept,
        leftover_clients=0,
    )
    return result


def _running_task(out: Path, pid: int) -> bool:
    """Whether the pool process ``pid`` is inside a task body (granted, not done)."""
    path = out / f"task-{pid}.jsonl"
    if not path.exists():
        return False
    last = None
    for event in read(path):
        last = event["e"]
    return last == "ok"


def _wait(env: dict[str, str], repo: Path, task_ids: list[str], timeout: float) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.faults.celery_run", "wait", str(timeout)],
        input=json.dumps(task_ids), env=env, cwd=repo, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _check_redelivery(
    histories: list[Path],
    task_ids: list[str],
    states: dict[str, str],
    spans: dict[str, tuple[int | None, int | None]],
) -> dict[str, Any]:
    """Every task succeeded; a redelivered run re-attached to its task's
    permit (same request, same token) unless that permit had been reclaimed."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in histories:
        for event in read(path):
            if event["e"] == "ok":
                runs[event["task"]].append(event)
    violations: dict[str, int] = defaultdict(int)
    reattached = regranted = 0
    for task_id in task_ids:
        if states.get(task_id) != "SUCCESS":
            violations["task did not succeed"] += 1
        oks = runs.get(task_id, [])
        if not oks:
            violations["task never ran under a permit"] += 1
        by_key: dict[str, set[int]] = defaultdict(set)
        for ok in oks:
            by_key[ok["k"]].add(ok["id"])
        if any(len(ids) > 1 for ids in by_key.values()):
            violations["duplicate grant"] += 1
        # A run takes a new permit (<id>~2, ...) only once the previous one
        # had ended (reclaimed, or released by a run that finished before a
        # redelivery): never beside a live one.
        generations = sorted(by_key, key=lambda key: int(key.partition("~")[2] or 1))
        for earlier, later in itertools.pairwise(generations):
            ended, began = spans.get(earlier, (None, None))[1], spans.get(later, (None, None))[0]
            if ended is None or began is None or began < ended:
                violations["two permits held at once for one task"] += 1
        reattached += sum(1 for key in by_key for ok in oks if ok["k"] == key) - len(by_key)
        regranted += len(by_key) - 1 if by_key else 0
    return {
        "violations": dict(violations),
        "tasks": len(task_ids),
        "runs_reattached": reattached,
        "runs_regranted_after_ttl": regranted,
        "task_states": dict(sorted(_count(states.values()).items())),
    }


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for value in values:
        counts[value] += 1
    return counts


def _cli() -> None:
    """``submit N`` / ``wait TIMEOUT``: run with the worker's settings."""
    import django

    django.setup()
    from celery.result import AsyncResult

    from benchmarks.faults.celery_app import app
    from benchmarks.faults.tasks import NAMES, TASKS

    app.conf.task_default_queue = os.environ["FAULTS_CELERY_QUEUE"]
    if sys.argv[1] == "submit":
        ids = []
        for _ in range(int(sys.argv[2])):
            name = random.choice(NAMES)
            ids.append(TASKS[name].delay(0.4).id)
        print(json.dumps(ids))
        return
    task_ids = json.loads(sys.stdin.read())
    deadline = time.monotonic() + float(sys.argv[2])
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = {task_id: AsyncResult(task_id, app=app).state for task_id in task_ids}
        if all(state in ("SUCCESS", "FAILURE") for state in states.values()):
            break
        time.sleep(0.5)
    print(json.dumps(states))


if __name__ == "__main__":
    _cli()
