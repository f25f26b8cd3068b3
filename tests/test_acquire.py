from __future__ import annotations

from datetime import timedelta
from weakref import WeakKeyDictionary

import pytest
from django.db import connection, connections, transaction

from django_semaphore import ReleaseOutcome, acquire, release
from django_semaphore.engine import statements
from django_semaphore.exceptions import (
    AcquireTimeout,
    CapacityExceeded,
    IdempotencyConflict,
    LockContention,
    NestedTransactionError,
    PermitAlreadyReleased,
    SemaphoreExhausted,
    SemaphoreNotFound,
)
from django_semaphore.models import Permit, PermitRequest, Semaphore
from django_semaphore.states import ReleaseReason, State
from tests.conftest import unique

pytestmark = pytest.mark.django_db(transaction=True)


def in_use(semaphore: Semaphore) -> int:
    return Semaphore.objects.with_usage().get(pk=semaphore.pk).in_use


def test_acquire_grants_one_permit_and_commits(make_semaphore):
    sem = make_semaphore(capacity=2)
    request = acquire(sem.name, external_id=unique("key"), owner="worker-1")

    assert request.state == State.ACQUIRED
    assert request.owner == "worker-1"
    assert request.expires_at is None
    stored = PermitRequest.objects.get(pk=request.pk)
    assert stored.state == State.ACQUIRED
    assert list(stored.permits.values_list("semaphore__name", "count")) == [(sem.name, 1)]
    assert in_use(sem) == 1


def test_acquire_stops_at_capacity(make_semaphore):
    sem = make_semaphore(capacity=2)
    acquire(sem.name, external_id=unique())
    acquire(sem.name, external_id=unique())

    with pytest.raises(SemaphoreExhausted) as excinfo:
        acquire(sem.name, external_id=unique())

    assert excinfo.value.names == [sem.name]
    assert not isinstance(excinfo.value, AcquireTimeout)
    assert in_use(sem) == 2


def test_release_makes_room_again(make_semaphore):
    sem = make_semaphore(capacity=1)
    key = unique()
    acquire(sem.name, external_id=key)

    assert release(key) is ReleaseOutcome.RELEASED
    acquire(sem.name, external_id=unique())
    assert in_use(sem) == 1


def test_counts_per_semaphore(make_semaphore):
    a, b = make_semaphore(capacity=3), make_semaphore(capacity=2)
    request = acquire({a.name: 3, b.name: 2}, external_id=unique())

    assert dict(request.permits.values_list("semaphore__name", "count")) == {a.name: 3, b.name: 2}
    with pytest.raises(SemaphoreExhausted) as excinfo:
        acquire([a.name, b.name], external_id=unique())
    assert excinfo.value.names == sorted([a.name, b.name])


def test_multi_semaphore_is_all_or_nothing(make_semaphore):
    free, full = make_semaphore(capacity=5), make_semaphore(capacity=1)
    acquire(full.name, external_id=unique())
    key = unique()

    with pytest.raises(SemaphoreExhausted) as excinfo:
        acquire([free.name, full.name], external_id=key)

    assert excinfo.value.names == [full.name]
    assert in_use(free) == 0
    assert not PermitRequest.objects.filter(external_id=key).exists()


def test_unknown_name_writes_nothing(make_semaphore):
    sem = make_semaphore(capacity=5)
    key = unique()
    with pytest.raises(SemaphoreNotFound) as excinfo:
        acquire([sem.name, "no-such-semaphore"], external_id=key)

    assert excinfo.value.names == ["no-such-semaphore"]
    assert not PermitRequest.objects.filter(external_id=key).exists()
    assert in_use(sem) == 0


def test_count_above_the_declared_capacity_is_refused_at_once():
    with pytest.raises(CapacityExceeded):
        acquire({"declared-in-settings": 5}, external_id=unique(), timeout=5)


def test_zero_capacity_grants_nothing_for_now(make_semaphore):
    sem = make_semaphore(capacity=0)
    with pytest.raises(SemaphoreExhausted):
        acquire(sem.name, external_id=unique())
    assert in_use(sem) == 0


# --- idempotency ---------------------------------------------------------------


def test_same_key_returns_the_same_request_and_grants_nothing_new(make_semaphore):
    sem = make_semaphore(capacity=1)
    key = unique()
    first = acquire(sem.name, external_id=key, ttl=60)
    again = acquire(sem.name, external_id=key, ttl=60)

    assert again.pk == first.pk
    assert again.token(sem.name) == first.token(sem.name)
    assert Permit.objects.filter(request__external_id=key).count() == 1
    assert in_use(sem) == 1


