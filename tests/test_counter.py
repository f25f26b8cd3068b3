"""The exact in-use counter: every path that changes a permit changes it in
the same transaction, and the verifier corrects and reports any difference.

(Every test that touches the database also ends with the counter check of
``conftest._exact_in_use_counter``.)
"""

from __future__ import annotations

import importlib
import logging
from datetime import timedelta
from io import StringIO
from types import SimpleNamespace

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.loader import MigrationLoader

from django_semaphore import acquire, force_release, release, signals, sweep
from django_semaphore.engine import verifier
from django_semaphore.engine.releasing import release_requests
from django_semaphore.exceptions import SemaphoreExhausted
from django_semaphore.models import PermitRequest, ReleaseCounter, Semaphore
from django_semaphore.signals import counter_drift as counter_drift_signal
from django_semaphore.signals import hold_ended, permit_released
from tests.conftest import behind_the_engine, counter_drift, no_receivers, unique


def in_use(semaphore: Semaphore) -> int:
    return Semaphore.objects.values_list("in_use", flat=True).get(pk=semaphore.pk)


def set_in_use(semaphore: Semaphore, value: int) -> None:
    """Make the semaphore's counters say ``value`` are held, behind the
    engine's back (every release counted so far folded in)."""
    released = ReleaseCounter.objects.get(pk=semaphore.pk).released
    with behind_the_engine():
        Semaphore.objects.filter(pk=semaphore.pk).update(
            in_use_counter=value, released_folded=released
        )


def expire(request: PermitRequest) -> None:
    PermitRequest.objects.filter(pk=request.pk).update(
        expires_at=request.created_at - timedelta(seconds=1)
    )


def test_grants_raise_the_counter_by_their_counts(make_semaphore):
    a, b = make_semaphore(5), make_semaphore(5)

    acquire({a.name: 2, b.name: 3}, external_id=unique())
    acquire(a.name, external_id=unique())

    assert (in_use(a), in_use(b)) == (3, 3)


def test_a_refused_or_repeated_acquire_changes_nothing(make_semaphore):
    a = make_semaphore(2)
    key = unique()
    acquire({a.name: 2}, external_id=key)

    acquire({a.name: 2}, external_id=key)
    with pytest.raises(SemaphoreExhausted):
        acquire(a.name, external_id=unique())

    assert in_use(a) == 2


def _release(request: PermitRequest) -> None:
    # With nobody listening: one statement on MariaDB and PostgreSQL, and no
    # read after it (the metrics app of the test settings listens).
    with no_receivers(permit_released, hold_ended):
        assert release(request.external_id).value == "released"


def _release_with_a_listener(request: PermitRequest) -> None:
    # A receiver of the released ids: the same statement, and a read after it.
    def receiver(**kwargs: object) -> None:
        pass

    permit_released.connect(receiver)
    try:
        assert release(request.external_id).value == "released"
    finally:
        permit_released.disconnect(receiver)


def _release_by_id(request: PermitRequest) -> None:
    assert release_requests("default", [request.pk], "admin").ended == 1


def _reclaimed_by_the_next_grant(request: PermitRequest) -> None:
    expire(request)
    fuller = Semaphore.objects.get(permits__request=request, permits__count=2)
    # 3 of 4 held: 2 more fit only once the expired request is reclaimed.
    newcomer = acquire({fuller.name: 2}, external_id=unique())
    release(newcomer.external_id)


def _swept_as_expired(request: PermitRequest) -> None:
    expire(request)
    assert sweep.release_orphans().expired == 1


def _swept_as_stale(request: PermitRequest) -> None:
    PermitRequest.objects.filter(pk=request.pk).update(
        created_at=request.created_at - timedelta(days=30)
    )
    assert sweep.release_orphans().stale == 1


def _force_released(request: PermitRequest) -> None:
    assert force_release([request.external_id])[request.external_id].value == "released"


def _released_by_the_command(request: PermitRequest) -> None:
    call_command("semaphore_release", request.external_id, stdout=StringIO())


