"""@holds_permit on Celery tasks, run by a real worker on a real Redis broker."""

from __future__ import annotations

import itertools
import os
import signal
import time
import uuid
from typing import Any

import pytest
from celery.result import AsyncResult

from django_semaphore import acquire, release
from django_semaphore.exceptions import SemaphoreExhausted
from django_semaphore.models import ParkedTask, PermitRequest, Semaphore
from django_semaphore.owners import TaskOwner
from django_semaphore.states import State
from tests import tasks
from tests.testapp.models import RunLog

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def one(celery_worker: Any) -> Semaphore:
    return Semaphore.objects.create(name=tasks.ONE, capacity=1)


def wait_for(results: list[AsyncResult], timeout: float = 90, settled: bool = True) -> None:
    """Until every task finished and its permit is settled: a worker stores the
    result just before task_postrun, where the permit is released."""
    for result in results:
        result.get(timeout=timeout, propagate=False)
    if not settled:
        return
    deadline = time.monotonic() + 10
    keys = [result.id for result in results]
    while PermitRequest.objects.filter(external_id__in=keys, state=State.ACQUIRED).exists():
        assert time.monotonic() < deadline, "a finished task kept its permit"
        time.sleep(0.05)


def assert_never_overlapping(label: str) -> list[RunLog]:
    runs = list(RunLog.objects.filter(label=label).order_by("started_at"))
    for earlier, later in itertools.pairwise(runs):
        assert earlier.ended_at is not None
        assert earlier.ended_at <= later.started_at, "two runs held a capacity-1 permit at once"
    return runs


def test_tasks_on_a_capacity_one_semaphore_run_one_at_a_time(one):
    results = [tasks.exclusive.delay("one-at-a-time", 0.3) for _ in range(4)]
    results.append(tasks.exclusive_unbound.delay("one-at-a-time", 0.3))
    wait_for(results)

    assert [r.state for r in results] == ["SUCCESS"] * 5, [r.traceback for r in results]
    runs = assert_never_overlapping("one-at-a-time")
    assert sorted(run.task_id for run in runs) == sorted(r.id for r in results)
    tokens = [run.token for run in runs]
    assert tokens == sorted(tokens), "fencing tokens out of grant order"
    requests = PermitRequest.objects.filter(external_id__in=[r.id for r in results])
    assert requests.count() == 5  # keyed by task id, one each
    assert set(requests.values_list("state", flat=True)) == {State.RELEASED}
    assert {TaskOwner.parse(r.owner).task_name for r in requests} == {
        tasks.exclusive.name,
        tasks.exclusive_unbound.name,
    }


def test_by_default_a_refused_task_waits_its_turn_and_never_fails(one):
    """No park=, no PARK_TASKS: a task refused for want of room waits (stands
    by, parks) and spends no retry: with max_retries=0, one would fail it."""
    acquire(tasks.ONE, external_id="held-by-the-test")
    results = [tasks.waits_its_turn.delay("waits", 0.2) for _ in range(6)]
    deadline = time.monotonic() + 30
    while not ParkedTask.objects.exists():  # the worker has three processes
        assert time.monotonic() < deadline, "no refused task parked"
        time.sleep(0.05)
    release("held-by-the-test")
    wait_for(results)

    assert [r.state for r in results] == ["SUCCESS"] * 6, [r.traceback for r in results]
    assert len(assert_never_overlapping("waits")) == 6
    assert not ParkedTask.objects.exists()


def test_exhausted_task_retries_then_fails_without_running(one):
    """park=False: the retries of 0.1."""
    acquire(tasks.ONE, external_id="held-by-the-test")

    result = tasks.impatient.delay("never-runs")
    wait_for([result])

    assert result.state == "FAILURE"
    assert "SemaphoreExhausted" in (result.traceback or "")
    # The error as the result backend (JSON) gives it back: whole.
    assert type(result.result) is SemaphoreExhausted
    assert result.result.names == [tasks.ONE]
    assert str(result.result) == f"No capacity left on: {tasks.ONE}"
    assert not RunLog.objects.filter(label="never-runs").exists()
    assert not PermitRequest.objects.filter(external_id=result.id).exists()


def test_permit_is_kept_across_the_tasks_own_retry(one):
    result = tasks.retries_once.delay("retried")
    wait_for([result])

    assert result.state == "SUCCESS", result.traceback
    first, second = RunLog.objects.filter(label="retried").order_by("started_at")
    assert first.token == second.token  # the same permit, not a new grant
    request = PermitRequest.objects.get(external_id=result.id)
    assert request.state == State.RELEASED
    assert request.permits.count() == 1


def test_another_live_run_of_the_same_task_id_is_not_shared(one):
    """A broker redelivering a task while its first run still works elsewhere."""
    task_id = f"redelivered-while-alive-{uuid.uuid4().hex}"  # results outlive test runs
    alive_elsewhere = TaskOwner(task_id, tasks.impatient.name, "celery@another-host", 4242)
    acquire(tasks.ONE, external_id=task_id, owner=str(alive_elsewhere))

    result = tasks.impatient.apply_async(args=["second-run"], task_id=task_id)
    wait_for([result], settled=False)  # the permit stays with the live run elsewhere

    assert result.state == "FAILURE"
    assert not RunLog.objects.filter(label="second-run").exists()
    assert PermitRequest.objects.get(external_id=task_id).owner == str(alive_elsewhere)


def test_killed_worker_process_redelivers_without_a_second_permit(one, celery_worker):
    result = tasks.slow.delay("killed", 4)
    os.kill(celery_worker.started("killed").pid, signal.SIGKILL)
    wait_for([result])

    assert result.state == "SUCCESS", celery_worker.log_tail()
    first, second = RunLog.objects.filter(label="killed").order_by("started_at")
    assert first.ended_at is None  # killed mid-run
    assert second.pid != first.pid
    assert second.token == first.token  # re-attached to the same permit
    assert list(PermitRequest.objects.filter(external_id__startswith=result.id)) == [
        PermitRequest.objects.get(external_id=result.id, state=State.RELEASED)
    ]


def test_autoretry_keeps_the_permit_until_the_last_attempt(one):
    result = tasks.fails_then_autoretries.delay("autoretried")
    wait_for([result])

    assert result.state == "SUCCESS", result.traceback
    runs = RunLog.objects.filter(label="autoretried")
    assert runs.count() == 3
    assert len({run.token for run in runs}) == 1  # one permit for all three attempts
    assert PermitRequest.objects.get(external_id=result.id).state == State.RELEASED


def test_a_decorated_helper_inside_a_task_holds_its_own_permit(one):
    Semaphore.objects.create(name=tasks.HELPER, capacity=1)

    result = tasks.calls_a_decorated_helper.delay()
    wait_for([result])

    assert result.state == "SUCCESS", result.traceback
    helper_key = result.result
    assert helper_key != result.id  # not the task id: that key is the task's own permit
    assert PermitRequest.objects.get(external_id=helper_key).state == State.RELEASED
    assert PermitRequest.objects.get(external_id=result.id).state == State.RELEASED
