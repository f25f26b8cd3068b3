"""The signals a metrics system other than Prometheus builds on, sent by real
grants, waits, releases, reclaims and retries on each database."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connection
from django.dispatch import Signal
from django.test.utils import CaptureQueriesContext

from django_semaphore import ReleaseOutcome, acquire, release, signals, sweep
from django_semaphore.engine.releasing import release_requests
from django_semaphore.exceptions import AcquireTimeout, SemaphoreExhausted, SemaphoreNotFound
from django_semaphore.metrics import events
from django_semaphore.models import PermitRequest
from django_semaphore.signals import Hold
from django_semaphore.states import ReleaseReason
from tests.conftest import unique
from tests.test_backends import row_locked_elsewhere
from tests.test_sweep import shift

pytestmark = pytest.mark.django_db(transaction=True)

Received = list[dict[str, Any]]


@pytest.fixture
def receive() -> Iterator[Callable[[Signal], Received]]:
    """``receive(signal)`` -> the kwargs of every send, from then on."""
    connected: list[tuple[Signal, Callable[..., None]]] = []

    def start(signal: Signal) -> Received:
        calls: Received = []

        def receiver(sender: Any, **kwargs: Any) -> None:
            calls.append({"sender": sender, **kwargs})

        signal.connect(receiver, weak=False)
        connected.append((signal, receiver))
        return calls

    yield start
    for signal, receiver in connected:
        signal.disconnect(receiver)


def test_a_grant_sends_acquired_then_finished(make_semaphore, receive):
    a, b = make_semaphore(capacity=2), make_semaphore(capacity=1)
    acquired, finished = receive(signals.permit_acquired), receive(signals.acquire_finished)

    request = acquire({a.name: 2, b.name: 1}, external_id=unique())

    assert [call["request"].pk for call in acquired] == [request.pk]
    assert len(finished) == 1
    call = finished[0]
    assert call["sender"] is PermitRequest
    assert call["names"] == sorted([a.name, b.name])
    assert (call["granted"], call["lacking"], call["using"]) == (True, [], "default")
    assert 0 <= call["waited"] < 5


def test_an_idempotent_repeat_finishes_granted_but_grants_nothing(make_semaphore, receive):
    sem = make_semaphore()
    key = unique()
    acquire(sem.name, external_id=key)
    acquired, finished = receive(signals.permit_acquired), receive(signals.acquire_finished)

    acquire(sem.name, external_id=key)

    assert acquired == []
    assert [call["granted"] for call in finished] == [True]


def test_a_refusal_names_what_lacked_room_and_how_long_it_waited(make_semaphore, receive):
    full, free = make_semaphore(capacity=1), make_semaphore(capacity=1)
    acquire(full.name, external_id=unique())
    acquired, finished = receive(signals.permit_acquired), receive(signals.acquire_finished)

    with pytest.raises(SemaphoreExhausted):
        acquire([full.name, free.name], external_id=unique())
    with pytest.raises(AcquireTimeout):
        acquire([full.name, free.name], external_id=unique(), timeout=0.4)

    assert acquired == []
    fail_fast, timed_out = finished
    for call in (fail_fast, timed_out):
        assert call["names"] == sorted([full.name, free.name])
        assert (call["granted"], call["lacking"]) == (False, [full.name])
    assert fail_fast["waited"] < 0.4 <= timed_out["waited"] < 5


def test_invalid_calls_finish_without_a_signal(receive):
    finished = receive(signals.acquire_finished)

    with pytest.raises(SemaphoreNotFound):
        acquire(unique("missing"), external_id=unique())

    assert finished == []


def test_a_release_reports_how_long_each_permit_was_held(make_semaphore, receive):
    a, b = make_semaphore(capacity=1), make_semaphore(capacity=3)
    key = unique()
    request = acquire({a.name: 1, b.name: 2}, external_id=key)
    released, ended = receive(signals.permit_released), receive(signals.hold_ended)
    time.sleep(0.3)

    release(key)

    assert [(c["request_ids"], c["reason"]) for c in released] == [([request.pk], "released")]
    assert len(ended) == 1
    assert (ended[0]["reason"], ended[0]["using"]) == ("released", "default")
    holds = sorted(ended[0]["holds"], key=lambda hold: hold.semaphore)
    assert all(isinstance(hold, Hold) for hold in holds)
    assert [(h.request_id, h.semaphore, h.count) for h in holds] == sorted(
        [(request.pk, a.name, 1), (request.pk, b.name, 2)], key=lambda row: row[1]
    )
    # Both ends read from the database's clock, which moved on by the sleep.
    assert all(0.25 <= hold.seconds < 5 for hold in holds)


def test_reclaims_report_their_reason(make_semaphore, receive):
    sem = make_semaphore(capacity=1)
    expired = acquire(sem.name, external_id=unique(), ttl=60)
    shift(expired, expires_at=-timedelta(seconds=1))
    ended = receive(signals.hold_ended)

    # The grant reclaims the expired permit of the row it holds locked.
    acquire(sem.name, external_id=unique(), ttl=60)

    assert [(c["reason"], [h.request_id for h in c["holds"]]) for c in ended] == [
        (ReleaseReason.EXPIRED, [expired.pk])
    ]


def test_a_sweep_batch_reports_the_reclaims_it_made(make_semaphore, receive):
    sem = make_semaphore(capacity=2)
    stale = acquire(sem.name, external_id=unique(), ttl=60)
    shift(stale, expires_at=-timedelta(seconds=1))
    ended = receive(signals.hold_ended)

    sweep.release_orphans()

    assert [(c["reason"], [h.semaphore for h in c["holds"]]) for c in ended] == [
        (ReleaseReason.EXPIRED, [sem.name])
    ]


def test_a_batch_does_not_report_a_request_its_holder_released_first(make_semaphore, receive):
    """A sweep picks its batch, then the holder releases one of it: the
    batch's signal names that request too, its hold times do not."""
    sem = make_semaphore(capacity=2)
    released_first, reclaimed = unique(), unique()
    batch = [acquire(sem.name, external_id=key).pk for key in (released_first, reclaimed)]
    release(released_first)
    released, ended = receive(signals.permit_released), receive(signals.hold_ended)

    release_requests("default", batch, ReleaseReason.STALE)

    assert [c["request_ids"] for c in released] == [batch]
    assert [[h.request_id for h in c["holds"]] for c in ended] == [[batch[1]]]


