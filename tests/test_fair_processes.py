"""Fair mode across processes: no starvation, first come first served from
the recorded history, and a killed waiter that stops blocking at its deadline.

Meant for MariaDB and PostgreSQL (row locks across processes); SQLite runs
them too, its writers serialized on the file.
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from datetime import timedelta

import pytest
from django.db import connections

from django_semaphore import acquire, release, waiting
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
def test_a_big_request_is_granted_in_fair_mode_and_after_its_starving_bound_without(
    make_semaphore,
):
    fair, plain = make_semaphore(5), make_semaphore(5)
    Semaphore.objects.filter(pk=fair.pk).update(fair=True)
    stop, errors = SPAWN.Event(), Outbox.create()
    streams = [
        spawn(stream, name, stop, errors, bound=90)
        for _ in range(STREAMERS)
        for name in (fair.name, plain.name)
    ]
    # Until both semaphores are full with the stream.
    deadline = time.monotonic() + 45
    while Semaphore.objects.with_usage().filter(pk__in=[fair.pk, plain.pk], in_use=5).count() < 2:
        assert time.monotonic() < deadline, "the stream never filled the semaphores"
        time.sleep(0.05)
    time.sleep(0.5)

    waited: dict[str, float | None] = {}
    bigs = [
        *start_threads(timed_big_acquire, (fair.name, 10, waited), 1),
        *start_threads(timed_big_acquire, (plain.name, 6, waited), 1),
    ]
    join(bigs, within=30)
    stop.set()
    join(streams, within=30)
    assert errors.items() == []

    print(f"\nbig request waited: fair {waited[fair.name]}s, plain {waited[plain.name]}s")
    assert waited[fair.name] is not None
    assert waited[fair.name] < FAIR_BOUND
    # Without fair mode the stream passes it until it has waited its starving
    # bound; then it takes a ticket and the stream queues behind it.
    assert waited[plain.name] is not None, "the big request starved without fair mode"
    assert waited[plain.name] < waiting.STARVING_BOUNDS[1] + FAIR_BOUND


@pytest.mark.slow
def test_grants_follow_ticket_order_per_semaphore(make_semaphore):
    a, b = make_semaphore(2), make_semaphore(3)
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
        tickets, grants = _tickets_and_grants(history.items())
        queued = [k for k, (_, counter) in tickets.items() if counter is not None]
        if len(queued) > 100:
            break
    assert len(queued) > 100, "too little waiting to tell an order"
    violations = []
    for (key, semaphore), (ticket, counter) in tickets.items():
        if counter is None:
            continue  # it never lacked room there: it held back nobody
        token = grants[semaphore][key]
        # Every grant after this ticket came to hold back and before its own
        # grant must have had an older ticket on this semaphore.
        for other, other_token in grants[semaphore].items():
            if counter < other_token < token:
                other_ticket = tickets.get((other, semaphore), (None, None))[0]
                if other_ticket is None or other_ticket > ticket:
                    violations.append((semaphore, key, other))
    print(f"\n{len(queued)} queued grants checked, {sum(map(len, grants.values()))} grants")
    assert violations == []


def _tickets_and_grants(
    history: list[tuple[str, str, int, int, int | None]],
) -> tuple[dict[tuple[str, int], tuple[int, int | None]], dict[int, dict[str, int]]]:
    """(key, semaphore) -> (ticket, the grant counter from when it held
    back), and semaphore -> key -> fencing token of its grant."""
    tickets: dict[tuple[str, int], tuple[int, int | None]] = {}
    grants: dict[int, dict[str, int]] = defaultdict(dict)
    for kind, key, semaphore, number, counter in history:
        if kind == "ticket":
            # A ticket holds back from when its waiter lacked room there.
            held_since = tickets.get((key, semaphore), (None, None))[1]
            tickets[key, semaphore] = (number, counter if held_since is None else held_since)
        else:
            grants[semaphore][key] = number
    return tickets, grants


def test_a_killed_waiter_stops_blocking_at_its_deadline(make_semaphore):
    sem = make_semaphore(1)
    Semaphore.objects.filter(pk=sem.pk).update(fair=True)
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
