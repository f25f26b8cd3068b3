"""Waiting for room (``waiting``): one poller per process and semaphore, a
release in the same process handing over at once, first come first served
among a process's waiters, no starvation across processes, and on
PostgreSQL a release elsewhere waking a waiter through NOTIFY.

Behaviour, not timings: every wait that a wake-up must cut short is made
far longer (``SLOW``) than the bound asserted.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from django_semaphore import acquire, release, waiting
from django_semaphore.exceptions import AcquireTimeout
from django_semaphore.waiting import waiters
from tests.children import SPAWN, Outbox, join, spawn
from tests.waiting_clients import SLOW, cycle, wait_slowly

pytestmark = pytest.mark.django_db(transaction=True)

# Far below SLOW: only a wake-up grants a waiter this soon.
WOKEN_WITHIN = 10.0
# The longest wait of a waiter in a busy line: the queue ahead of it, with
# room for a loaded machine.
STARVED = 5.0


def key() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def slow_probes(monkeypatch, holds):
    """Probes and attempts ``SLOW`` apart in this process."""
    for constant in ("PROBE_EVERY", "NEXT_IN_LINE_ATTEMPT", "POLL_CAP"):
        monkeypatch.setattr(waiting, constant, SLOW)
    monkeypatch.setattr(waiting, "PROBE_BOUNDS", (SLOW, SLOW))


def queued(count: int, within: float = 10.0) -> None:
    """Until this process has ``count`` waiters."""
    deadline = time.monotonic() + within
    while len({id(w) for q in waiters.WAITERS.queues.values() for w in q}) < count:
        assert time.monotonic() < deadline, f"{count} waiters never queued"
        time.sleep(0.005)


class Waiter(threading.Thread):
    """acquire() with a timeout in a thread; appends its key to ``order``
    when granted, then holds until ``release_at`` is set."""

    def __init__(self, names, order: list[str]) -> None:
        super().__init__(daemon=True)
        self.names, self.order = names, order
        self.key = key()
        self.error: Exception | None = None
        self.granted_at: float | None = None

    def run(self) -> None:
        try:
            acquire(self.names, external_id=self.key, timeout=WOKEN_WITHIN * 2)
            self.granted_at = time.monotonic()
            self.order.append(self.key)
        except Exception as exc:
            self.error = exc
        finally:
            connections.close_all()

    def finish(self) -> None:
        self.join(WOKEN_WITHIN * 3)
        assert not self.is_alive(), f"waiter {self.key} still waiting"
        assert self.error is None


def test_a_release_in_the_same_process_hands_over_at_once(make_semaphore, slow_probes):
    semaphore = make_semaphore(1)
    holder = key()
    acquire(semaphore.name, external_id=holder)
    waiter = Waiter(semaphore.name, [])
    waiter.start()
    queued(1)
    time.sleep(0.1)  # in its pause, SLOW long
    released = time.monotonic()
    release(holder)
    waiter.finish()
    assert waiter.granted_at is not None
    assert waiter.granted_at - released < WOKEN_WITHIN
    release(waiter.key)


def test_a_process_waiters_are_granted_first_come_first_served(make_semaphore, slow_probes):
    semaphore = make_semaphore(1)
    holder = key()
    acquire(semaphore.name, external_id=holder)
    order: list[str] = []
    waiters = []
    for count in range(1, 5):
        waiters.append(Waiter(semaphore.name, order))
        waiters[-1].start()
        queued(count)
    # Each grant is handed on by the release before it.
    release(holder)
    for waiter in waiters:
        deadline = time.monotonic() + WOKEN_WITHIN
        while waiter.key not in order:
            assert time.monotonic() < deadline, "the room was not handed on"
            time.sleep(0.005)
        release(waiter.key)
    for waiter in waiters:
        waiter.finish()
    assert order == [w.key for w in waiters]


def test_a_newcomer_with_a_timeout_queues_behind_this_process_waiters(make_semaphore, slow_probes):
    semaphore = make_semaphore(1)
    holder = key()
    acquire(semaphore.name, external_id=holder)
    order: list[str] = []
    first = Waiter(semaphore.name, order)
    first.start()
    queued(1)
    release(holder)  # the room is the waiter's: a newcomer does not take it
    newcomer = key()
    with pytest.raises(AcquireTimeout):
        acquire(semaphore.name, external_id=newcomer, timeout=0.2)
    first.finish()
    assert order == [first.key]
    release(first.key)


def test_one_poller_per_process_and_semaphore_whatever_the_demands(make_semaphore, monkeypatch):
    semaphore, other = make_semaphore(3), make_semaphore(3)
    acquire({semaphore.name: 3}, external_id=key())
    polling: list[int] = []
    inside = [0]
    lock = threading.Lock()
    real = waiting.pause

    def counted(*args) -> None:
        with lock:
            inside[0] += 1
            polling.append(inside[0])
        try:
            real(*args)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(waiting, "pause", counted)
    demands = [{semaphore.name: 1}, {semaphore.name: 2}, {semaphore.name: 1, other.name: 1}]
    errors: list[Exception] = []

    def wait(demand) -> None:
        try:
            with pytest.raises(AcquireTimeout):
                acquire(demand, external_id=key(), timeout=1.5)
        except Exception as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=wait, args=(d,), daemon=True) for d in demands * 4]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert polling, "nobody polled"
    assert max(polling) == 1, "more than one waiter of this process polled the semaphore"


@pytest.mark.slow
def test_no_process_starves(make_semaphore):
    """8 processes, capacity 2, 20 ms holds: every process gets
    grants and no acquire waits anywhere near its timeout (before: some got
    1 or 2 in 5 s, and with ``timeout=5`` 4-6 timed out)."""
    semaphore = make_semaphore(2)
    start, grants = SPAWN.Barrier(8), Outbox.create()
    clients = [spawn(cycle, semaphore.name, start, 3.0, 0.02, grants, bound=90) for _ in range(8)]
    join(clients, within=60)
    reports = grants.items()
    print(f"\n(grants, timeouts, longest wait) per process: {sorted(reports)}")
    assert len(reports) == 8
    assert [timeouts for _, timeouts, _ in reports] == [0] * 8
    assert all(granted for granted, _, _ in reports), "a process starved"
    # The queue ahead: well under a second; the timeout (10 s) is never near.
    assert max(longest for _, _, longest in reports) < STARVED


def test_a_release_elsewhere_wakes_a_waiter_through_notify(make_semaphore):
    if connection.vendor != "postgresql":
        pytest.skip("only PostgreSQL notifies: elsewhere probes find the room")
    semaphore = make_semaphore(1)
    holder = key()
    acquire(semaphore.name, external_id=holder)
    waiting._saw_wait(connection.alias, [semaphore.name])  # so this process notifies
    ready, waited = SPAWN.Event(), Outbox.create()
    child = spawn(wait_slowly, semaphore.name, ready, waited, bound=60)
    assert ready.wait(40), "the waiter never queued and listened"
    with CaptureQueriesContext(connection) as queries:
        release(holder)
    assert sum("pg_notify" in q["sql"] for q in queries.captured_queries) == 1
    join([child], within=45)
    [seconds] = waited.items()
    assert seconds is not None, "the waiter timed out"
    assert seconds < WOKEN_WITHIN


def test_a_release_sends_nothing_more_when_nobody_waited(make_semaphore):
    semaphore = make_semaphore(1)
    k = key()
    acquire(semaphore.name, external_id=k)
    with CaptureQueriesContext(connection) as queries:
        release(k)
    assert not any("pg_notify" in q["sql"] for q in queries.captured_queries)