def test_same_key_list_and_mapping_forms_are_the_same_demand(make_semaphore):
    a, b = make_semaphore(capacity=1), make_semaphore(capacity=1)
    key = unique()
    first = acquire([b.name, a.name], external_id=key)
    assert acquire({a.name: 1, b.name: 1}, external_id=key).pk == first.pk


@pytest.mark.parametrize("other", ["names", "counts"])
def test_same_key_with_another_demand_conflicts(make_semaphore, other):
    a, b = make_semaphore(capacity=3), make_semaphore(capacity=3)
    key = unique()
    acquire(a.name, external_id=key)
    demand = b.name if other == "names" else {a.name: 2}

    with pytest.raises(IdempotencyConflict):
        acquire(demand, external_id=key)
    assert in_use(b) == 0
    assert in_use(a) == 1


def test_released_key_cannot_be_reused(make_semaphore):
    sem = make_semaphore(capacity=1)
    key = unique()
    acquire(sem.name, external_id=key)
    release(key)

    with pytest.raises(PermitAlreadyReleased):
        acquire(sem.name, external_id=key)
    assert in_use(sem) == 0


# --- TTL -------------------------------------------------------------------------


def test_ttl_sets_expiry_from_the_database_clock(make_semaphore):
    sem = make_semaphore()
    request = acquire(sem.name, external_id=unique(), ttl=timedelta(minutes=2))

    assert request.ttl == 120
    assert request.expires_at - request.created_at == timedelta(seconds=120)
    stored = PermitRequest.objects.get(pk=request.pk)
    assert stored.expires_at == request.expires_at


def expire_now(request: PermitRequest) -> None:
    """Backdate a request's expiry: the test need not sleep through a TTL."""
    PermitRequest.objects.filter(pk=request.pk).update(
        expires_at=request.created_at - timedelta(seconds=1)
    )


def test_expired_permit_is_reclaimed_inline_by_the_next_acquire(make_semaphore):
    sem = make_semaphore(capacity=1)
    stale = acquire(sem.name, external_id=unique(), ttl=30)
    expire_now(stale)

    fresh = acquire(sem.name, external_id=unique())

    stale.refresh_from_db()
    assert stale.state == State.RELEASED
    assert stale.release_reason == ReleaseReason.EXPIRED
    assert stale.released_at is not None
    assert not stale.permits.filter(state=State.ACQUIRED).exists()
    assert fresh.token(sem.name) > stale.token(sem.name)
    assert in_use(sem) == 1


def test_reclaim_is_kept_even_when_the_acquire_still_fails(make_semaphore):
    sem = make_semaphore(capacity=2)
    stale = acquire(sem.name, external_id=unique(), ttl=30)
    acquire({sem.name: 1}, external_id=unique())
    expire_now(stale)

    with pytest.raises(SemaphoreExhausted):
        acquire({sem.name: 2}, external_id=unique())

    stale.refresh_from_db()
    assert stale.release_reason == ReleaseReason.EXPIRED
    assert in_use(sem) == 1


def test_real_ttl_expiry(make_semaphore):
    sem = make_semaphore(capacity=1)
    acquire(sem.name, external_id=unique(), ttl=1)
    with pytest.raises(SemaphoreExhausted):
        acquire(sem.name, external_id=unique())

    acquire(sem.name, external_id=unique(), timeout=5)


def test_unexpired_ttl_blocks(make_semaphore):
    sem = make_semaphore(capacity=1)
    acquire(sem.name, external_id=unique(), ttl=3600)
    with pytest.raises(SemaphoreExhausted):
        acquire(sem.name, external_id=unique())


def test_same_key_after_expiry_reports_the_loss(make_semaphore):
    sem = make_semaphore(capacity=1)
    key = unique()
    expire_now(acquire(sem.name, external_id=key, ttl=30))

    with pytest.raises(PermitAlreadyReleased):
        acquire(sem.name, external_id=key)
    assert PermitRequest.objects.get(external_id=key).release_reason == ReleaseReason.EXPIRED


# --- waiting ---------------------------------------------------------------------


def test_timeout_gives_up_with_acquire_timeout_and_never_waits_longer(make_semaphore):
    import time

    sem = make_semaphore(capacity=1)
    acquire(sem.name, external_id=unique())
    started = time.monotonic()

    with pytest.raises(AcquireTimeout) as excinfo:
        acquire(sem.name, external_id=unique(), timeout=0.6)

    waited = time.monotonic() - started
    assert 0.6 <= waited < 0.6 + 1.0  # one grant attempt of slack, not another backoff
    assert isinstance(excinfo.value, SemaphoreExhausted)
    assert isinstance(excinfo.value, TimeoutError)


