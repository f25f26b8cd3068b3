"""The engine heals what it did not write (issue 18): every inconsistent state,
however it arose, is reported by ``check --database`` and repaired by the
orphan sweep, which counts, logs and signals each repair."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import DatabaseError, IntegrityError, connection

from django_semaphore import acquire, backends, release, sweep
from django_semaphore.checks import check_data_consistency
from django_semaphore.exceptions import InconsistentData, SchemaOutOfDate, SemaphoreError
from django_semaphore.models import Permit, PermitRequest, Semaphore
from django_semaphore.signals import data_repaired
from django_semaphore.states import State
from tests.conftest import behind_the_engine, unique

pytestmark = pytest.mark.django_db(transaction=True)


def grant(*semaphores: Semaphore) -> PermitRequest:
    return acquire([s.name for s in semaphores], external_id=unique("key"))


@pytest.fixture
def repairs() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        seen.append({k: kwargs[k] for k in ("kind", "ids", "count")})

    data_repaired.connect(receiver)
    yield seen
    data_repaired.disconnect(receiver)


def reported() -> set[str]:
    """The ids of what check --database reports."""
    return {message.id for message in check_data_consistency(databases=["default"])}


@contextmanager
def foreign_keys_off() -> Iterator[None]:
    """As raw SQL or a partial restore can write: no foreign key checked."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET session_replication_role = replica")
        try:
            yield
        finally:
            with connection.cursor() as cursor:
                cursor.execute("SET session_replication_role = DEFAULT")
        return
    # SQLite: PRAGMA foreign_keys = OFF; MariaDB: SET foreign_key_checks = 0.
    assert connection.disable_constraint_checking()
    try:
        yield
    finally:
        connection.enable_constraint_checking()


def test_a_released_request_with_held_permits_gets_them_released(make_semaphore, repairs, caplog):
    sem = make_semaphore(capacity=1)
    request = grant(sem)
    with behind_the_engine():  # e.g. an UPDATE of the request alone, from a SQL console
        PermitRequest.objects.filter(pk=request.pk).update(state=State.RELEASED)
    with pytest.raises(SemaphoreError):  # the room is still taken
        grant(sem)
    assert "django_semaphore.W007" in reported()
    assert request.permits.get().state == State.ACQUIRED  # the check changed nothing

    with caplog.at_level(logging.WARNING, logger="django_semaphore"):
        report = sweep.release_orphans()

    assert (report.stray_permits, report.repairs, report.total) == (1, 1, 0)
    assert "stray_permits 1" in str(report)
    assert request.permits.get().state == State.RELEASED
    assert repairs == [{"kind": "stray_permits", "ids": [request.permits.get().pk], "count": 1}]
    assert any(
        r.levelno == logging.WARNING and "held permits of released requests" in r.message
        for r in caplog.records
    )
    assert not reported()
    grant(sem)


def test_an_acquired_request_with_a_released_permit_is_completed(make_semaphore, repairs):
    one, two = make_semaphore(capacity=1), make_semaphore(capacity=1)
    request = grant(one, two)
    with behind_the_engine():
        Permit.objects.filter(request=request, semaphore=one).update(state=State.RELEASED)
    assert "django_semaphore.W010" in reported()

    report = sweep.release_orphans()

    assert (report.repaired, report.total) == (1, 1)
    request.refresh_from_db()
    assert (request.state, request.release_reason) == (State.RELEASED, "released")
    assert set(request.permits.values_list("state", flat=True)) == {State.RELEASED}
    assert repairs == [{"kind": "partly_released", "ids": [request.pk], "count": 1}]
    grant(one, two)  # all or nothing: both have room again


def test_held_permits_with_no_request_are_released(make_semaphore, repairs):
    sem = make_semaphore(capacity=1)
    request = grant(sem)
    with foreign_keys_off():
        # A request row deleted with raw SQL, its permit left behind.
        table = connection.ops.quote_name(PermitRequest._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(f"DELETE FROM {table} WHERE id = %s", [request.pk])
    permit = Permit.objects.get(semaphore=sem)
    assert "django_semaphore.W008" in reported()
    assert sweep.release_orphans(dry_run=True).orphan_permits == 1

    report = sweep.release_orphans()

    assert report.orphan_permits == 1
    assert Permit.objects.get(pk=permit.pk).state == State.RELEASED
    assert repairs == [{"kind": "orphan_permits", "ids": [permit.pk], "count": 1}]
    grant(sem)


def test_a_lowered_fencing_counter_is_raised_never_reissuing_a_token(make_semaphore, repairs):
    sem = make_semaphore(capacity=5)
    for _ in range(3):
        grant(sem)
    with behind_the_engine():  # a stale save() of old, a restore of an older backup
        Semaphore.objects.filter(pk=sem.pk).update(fencing_counter=1)

    # The grant says what is wrong and what to do, not the driver's words.
    with pytest.raises(InconsistentData, match="semaphore_sweep"):
        grant(sem)
    assert "django_semaphore.W009" in reported()
    assert sweep.release_orphans(dry_run=True).fencing_counters == 1
    assert Semaphore.objects.get(pk=sem.pk).fencing_counter == 1

    report = sweep.release_orphans()

    assert report.fencing_counters == 1
    assert Semaphore.objects.get(pk=sem.pk).fencing_counter == 3
    assert repairs == [{"kind": "fencing_counters", "ids": [sem.pk], "count": 1}]
    assert grant(sem).token(sem.name) == 4
    assert not reported()


def test_a_consistent_database_is_left_alone(make_semaphore, repairs):
    sem = make_semaphore(capacity=2)
    held = grant(sem)
    release(grant(sem).external_id)
    assert not reported()
    report = sweep.release_orphans()
    assert (report.repairs, report.total) == (0, 0)
    assert str(report) == "Orphans: released 0 (repaired 0, expired 0, owner_dead 0, stale 0)."
    assert repairs == []
    assert Permit.objects.get(request=held).state == State.ACQUIRED


def test_the_check_runs_only_when_asked():
    assert check_data_consistency() == []


# --- errors the grant path cannot retry --------------------------------------------------


def test_a_missing_table_says_to_migrate():
    with pytest.raises(DatabaseError) as raised, connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM django_semaphore_no_such_table")
    error = backends.translate(connection, raised.value)
    assert isinstance(error, SchemaOutOfDate)
    assert "manage.py migrate django_semaphore" in str(error)


def test_an_integrity_error_says_to_sweep():
    error = backends.translate(connection, IntegrityError("duplicate"))
    assert isinstance(error, InconsistentData)
    assert "semaphore_sweep" in str(error)
