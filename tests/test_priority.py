"""Priority among waiters: a head start in the one line, for waiting calls
and parked tasks alike, bounded so that a low priority never waits forever
(``engine/line.py``, ``PRIORITY_STEP``)."""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connections
from django.test import override_settings

from django_semaphore import acquire, holds_permit, parking, permit, release
from django_semaphore.blockers import why_waiting
from django_semaphore.exceptions import InvalidRequest
from django_semaphore.models import Ticket
from django_semaphore.parking import rows, wake
from tests.conftest import unique
from tests.test_fair import Waiter, key, wait_for_tickets

pytestmark = pytest.mark.django_db(transaction=True)

# Longer than the head wait of the first in line (a release meanwhile is
# its): every waiter is between attempts when the room comes.
SETTLED = 0.3


def served_in_turn(order: list[str], *waiters: Waiter) -> None:
    """Each waiter granted in turn (within 20 s), then released so that the
    next one can be; every waiter joined, none failed."""
    for waiter in waiters:
        deadline = time.monotonic() + 20
        while waiter.key not in order:
            assert time.monotonic() < deadline, f"{waiter.key} never granted"
            time.sleep(0.01)
        release(waiter.key)
    for waiter in waiters:
        waiter.finish()
        assert waiter.error is None


def test_a_high_priority_waiter_goes_ahead_of_the_older_ones(make_semaphore):
    semaphore = make_semaphore(1)
    holder = key()
    acquire(semaphore.name, external_id=holder)
    order: list[str] = []
    low = [Waiter(semaphore.name, order, timeout=30) for _ in range(3)]
    for count, waiter in enumerate(low, start=1):
        waiter.start()
        wait_for_tickets(semaphore.name, count)
    urgent = Waiter(semaphore.name, order, timeout=30, priority=100)
    urgent.start()
    wait_for_tickets(semaphore.name, 4)
    time.sleep(SETTLED)
    assert list(Ticket.objects.in_line().values_list("external_id", flat=True)) == [
        urgent.key,
        *(waiter.key for waiter in low),
    ]

    release(holder)
    served_in_turn(order, urgent, *low)
    assert order == [urgent.key, *(waiter.key for waiter in low)]


@override_settings(DJANGO_SEMAPHORE={"PRIORITY_STEP": timedelta(milliseconds=5)})
def test_a_low_priority_waiter_is_passed_only_within_its_aging_bound(make_semaphore):
    """PRIORITY_STEP 5 ms: priority 100 is a head start of 0.5 s. A waiter
    that waited longer than that is passed by no newcomer, whatever its
    priority; one that came within it is."""
    semaphore = make_semaphore(1)
    holder = key()
    acquire(semaphore.name, external_id=holder)
    order: list[str] = []
    patient = Waiter(semaphore.name, order, timeout=30)
    patient.start()
    wait_for_tickets(semaphore.name, 1)
    time.sleep(1.0)  # past its bound: 100 x 5 ms
    late = Waiter(semaphore.name, order, timeout=30, priority=100)
    late.start()
    wait_for_tickets(semaphore.name, 2)
    time.sleep(SETTLED)

    release(holder)
    served_in_turn(order, patient, late)
    assert order == [patient.key, late.key]


@pytest.mark.slow
@override_settings(DJANGO_SEMAPHORE={"PRIORITY_STEP": timedelta(milliseconds=10)})
def test_a_low_priority_waiter_runs_within_its_bound_in_a_stream_of_urgent_work(
    make_semaphore,
):
    """4 threads take and give back a capacity of 1 at priority 100, holding
    20 ms, for 8 s; a priority-0 waiter that comes meanwhile is passed by
    those that come within 100 x 10 ms after it, then by none: granted
    within that bound and the urgent ones already ahead, long before the
    stream ends."""
    semaphore = make_semaphore(1)
    stop = threading.Event()
    errors: list[Exception] = []

    def urgent() -> None:
        try:
            while not stop.is_set():
                taken = key()
                acquire(semaphore.name, external_id=taken, timeout=30, priority=100)
                time.sleep(0.02)
                release(taken)
        except Exception as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    stream = [threading.Thread(target=urgent, daemon=True) for _ in range(4)]
    for thread in stream:
        thread.start()
    try:
        time.sleep(1.0)  # the stream keeps the semaphore busy
        started = time.monotonic()
        patient = key()
        acquire(semaphore.name, external_id=patient, timeout=8)
        waited = time.monotonic() - started
        release(patient)
    finally:
        stop.set()
        for thread in stream:
            thread.join(30)
    assert errors == []
    assert not any(thread.is_alive() for thread in stream)
    print(f"\npriority 0 waited {waited:.2f}s in a stream of priority 100 (bound 1 s)")
    assert waited < 4.0