def release_and_close(key: str) -> None:
    """release() from a thread of the test's: its connection ends with it."""
    try:
        release(key)
    finally:
        connections.close_all()


def test_timeout_waits_for_a_release(make_semaphore):
    import threading

    sem = make_semaphore(capacity=1)
    key = unique()
    acquire(sem.name, external_id=key)
    timer = threading.Timer(0.5, release_and_close, args=[key])
    timer.start()
    try:
        request = acquire(sem.name, external_id=unique(), timeout=10)
    finally:
        timer.join()
    assert request.state == State.ACQUIRED


# --- fencing tokens --------------------------------------------------------------


def test_fencing_tokens_increase_per_semaphore(make_semaphore):
    a, b = make_semaphore(capacity=10), make_semaphore(capacity=10)
    first = acquire([a.name, b.name], external_id=unique())
    second = acquire(a.name, external_id=unique())
    third = acquire([a.name, b.name], external_id=unique())

    assert [r.token(a.name) for r in (first, second, third)] == [1, 2, 3]
    assert [r.token(b.name) for r in (first, third)] == [1, 2]
    # The token read back from the database is the one handed out.
    assert PermitRequest.objects.get(pk=third.pk).token(a.name) == 3
    with pytest.raises(KeyError):
        second.token(b.name)


# --- transactions ----------------------------------------------------------------


def test_refuses_to_join_an_outer_transaction(make_semaphore):
    sem = make_semaphore()
    key = unique()
    with pytest.raises(NestedTransactionError), transaction.atomic():
        acquire(sem.name, external_id=key)
    assert not PermitRequest.objects.filter(external_id=key).exists()


@pytest.mark.django_db(transaction=True, databases=["default", "semaphores"])
def test_own_alias_may_run_inside_an_outer_transaction(make_semaphore, settings):
    sem = make_semaphore()
    settings.DJANGO_SEMAPHORE = {"DATABASE": "semaphores", "LOCK_WAIT_TIMEOUT": 0.3}
    key = unique()
    if connection.vendor == "sqlite":
        # One writer per SQLite file: the outer block holds the write lock, so
        # another alias of the same file waits its bounded time and gives up.
        with pytest.raises(LockContention), transaction.atomic():
            acquire(sem.name, external_id=key)
        return
    with transaction.atomic():
        request = acquire(sem.name, external_id=key)
        # Committed on its own connection, visible before the outer block ends.
        assert PermitRequest.objects.using("semaphores").get(external_id=key).pk == request.pk
    assert in_use(sem) == 1


def test_a_grant_without_insert_returning_reads_its_stamps_back(make_semaphore, monkeypatch):
    """MySQL (unlike MariaDB >= 10.5) has no INSERT ... RETURNING."""
    if connection.vendor == "postgresql":
        pytest.skip("PostgreSQL always has INSERT ... RETURNING (and no lastrowid)")
    monkeypatch.setattr(connection.features, "can_return_columns_from_insert", False)
    monkeypatch.setattr(statements, "_by_connection", WeakKeyDictionary())
    sem = make_semaphore(capacity=1)

    request = acquire(sem.name, external_id=unique(), ttl=60)
    with pytest.raises(SemaphoreExhausted):
        acquire(sem.name, external_id=unique())

    stored = PermitRequest.objects.get(pk=request.pk)
    assert (stored.created_at, stored.expires_at) == (request.created_at, request.expires_at)
    assert request.expires_at - request.created_at == timedelta(seconds=60)


def test_a_grant_marks_the_semaphore_used_at_most_once_a_minute(make_semaphore):
    # updated_at is indexed (the idle clean-up's index): written by every
    # grant, the hottest row's every update would rewrite an index entry.
    sem = make_semaphore(capacity=5)
    acquire(sem.name, external_id=unique())
    marked = Semaphore.objects.get(pk=sem.pk).updated_at
    acquire(sem.name, external_id=unique())
    assert Semaphore.objects.get(pk=sem.pk).updated_at == marked

    Semaphore.objects.filter(pk=sem.pk).update(updated_at=marked - timedelta(minutes=2))
    acquire(sem.name, external_id=unique())
    assert Semaphore.objects.get(pk=sem.pk).updated_at >= marked
