"""Fair mode across processes: no starvation, the room of older waiters kept
from the recorded history, and a killed waiter that stops blocking at its
deadline, or once its ticket's lease runs out.

Meant for MariaDB and PostgreSQL (row locks across processes); SQLite runs
them too, its writers serialized on the file.
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.db import connection, connections

from django_semaphore import acquire, release, sweep
from django_semaphore.backends import DatabaseNow
from django_semaphore.conf import app_settings
from django_semaphore.exceptions import AcquireTimeout, SemaphoreExhausted
from django_semaphore.models import Semaphore, Ticket
from tests.children import SPAWN, Outbox, join, spawn, start_threads
from tests.fair_clients import fair_traffic, stream, wait_forever

pytestmark = pytest.mark.django_db(transaction=True)

STREAMERS = 8
# The fair big request is granted once the permits held when it queued are
# released (holds are 10-50 ms) plus a poll or two of the head of the queue
# (HEAD_POLL): a few hundred ms; the bound leaves room for a loaded machine.
FAIR_BOUND = 3.0
# SQLite hands its one write lock to whichever attempt polls first (its busy
# handler sleeps up to 100 ms between tries), not in order: while the stream's
# refused attempts take it back to back on a loaded machine, one attempt of a
# big request may wait up to the busy timeout for it. The bounds there add one.
FIFO_CLIENTS = 6
FIFO_ROUNDS = 3


def timed_big_acquire(name: str, timeout: float, results: dict) -> None:
    started = time.monotonic()
    try:
        acquire({name: 5}, external_id=f"big-{name}", owner="big", timeout=timeout)
        results[name] = time.monotonic() - started
    except AcquireTimeout:
        results[name] = None
    finally:
        connections.close_all()


@pytest.mark.slow
def test_a_big_request_is_granted_in_a_stream_of_small_ones(make_semaphore):
    semaphore = make_semaphore(5)
    stop, errors = SPAWN.Event(), Outbox.create()
    streams = [spawn(stream, semaphore.name, stop, errors, bound=90) for _ in range(STREAMERS)]
    # Until the semaphore is full with the stream.
    deadline = time.monotonic() + 45
    while not Semaphore.objects.with_usage().filter(pk=semaphore.pk, in_use=5).exists():
        assert time.monotonic() < deadline, "the stream never filled the semaphore"
        time.sleep(0.05)
    time.sleep(0.5)

    file_lock = app_settings.LOCK_WAIT_TIMEOUT if connection.vendor == "sqlite" else 0
    waited: dict[str, float | None] = {}
    join(start_threads(timed_big_acquire, (semaphore.name, 10 + file_lock, waited), 1), within=30)
    stop.set()
    join(streams, within=30)
    assert errors.items() == []

    print(f"\nbig request waited: {waited[semaphore.name]}s")
    assert waited[semaphore.name] is not None, "the big request starved"
    assert waited[semaphore.name] < FAIR_BOUND + file_lock


@pytest.mark.slow
def test_a_younger_grant_never_takes_the_room_of_an_older_ticket(make_semaphore):
    a, b = make_semaphore(2), make_semaphore(3)
    capacity = {a.pk: 2, b.pk: 3}
    demands = [{a.name: 1}, {a.name: 2}, {b.name: 1}, {b.name: 3}, {a.name: 1, b.name: 1}]
    history, errors = Outbox.create(), Outbox.create()
    # Rounds of traffic until enough waiting was seen: a busy machine makes
    # less of it a round.
    for _ in range(FIFO_ROUNDS):
        start = SPAWN.Barrier(FIFO_CLIENTS + 1)
        clients = [
            spawn(fair_traffic, demands, start, 4.0, history, errors, bound=90)
            for _ in range(FIFO_CLIENTS)
        ]
        start.wait(timeout=60)
        join(clients, within=90)
        assert errors.items() == []
        tickets, grants, usage = _history(history.items())
        queued = [k for k, ticket in tickets.items() if ticket.counter is not None]
        if len(queued) > 100:
            break
    assert len(queued) > 100, "too little waiting to tell an order"
    violations = []
    younger = 0
    for semaphore, granted in grants.items():
        for key, token in granted.items():
            mine = tickets.get((key, semaphore))
            # The older tickets waiting there, lacking room, when it was granted.
            older = [
                ticket
                for (other, held), ticket in tickets.items()
                if held == semaphore
                and other != key
                and ticket.counter is not None
                and ticket.counter < token < grants[semaphore][other]
                and (mine is None or ticket.id < mine.id)
            ]
            younger += bool(older)
            # Granted past them only beside the room they ask for.
            if usage[semaphore][token] + sum(t.count for t in older) > capacity[semaphore]:
                violations.append((semaphore, key, [t.id for t in older]))
    print(
        f"\n{len(queued)} queued grants checked, {sum(map(len, grants.values()))} grants,"
        f" {younger} granted past older waiters"
    )
    assert violations == []


@dataclass
class _Ticket:
    id: int
    counter: int | None  # the grant counter from when it held back; None: it never did
    count: int


def _history(
    history: list[tuple[str, str, int, int, int | None, int | None]],
) -> tuple[dict[tuple[str, int], _Ticket], dict[int, dict[str, int]], dict[int, dict[int, int]]]:
    """(key, semaphore) -> its ticket; semaphore -> key -> fencing token of
    its grant; semaphore -> fencing token -> permits in use once granted."""
    tickets: dict[tuple[str, int], _Ticket] = {}
    grants: dict[int, dict[str, int]] = defaultdict(dict)
    usage: dict[int, dict[int, int]] = defaultdict(dict)
    for kind, key, semaphore, number, counter, count in history:
        if kind == "ticket":
            # A ticket holds back from when its waiter lacked room there.
            known = tickets.get((key, semaphore))
            held_since = None if known is None else known.counter
            tickets[key, semaphore] = _Ticket(
                number, counter if held_since is None else held_since, int(count or 0)
            )
        elif kind == "usage":
            usage[semaphore][number] = int(counter or 0)
        else:
            grants[semaphore][key] = number
    return tickets, grants, usage


def test_a_killed_waiter_stops_blocking_at_its_deadline(make_semaphore):
    sem = make_semaphore(1)
    holder = "holder-" + sem.name
    acquire(sem.name, external_id=holder)
    doomed = spawn(wait_forever, sem.name, 4.0, bound=60)
    deadline = time.monotonic() + 30
    while not Ticket.objects.filter(semaphore=sem).exists():
        assert time.monotonic() < deadline, "the waiter never queued"
        time.sleep(0.02)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join(10)
    ticket = Ticket.objects.get(semaphore=sem)
    release(holder)

    # Room, but the dead waiter's ticket is older: nobody barges past it...
    with pytest.raises(SemaphoreExhausted):
        acquire(sem.name, external_id="early-" + sem.name)
    # ...until its deadline, with no operator action and no sweep.
    request = acquire(sem.name, external_id="after-" + sem.name, timeout=15)
    assert request.created_at >= ticket.expires_at
    assert request.created_at - ticket.expires_at < timedelta(seconds=2.5)


LEASE = 10.0  # TICKET_LEASE's default, seconds
LATE = 1.5  # what the fail-fast polling below, on a loaded machine, may add


def test_a_killed_waiter_with_a_long_timeout_stops_blocking_within_its_ticket_lease(
    make_semaphore,
):
    """SIGKILLed while it waits with a 600 s timeout: nobody renews its
    ticket, which stops keeping its room within TICKET_LEASE (10 s by
    default) with no sweep run; then the sweep deletes it."""
    sem = make_semaphore(1)
    holder = "holder-" + sem.name
    acquire(sem.name, external_id=holder)
    doomed = spawn(wait_forever, sem.name, 600.0, bound=120)
    deadline = time.monotonic() + 60
    while not Ticket.objects.filter(semaphore=sem).exists():
        assert time.monotonic() < deadline, "the waiter never queued"
        time.sleep(0.02)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join(10)
    killed = time.monotonic()
    ticket = Ticket.objects.annotate(now=DatabaseNow()).get(semaphore=sem)
    assert ticket.expires_at <= ticket.now + timedelta(seconds=LEASE)
    assert Semaphore.objects.get(pk=sem.pk).queued_until == ticket.expires_at
    release(holder)
    with pytest.raises(SemaphoreExhausted):  # kept for the waiter while its lease runs
        acquire(sem.name, external_id="early-" + sem.name)

    while True:  # a newcomer failing fast, every 0.1 s
        try:
            acquire(sem.name, external_id="after-" + sem.name)
            break
        except SemaphoreExhausted:
            assert time.monotonic() - killed < LEASE + LATE, "its room never came back"
            time.sleep(0.1)
    assert time.monotonic() - killed <= LEASE + LATE
    assert sweep.clean_tickets().deleted == 1
    assert not Ticket.objects.filter(semaphore=sem).exists()