def park(demand: dict[str, int], priority: int = 0) -> str:
    task_id = unique("task")
    row = rows.Row(task_id, task_id, "tests.parked", b"{}", "application/json", "utf-8", None)
    row = dataclasses.replace(row, priority=priority)
    parking._insert(connections["default"], row, demand, None)
    return task_id


def test_a_priority_100_task_behind_500_parked_ones_is_woken_by_the_next_release(
    make_semaphore, published
):
    semaphore = make_semaphore(1)
    acquire(semaphore.name, external_id="holder")
    backlog = [park({semaphore.name: 1}) for _ in range(500)]
    urgent = park({semaphore.name: 1}, priority=100)

    release("holder")
    assert wake.wake("default", [semaphore.pk]) == 1
    assert published == [urgent]
    parking.started(urgent, {semaphore.name: 1})
    release(urgent)
    assert wake.wake("default", [semaphore.pk]) == 1
    assert published == [urgent, backlog[0]]


def test_why_waiting_and_the_status_say_the_priority(make_semaphore):
    semaphore = make_semaphore(1)
    acquire(semaphore.name, external_id="holder")
    order: list[str] = []
    low = Waiter(semaphore.name, order, timeout=30)
    low.start()
    wait_for_tickets(semaphore.name, 1)
    urgent = Waiter(semaphore.name, order, timeout=30, priority=50)
    urgent.start()
    wait_for_tickets(semaphore.name, 2)
    try:
        waiting = why_waiting(low.key)
        assert waiting is not None
        [blocker] = waiting.blockers
        assert (blocker.older, blocker.by_priority) == (1, 1)
        assert "1 waiter(s) ahead (1 by priority)" in "\n".join(waiting.explained())
        assert "priority 50" in why_waiting(urgent.key).explained()[0]

        out = StringIO()
        call_command("semaphore_status", semaphore.name, stdout=out)
        lines = out.getvalue().splitlines()
        first, second = lines[lines.index("") + 3 :]
        assert (urgent.key in first, first.split()[-2:]) == (True, ["50", "-"])
        assert (low.key in second, second.split()[-2:]) == (True, ["0", "-"])
    finally:
        release("holder")
        served_in_turn(order, urgent, low)


@pytest.mark.parametrize("priority", [101, -101, 1.5, "5", True, None])
def test_a_priority_outside_djangos_range_is_refused(make_semaphore, priority):
    semaphore = make_semaphore(1)
    with pytest.raises(InvalidRequest, match="priority"):
        acquire(semaphore.name, external_id=key(), priority=priority)
    with pytest.raises(InvalidRequest, match="priority"), permit(semaphore.name, priority=priority):
        pass
    if priority is not None:
        with pytest.raises(InvalidRequest, match="priority"):
            holds_permit(semaphore.name, priority=priority)


def test_holds_permit_computes_the_priority_of_each_call(make_semaphore, monkeypatch):
    from django_semaphore import api

    semaphore = make_semaphore(1)
    seen: list[int] = []
    real = api.acquire

    def recording(*args, **kwargs):
        seen.append(kwargs["priority"])
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "acquire", recording)

    @holds_permit(semaphore.name, priority=lambda urgent: 90 if urgent else -10)
    def work(urgent: bool) -> str:
        return "done"

    assert (work(True), work(urgent=False)) == ("done", "done")
    assert seen == [90, -10]

    @holds_permit(semaphore.name, priority=lambda: 500)
    def wrong() -> None: ...

    with pytest.raises(InvalidRequest, match="priority"):
        wrong()