def test_hold_times_cost_no_query_of_their_own_on_the_release_by_key(make_semaphore, receive):
    """MariaDB, PostgreSQL: the one read after the release by key serves
    every receiver. SQLite's general path reads the hold times only while
    someone listens."""
    sem = make_semaphore(capacity=2)
    keys = [unique(), unique()]
    for key in keys:
        acquire(sem.name, external_id=key)
    receive(signals.permit_released)

    def queries_of_release(key: str) -> int:
        with CaptureQueriesContext(connection) as captured:
            release(key)
        return len(captured)

    signals.hold_ended.disconnect(
        sender=PermitRequest, dispatch_uid="django_semaphore.metrics.on_hold_ended"
    )
    try:
        assert not signals.hold_ended.has_listeners(PermitRequest)
        unheard = queries_of_release(keys[0])
    finally:
        events.connect_receivers()
    assert signals.hold_ended.has_listeners(PermitRequest)
    heard = queries_of_release(keys[1])

    assert heard == unheard + (0 if connection.vendor in ("mysql", "postgresql") else 1)


def test_a_retried_lock_wait_is_signalled_with_its_kind(make_semaphore, settings, receive):
    settings.DJANGO_SEMAPHORE = {"LOCK_WAIT_TIMEOUT": 1, "RETRY_ATTEMPTS": 3}
    sem = make_semaphore()
    retries = receive(signals.database_retry)

    # A real lock held by another connection for longer than one bounded wait.
    with row_locked_elsewhere(sem.name, hold=1.5):
        request = acquire(sem.name, external_id=unique())

    assert request.is_held
    assert retries, "the first attempt should have timed out waiting for the row lock"
    first = retries[0]
    assert (first["sender"], first["kind"], first["attempt"], first["using"]) == (
        PermitRequest,
        "contention",
        1,
        "default",
    )
    assert isinstance(first["error"], DatabaseError)


def test_a_failing_receiver_never_fails_the_caller(make_semaphore, caplog):
    sem = make_semaphore()

    def broken(**kwargs: Any) -> None:
        raise RuntimeError("a broken metrics backend")

    signals.acquire_finished.connect(broken, weak=False)
    try:
        with caplog.at_level(logging.ERROR, logger="django.dispatch"):
            request = acquire(sem.name, external_id=unique())
    finally:
        signals.acquire_finished.disconnect(broken)

    assert request.is_held
    assert "broken" in caplog.text


def test_a_failing_receiver_never_turns_a_committed_grant_or_release_into_an_error(
    make_semaphore, caplog
):
    sem = make_semaphore(capacity=1)
    key = unique()

    def broken(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("receiver bug")

    signals.permit_acquired.connect(broken)
    signals.permit_released.connect(broken)
    try:
        with caplog.at_level(logging.ERROR, logger="django.dispatch"):
            request = acquire(sem.name, external_id=key)
            assert release(key) is ReleaseOutcome.RELEASED
    finally:
        signals.permit_acquired.disconnect(broken)
        signals.permit_released.disconnect(broken)

    assert request.pk is not None
    assert sum("receiver bug" in str(r.exc_info) for r in caplog.records) == 2
