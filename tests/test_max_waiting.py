"""``holds_permit(max_waiting=N)``: at most N tasks wait parked on a
semaphore; a task that would park beyond that fails with ``LineFull``,
decided under the semaphores' row locks, so two parking at once never
both pass."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections
from django.utils import timezone

from django_semaphore import acquire, holds_permit, release
from django_semaphore.exceptions import InvalidRequest, LineFull
from django_semaphore.models import ParkedTask, Semaphore, Ticket
from tests import tasks
from tests.conftest import unique
from tests.test_parked import eventually, park, park_row, parked_ids, settled

pytestmark = pytest.mark.django_db(transaction=True)

__all__ = ["park"]  # the real worker's fixture, from test_parked


@pytest.fixture
def held(make_semaphore) -> Semaphore:
    semaphore = make_semaphore(1)
    acquire(semaphore.name, external_id=unique("holder"))
    return semaphore


def test_a_task_beyond_the_limit_is_refused_and_nothing_is_written(held):
    first, second = (park_row({held.name: 1}, max_waiting=2) for _ in range(2))

    with pytest.raises(LineFull) as refused:
        park_row({held.name: 1}, task_id="third", max_waiting=2)

    assert refused.value.names == [held.name]
    assert str(refused.value) == f"2 tasks already wait parked on {held.name}."
    assert parked_ids() == [first, second]
    assert Ticket.objects.count() == 2


def test_a_task_parked_again_keeps_its_place_whatever_the_limit(held):
    first = park_row({held.name: 1}, max_waiting=1)

    park_row({held.name: 1}, task_id=first, max_waiting=1)  # woken, then parked again

    assert parked_ids() == [first]


def test_fair_waiters_and_expired_rows_do_not_count(held):
    now = timezone.now()
    Ticket.objects.create(
        semaphore=held, external_id="fair", created_at=now, expires_at=now + timedelta(minutes=1)
    )
    gone = park_row({held.name: 1})
    Ticket.objects.filter(external_id=gone).update(expires_at=now - timedelta(seconds=1))

    parked = park_row({held.name: 1}, max_waiting=1)

    assert parked_ids() == [gone, parked]


def test_a_woken_task_not_started_yet_waits_no_more(held):
    """Published (its room kept), it is on its way: the line has room for
    the next, and a refusal counts only the tasks that wait."""
    on_its_way = park_row({held.name: 1}, woken_at=timezone.now())
    waiting = park_row({held.name: 1}, max_waiting=1)

    with pytest.raises(LineFull) as refused:
        park_row({held.name: 1}, max_waiting=1)

    assert parked_ids() == [on_its_way, waiting]
    assert str(refused.value) == f"1 tasks already wait parked on {held.name}."


def test_only_the_full_semaphores_are_named(held, make_semaphore):
    free = make_semaphore(1)
    park_row({held.name: 1})

    with pytest.raises(LineFull) as refused:
        park_row({held.name: 1, free.name: 1}, max_waiting=1)

    assert refused.value.names == [held.name]


@pytest.mark.parametrize("bad", [0, -1, "3", 1.5, True])
def test_a_bad_limit_is_refused_when_decorating(bad):
    with pytest.raises(InvalidRequest, match="max_waiting"):
        holds_permit("exports", max_waiting=bad)


@pytest.mark.slow
def test_parking_at_once_never_passes_the_limit(held):
    """Twelve threads park at the same moment with a limit of 4: four are
    parked, eight refused, none beyond."""
    start = threading.Barrier(12)
    outcomes: list[str] = []

    def park_one(n: int) -> None:
        start.wait(timeout=30)
        try:
            park_row({held.name: 1}, task_id=f"racer-{n}", max_waiting=4)
            outcomes.append("parked")
        except LineFull:
            outcomes.append("refused")
        finally:
            connections.close_all()

    # Daemons: one left hanging never keeps the test process from exiting.
    threads = [threading.Thread(target=park_one, args=(n,), daemon=True) for n in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)

    assert sorted(outcomes) == ["parked"] * 4 + ["refused"] * 8
    assert ParkedTask.objects.count() == 4


@pytest.mark.slow
def test_a_flood_parks_three_and_fails_the_rest_with_line_full(park: Any, wakes: Any):
    """A real worker: ten tasks on a held semaphore whose tasks allow three
    in line. Three park (and run once it is released), seven fail with
    ``LineFull``; nothing else is lost or run."""
    acquire(tasks.PARK, external_id="held-by-the-test")
    results = [tasks.parked_at_most_three.delay("flood", 0) for _ in range(10)]
    eventually(lambda: sum(r.state == "FAILURE" for r in results) == 7, "seven refused")
    assert len(parked_ids()) == 3

    release("held-by-the-test")
    settled(results)

    states = [result.state for result in results]
    assert sorted(states) == ["FAILURE"] * 7 + ["SUCCESS"] * 3
    for result in results:
        if result.state == "FAILURE":
            assert isinstance(result.result, LineFull), result.traceback
    assert parked_ids() == []
