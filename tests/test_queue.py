"""PostgreSQL's grant queue (``engine/statements/queue.py``): every grant,
in one trip or the general way, waits its turn for its names before it
locks their rows, within the call's lock-wait bound."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db import connection, connections, transaction

from django_semaphore import acquire, release
from django_semaphore.engine.statements import queue
from django_semaphore.engine.statements.one_trip import OneTripStatements
from django_semaphore.exceptions import LockContention
from django_semaphore.models import PermitRequest
from django_semaphore.states import ReleaseOutcome

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _postgres():
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: MariaDB queues row-lock waiters in order")


@contextmanager
def queue_held_elsewhere(name: str) -> Iterator[threading.Event]:
    """Hold the name's place in the queue from another connection until the
    yielded event is set (at most 30 s)."""
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [queue.LOCK_CLASS, name]
                )
                held.set()
                done.wait(30)
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(10)
    try:
        yield done
    finally:
        done.set()
        thread.join(10)


@pytest.mark.parametrize("one_trip", [True, False], ids=["one trip", "general"])
def test_a_grant_waits_its_turn_within_its_lock_wait(
    make_semaphore, settings, monkeypatch, one_trip
):
    settings.DJANGO_SEMAPHORE = {"LOCK_WAIT_TIMEOUT": 1, "RETRY_ATTEMPTS": 1}
    if not one_trip:
        monkeypatch.setattr(OneTripStatements, "applies", lambda self: False)
    sem = make_semaphore(capacity=2)

    with queue_held_elsewhere(sem.name):
        began = time.monotonic()
        with pytest.raises(LockContention):
            acquire(sem.name, external_id="late")
        assert time.monotonic() - began >= 0.9

    assert not PermitRequest.objects.filter(external_id="late").exists()
    assert acquire(sem.name, external_id="late").state == "ACQUIRED"


def test_the_turn_comes_when_the_one_ahead_commits(make_semaphore):
    one, other = make_semaphore(capacity=2), make_semaphore(capacity=2)

    with queue_held_elsewhere(other.name) as done:
        threading.Timer(0.5, done.set).start()
        began = time.monotonic()
        request = acquire({one.name: 1, other.name: 1}, external_id="both")

    assert time.monotonic() - began >= 0.4
    assert request.fencing_tokens == {one.name: 1, other.name: 1}
    assert release("both") is ReleaseOutcome.RELEASED
