from __future__ import annotations

from contextlib import nullcontext
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from django_semaphore import ReleaseOutcome, acquire, release, renew
from django_semaphore.engine.releasing import release_requests
from django_semaphore.engine.statements import release as release_statements
from django_semaphore.exceptions import PermitAlreadyReleased, PermitNotFound
from django_semaphore.models import Permit, PermitRequest, Semaphore
from django_semaphore.signals import hold_ended, permit_released
from django_semaphore.states import ReleaseReason, State
from tests.conftest import behind_the_engine, no_receivers, parking_in_this_process, unique

pytestmark = pytest.mark.django_db(transaction=True)


def test_release_is_one_way_and_idempotent(make_semaphore):
    sem = make_semaphore(capacity=1)
    key = unique()
    acquire(sem.name, external_id=key)

    assert release(key) is ReleaseOutcome.RELEASED
    assert release(key) is ReleaseOutcome.ALREADY_RELEASED
    request = PermitRequest.objects.get(external_id=key)
    assert request.state == State.RELEASED
    assert request.release_reason == ReleaseReason.RELEASED
    assert request.released_at is not None
    assert not request.permits.filter(state=State.ACQUIRED).exists()


def test_release_of_unknown_key():
    assert release(unique()) is ReleaseOutcome.NOT_FOUND


def test_release_frees_every_semaphore_of_the_request(make_semaphore):
    a, b = make_semaphore(capacity=1), make_semaphore(capacity=1)
    key = unique()
    acquire([a.name, b.name], external_id=key)
    release(key)

    assert Semaphore.objects.with_usage().filter(in_use__gt=0, pk__in=[a.pk, b.pk]).count() == 0


def test_release_works_inside_the_callers_transaction(make_semaphore):
    sem = make_semaphore()
    key = unique()
    acquire(sem.name, external_id=key)
    with transaction.atomic():
        assert release(key) is ReleaseOutcome.RELEASED


@pytest.mark.counter_drift_expected
def test_half_released_request_is_completed_by_a_repeat(make_semaphore):
    """Permits RELEASED under an ACQUIRED request: written from outside (a
    manual edit, a restore), never by a release, which is one transaction."""
    sem = make_semaphore()
    key = unique()
    request = acquire(sem.name, external_id=key)
    with behind_the_engine():
        Permit.objects.filter(request=request).update(state=State.RELEASED)

    assert release_requests("default", [request.pk], ReleaseReason.STALE).ended == 1
    request.refresh_from_db()
    assert request.state == State.RELEASED
    assert request.release_reason == ReleaseReason.STALE


def test_renew_pushes_expiry_by_the_requests_own_ttl(make_semaphore):
    sem = make_semaphore()
    key = unique()
    first = acquire(sem.name, external_id=key, ttl=60)
    PermitRequest.objects.filter(pk=first.pk).update(
        expires_at=first.expires_at - timedelta(seconds=50)
    )

    renewed = renew(key)

    assert renewed.ttl == 60
    assert renewed.expires_at > first.expires_at - timedelta(seconds=50)
    assert PermitRequest.objects.get(pk=first.pk).expires_at == renewed.expires_at


def test_renew_with_a_new_ttl(make_semaphore):
    sem = make_semaphore()
    key = unique()
    acquire(sem.name, external_id=key)

    renewed = renew(key, ttl=timedelta(minutes=10))

    stored = PermitRequest.objects.get(external_id=key)
    assert stored.ttl == renewed.ttl == 600
    assert stored.expires_at == renewed.expires_at


def test_renew_without_any_ttl_only_checks_the_permit_is_held(make_semaphore):
    sem = make_semaphore()
    key = unique()
    acquire(sem.name, external_id=key)
    assert renew(key).expires_at is None


def test_renew_after_release_tells_the_holder_to_stop(make_semaphore):
    sem = make_semaphore()
    key = unique()
    acquire(sem.name, external_id=key, ttl=60)
    release(key)
    with pytest.raises(PermitAlreadyReleased):
        renew(key)


def test_renew_after_expiry_never_revives_the_permit(make_semaphore):
    sem = make_semaphore()
    key = unique()
    request = acquire(sem.name, external_id=key, ttl=60)
    PermitRequest.objects.filter(pk=request.pk).update(
        expires_at=request.created_at - timedelta(seconds=1)
    )

    with pytest.raises(PermitAlreadyReleased):
        renew(key)

    request.refresh_from_db()
    assert request.state == State.RELEASED
    assert request.release_reason == ReleaseReason.EXPIRED


def test_renew_of_unknown_key():
    with pytest.raises(PermitNotFound):
        renew(unique())
    # A holder catching PermitAlreadyReleased stops in this case too.
    assert issubclass(PermitNotFound, PermitAlreadyReleased)


@pytest.mark.counter_drift_expected
def test_a_half_released_request_is_completed_by_release_too(make_semaphore):
    sem = make_semaphore()
    key = unique()
    request = acquire(sem.name, external_id=key)
    with behind_the_engine():
        Permit.objects.filter(request=request).update(state=State.RELEASED)

    assert release(key) is ReleaseOutcome.RELEASED
    assert PermitRequest.objects.get(pk=request.pk).state == State.RELEASED


@pytest.mark.parametrize("metrics", [True, False], ids=["metrics on", "metrics off"])
@pytest.mark.parametrize("parking", [True, False], ids=["parking on", "parking off"])
def test_release_is_one_statement_whoever_listens(make_semaphore, parking, metrics):
    """Request, permits and the release counter in one statement, its lock
    wait bounded by the statement itself, whoever listens: with receivers
    (the metrics app of the test settings, parking) one plain read follows
    the commit, the same for all of them (a procedure runs both: one
    trip). SQLite: one transaction of its own."""
    sem = make_semaphore()
    release(acquire(sem.name, external_id=unique()).external_id)  # the statements built
    key = unique()
    acquire(sem.name, external_id=key)

    with (
        nullcontext() if metrics else no_receivers(permit_released, hold_ended),
        parking_in_this_process(parking),
        CaptureQueriesContext(connection) as queries,
    ):
        assert release(key) is ReleaseOutcome.RELEASED

    statements = [q["sql"] for q in queries.captured_queries]
    if connection.vendor in ("mysql", "postgresql"):
        # The procedure reads what it ended once the release committed.
        assert len(statements) == 1
        assert statements[0].startswith(f"CALL {release_statements.ROUTINE}(")
    else:
        # Permits, release counter, request.
        assert sum(s.startswith("UPDATE") for s in statements) == 3
    assert not Permit.objects.filter(state=State.ACQUIRED).exists()
    assert Semaphore.objects.get(pk=sem.pk).in_use == 0
    assert PermitRequest.objects.get(external_id=key).state == State.RELEASED


def test_a_receiver_of_permit_released_gets_the_request_id(make_semaphore):
    sem = make_semaphore()
    key = unique()
    request = acquire(sem.name, external_id=key)
    received: list[dict[str, object]] = []

    def receiver(**kwargs: object) -> None:
        received.append(kwargs)

    permit_released.connect(receiver)
    try:
        assert release(key) is ReleaseOutcome.RELEASED
        assert release(key) is ReleaseOutcome.ALREADY_RELEASED
    finally:
        permit_released.disconnect(receiver)

    assert [(r["request_ids"], r["reason"]) for r in received] == [
        ([request.pk], ReleaseReason.RELEASED)
    ]
