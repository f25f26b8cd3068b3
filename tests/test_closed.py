"""A closed semaphore (capacity 0), or one an operator shrank below what a
caller asks for, means "no room now": callers wait, views answer 429, tasks
park, and all of them go on when the capacity returns. Only a demand beyond
the capacity settings declare is a programming error (``CapacityExceeded``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
from django.db import connections

from django_semaphore import ReleaseOutcome, acquire, release
from django_semaphore.api import set_capacity
from django_semaphore.exceptions import CapacityExceeded, SemaphoreExhausted
from django_semaphore.models import Semaphore
from tests import tasks, views
from tests.conftest import unique
from tests.test_parked import eventually, parked_ids, settled
from tests.testapp.models import RunLog

pytestmark = pytest.mark.django_db(transaction=True)

DECLARED = "declared-in-settings"  # tests/settings.py declares it with capacity 4


def in_a_thread(call: Any) -> tuple[threading.Thread, list[Any]]:
    """Run ``call`` in a thread with its own connections; the list gets its
    result or the exception it raised."""
    outcome: list[Any] = []

    def body() -> None:
        try:
            outcome.append(call())
        except Exception as exc:
            outcome.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize(("capacity", "count"), [(0, 1), (2, 3)])
def test_a_closed_or_shrunk_semaphore_refuses_for_now_and_a_waiter_goes_on_when_it_reopens(
    capacity, count
):
    name = Semaphore.objects.create(name=unique(), capacity=capacity).name

    with pytest.raises(SemaphoreExhausted):
        acquire({name: count}, external_id=unique())
    started = time.monotonic()
    with pytest.raises(SemaphoreExhausted):
        acquire({name: count}, external_id=unique(), timeout=0.3)
    assert time.monotonic() - started >= 0.3, "the waiter waited its timeout"

    key = unique()
    waiter, outcome = in_a_thread(lambda: acquire({name: count}, external_id=key, timeout=30))
    time.sleep(0.3)
    assert not outcome, "nothing granted while closed"
    set_capacity(name, count)
    waiter.join(timeout=40)
    assert not waiter.is_alive()
    assert [type(o).__name__ for o in outcome] == ["PermitRequest"]
    assert release(key) is ReleaseOutcome.RELEASED


def test_a_demand_beyond_the_declared_capacity_is_a_programming_error_at_once():
    started = time.monotonic()
    with pytest.raises(CapacityExceeded, match=DECLARED):
        acquire({DECLARED: 5}, external_id=unique(), timeout=10)
    assert time.monotonic() - started < 5


def test_a_declared_semaphore_lowered_below_the_demand_waits_for_its_capacity():
    set_capacity(DECLARED, 2)
    try:
        with pytest.raises(SemaphoreExhausted):
            acquire({DECLARED: 3}, external_id=unique())
    finally:
        set_capacity(DECLARED, 4)
    key = unique()
    acquire({DECLARED: 3}, external_id=key)
    release(key)


def test_a_view_on_a_closed_semaphore_answers_429_not_500(client):
    Semaphore.objects.create(name=views.VIEWS, capacity=0)

    response = client.get("/plain/")

    assert response.status_code == 429
    assert "Retry-After" in response
    set_capacity(views.VIEWS, 1)
    assert client.get("/plain/").status_code == 200


# The backlog sent to a closed semaphore; SEMAPHORE_CLOSED_BACKLOG=1000 for
# the figure in docs/parked.md.
BACKLOG = int(os.environ.get("SEMAPHORE_CLOSED_BACKLOG", "6"))


@pytest.mark.slow
def test_tasks_on_a_closed_semaphore_park_and_all_run_once_it_reopens(celery_worker, wakes):
    Semaphore.objects.create(name=tasks.PARK, capacity=0)

    results = [tasks.parked.delay("closed", 0.01) for _ in range(BACKLOG)]
    eventually(lambda: len(parked_ids()) == BACKLOG, "every task parked", 60 + BACKLOG / 5)
    assert not RunLog.objects.filter(label="closed").exists()
    reopened = time.monotonic()
    set_capacity(tasks.PARK, 4)
    settled(results, timeout=60 + BACKLOG / 5)
    drained = time.monotonic() - reopened

    assert [r.state for r in results] == ["SUCCESS"] * BACKLOG, [r.traceback for r in results]
    runs = RunLog.objects.filter(label="closed")
    assert sorted(runs.values_list("task_id", flat=True)) == sorted(r.id for r in results)
    assert parked_ids() == []
    print(f"{BACKLOG} parked tasks drained in {drained:.1f} s once reopened")