@pytest.mark.parametrize(
    "end",
    [
        _release,
        _release_with_a_listener,
        _release_by_id,
        _reclaimed_by_the_next_grant,
        _swept_as_expired,
        _swept_as_stale,
        _force_released,
        _released_by_the_command,
    ],
)
def test_every_way_a_permit_ends_lowers_the_counter(make_semaphore, end):
    a, b = make_semaphore(4), make_semaphore(4)
    kept = acquire(a.name, external_id=unique())
    request = acquire({a.name: 2, b.name: 1}, external_id=unique(), ttl=60)

    end(request)

    assert PermitRequest.objects.get(pk=request.pk).state == "RELEASED"
    assert (in_use(a), in_use(b)) == (1, 0)
    assert PermitRequest.objects.get(pk=kept.pk).is_held
    assert counter_drift() == {}


@pytest.mark.counter_drift_expected
def test_the_verifier_corrects_and_reports_drift(make_semaphore, caplog):
    a, b = make_semaphore(3), make_semaphore(3)
    acquire({a.name: 2}, external_id=unique())
    set_in_use(a, 0)
    set_in_use(b, 3)
    received = []

    def receiver(**kwargs: object) -> None:
        received.append(kwargs)

    counter_drift_signal.connect(receiver)
    try:
        with caplog.at_level(logging.ERROR, logger="django_semaphore"):
            drifts = verifier.verify()
    finally:
        counter_drift_signal.disconnect(receiver)

    assert sorted(drifts, key=lambda d: d.recorded) == [
        signals.Drift(a.name, 0, 2),
        signals.Drift(b.name, 3, 0),
    ]
    assert (in_use(a), in_use(b)) == (2, 0)
    assert sum("In-use counter drift" in r.message for r in caplog.records) == 2
    assert {r["drift"].semaphore for r in received} == {a.name, b.name}
    assert all(r["corrected"] for r in received)
    assert verifier.verify() == []


@pytest.mark.counter_drift_expected
def test_the_orphan_sweep_verifies_and_a_dry_run_only_reports(make_semaphore):
    a = make_semaphore(3)
    acquire(a.name, external_id=unique())
    set_in_use(a, 2)

    assert sweep.release_orphans(dry_run=True).counter_drift == 1
    assert in_use(a) == 2
    report = sweep.release_orphans()

    assert report.counter_drift == 1
    assert "1 in-use counters drifted" in str(report)
    assert in_use(a) == 1


@pytest.mark.counter_drift_expected
def test_status_verify_reports_and_corrects(make_semaphore):
    a = make_semaphore(3)
    set_in_use(a, 1)
    out, err = StringIO(), StringIO()

    call_command("semaphore_status", "--verify", stdout=out, stderr=err)

    assert (
        f"Corrected in-use counter drift: {a.name}: in_use was 1, permits held 0" in err.getvalue()
    )
    assert in_use(a) == 0
    out = StringIO()
    call_command("semaphore_status", "--verify", stdout=out, stderr=StringIO())
    assert "Every in-use counter is exact." in out.getvalue()


def test_a_drifted_counter_never_makes_a_release_fail(make_semaphore):
    """A counter below what a release frees stops at zero (and the verifier
    reports the rest) rather than failing the holder's release."""
    a = make_semaphore(3)
    request = acquire({a.name: 2}, external_id=unique())
    set_in_use(a, 1)

    release(request.external_id)

    assert in_use(a) == 0


def test_the_migration_gives_every_semaphore_a_release_counter(make_semaphore):
    a, b = make_semaphore(5), make_semaphore(5)
    acquire({a.name: 2, b.name: 1}, external_id=unique())
    ReleaseCounter.objects.all().delete()
    migration = importlib.import_module("django_semaphore.migrations.0008_release_counter")

    # What RunPython hands it: the models as of the migration, and a schema
    # editor on the alias.
    state = MigrationLoader(connection).project_state(("django_semaphore", "0008_release_counter"))
    migration.create_counters(state.apps, SimpleNamespace(connection=connection))

    assert set(ReleaseCounter.objects.values_list("pk", "released")) >= {(a.pk, 0), (b.pk, 0)}
    assert (in_use(a), in_use(b)) == (2, 1)
    release(acquire(a.name, external_id=unique()).external_id)
    assert (in_use(a), in_use(b)) == (2, 1)
