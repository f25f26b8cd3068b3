"""Real concurrent clients (threads and processes, each with its own database
connection) checked against an independent oracle: a counter of holders kept
outside the database, never trusting the app's own bookkeeping."""

from __future__ import annotations

import uuid

import pytest

from django_semaphore.models import Permit, PermitRequest, Semaphore
from django_semaphore.states import State
from tests.children import SPAWN, Outbox
from tests.clients import (
    CLIENTS,
    Oracle,
    hammer,
    never_refused,
    race_one_key,
    run_clients,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

DURATION = 3.0


def held_now(name: str) -> int:
    return Semaphore.objects.with_usage().get(name=name).in_use


@pytest.mark.parametrize("mode", ["threads", "processes"])
@pytest.mark.parametrize("capacity", [1, 3])
def test_never_more_holders_than_capacity(make_semaphore, mode, capacity):
    name = make_semaphore(capacity=capacity).name
    oracle = Oracle.create([name])

    run_clients(mode, hammer, (oracle, [{name: 1}], DURATION))

    assert oracle.errors.items() == []
    entries = oracle.entries.items()
    assert len(entries) > 20, "too few grants to mean anything"
    assert 1 <= oracle.peak[name].value <= capacity
    # In entry order: each client's entries are kept apart.
    tokens = [token for _, _, token in sorted(entries, key=lambda entry: entry[1])]
    assert len(set(tokens)) == len(tokens), "a fencing token was handed out twice"
    if capacity == 1:
        # With one holder at a time, entry order is grant order.
        assert tokens == sorted(tokens), "fencing tokens went backwards"
    assert held_now(name) == 0


def test_a_capacity_of_every_client_never_refuses(make_semaphore):
    """Room released is there for the next grant: with a capacity of at
    least the number of clients, a grant is never refused, also while
    releases and grants of three semaphores at once contend (processes)."""
    names = [make_semaphore(capacity=CLIENTS).name for _ in range(3)]
    oracle = Oracle.create(names)

    run_clients("processes", never_refused, (oracle, dict.fromkeys(names, 1), DURATION))

    assert oracle.errors.items() == []
    assert len(oracle.entries.items()) > 20 * len(names), "too few grants to mean anything"
    assert all(held_now(name) == 0 for name in names)


@pytest.mark.parametrize("release", ["by request", "by key"])
@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_multi_semaphore_requests_in_opposite_orders(make_semaphore, mode, release):
    """Releases lock the release counters (semaphore id order): by the
    general path, or MariaDB's and PostgreSQL's one statement by key,
    beside grants locking the semaphores (name order), and no deadlock
    surfaces."""
    a, b = make_semaphore(capacity=2).name, make_semaphore(capacity=3).name
    oracle = Oracle.create([a, b])
    demands = [[a, b], [b, a], {b: 2, a: 1}, {a: 1}, {b: 1}]

    run_clients(mode, hammer, (oracle, demands, DURATION, release == "by key"))

    assert oracle.errors.items() == []  # no deadlock ever surfaced
    assert oracle.entries.items()
    assert oracle.peak[a].value <= 2
    assert oracle.peak[b].value <= 3
    # All-or-nothing: every request spanning both holds a permit on each.
    both = PermitRequest.objects.filter(permits__semaphore__name=a).filter(
        permits__semaphore__name=b
    )
    assert both.exists()
    for request in PermitRequest.objects.filter(owner="hammer").prefetch_related("permits"):
        assert request.permits.all(), "a request without permits"
    assert held_now(a) == held_now(b) == 0


@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_racers_on_one_key_are_granted_once(make_semaphore, mode):
    name = make_semaphore(capacity=CLIENTS).name
    for _ in range(3):
        key = uuid.uuid4().hex
        barrier, results = SPAWN.Barrier(CLIENTS), Outbox.create()

        run_clients(mode, race_one_key, (name, key, barrier, results))

        answers = results.items()
        request = PermitRequest.objects.get(external_id=key)
        assert answers == [request.pk] * CLIENTS
        assert Permit.objects.filter(request=request).count() == 1
    assert held_now(name) == 3
    assert Permit.objects.filter(semaphore__name=name, state=State.ACQUIRED).count() == 3
