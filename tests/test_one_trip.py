"""The grant in one round trip (``engine/statements/one_trip.py``): taken
when the call needs nothing else, declined without writing anything
otherwise, and what it writes is what the general grant writes."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_semaphore import acquire, release, set_window
from django_semaphore.engine.statements import one_trip
from django_semaphore.exceptions import (
    CapacityExceeded,
    IdempotencyConflict,
    LockContention,
    SchemaOutOfDate,
    SemaphoreExhausted,
    SemaphoreNotFound,
)
from django_semaphore.models import Permit, PermitRequest, Semaphore
from tests.conftest import behind_the_engine, unique
from tests.test_backends import row_locked_elsewhere

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _one_trip_databases():
    if not one_trip.one_trip_statements(connections["default"]).applies():
        pytest.skip("SQLite (and MySQL) grant the general way: one transaction of statements")


def statements_of(call, *args, **kwargs):
    with CaptureQueriesContext(connection) as captured:
        result = call(*args, **kwargs)
    return result, [q["sql"] for q in captured.captured_queries]


def test_a_grant_with_room_is_one_statement(make_semaphore):
    sem = make_semaphore(capacity=2)
    acquire(sem.name, external_id=unique())  # the connection's statements built

    request, sent = statements_of(acquire, sem.name, external_id="k1", ttl=30)

    assert len(sent) == 1
    stored = PermitRequest.objects.get(external_id="k1")
    assert request.pk == stored.pk
    assert request.state == stored.state == "ACQUIRED"
    assert request.created_at == stored.created_at == stored.updated_at
    assert request.expires_at == stored.expires_at == stored.created_at + timedelta(seconds=30)
    permit = Permit.objects.get(request=stored)
    assert request.fencing_tokens == {sem.name: permit.fencing_token} == {sem.name: 2}
    sem.refresh_from_db()
    assert (sem.in_use, sem.fencing_counter) == (2, 2)


def test_what_it_writes_is_what_the_general_grant_writes(make_semaphore):
    """The counters fold the releases in as the general grant does: a
    capacity's worth of grants and releases leaves the row exact."""
    sem = make_semaphore(capacity=1)
    for i in range(5):
        acquire(sem.name, external_id=f"cycle-{i}")
        release(f"cycle-{i}")
    sem.refresh_from_db()
    assert (sem.in_use, sem.fencing_counter) == (0, 5)
    tokens = list(Permit.objects.order_by("id").values_list("fencing_token", flat=True))
    assert tokens == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("case", "refused"),
    [
        ("no room", SemaphoreExhausted),
        ("too many", CapacityExceeded),
        ("missing", SemaphoreNotFound),
    ],
)
def test_declines_without_writing_and_the_general_grant_refuses(make_semaphore, case, refused):
    sem = make_semaphore(capacity=1)
    names: object = {"no room": sem.name, "too many": {sem.name: 2}, "missing": unique()}[case]
    holder = acquire(sem.name, external_id=unique())
    if case != "no room":
        release(holder.external_id)

    with pytest.raises(refused):
        acquire(names, external_id="k")

    assert not PermitRequest.objects.filter(external_id="k").exists()
    sem.refresh_from_db()
    assert sem.in_use == (1 if case == "no room" else 0)


@pytest.mark.parametrize("case", ["two names", "rate limit", "queue live"])
def test_declines_without_writing_and_the_general_grant_grants(make_semaphore, case):
    sem = make_semaphore(capacity=1)
    names: object = sem.name
    if case == "two names":
        names = [sem.name, make_semaphore(capacity=1).name]
    elif case == "rate limit":
        set_window(sem.name, 60)
    else:
        with behind_the_engine():
            Semaphore.objects.filter(pk=sem.pk).update(
                queued_until=timezone.now() + timedelta(hours=1)
            )

    request, sent = statements_of(acquire, names, external_id="k")

    assert len(sent) > 1  # the general grant's statements
    assert request.fencing_tokens == dict.fromkeys(request.fencing_tokens, 1)
    assert PermitRequest.objects.filter(external_id="k").count() == 1


def test_a_taken_key_answers_as_a_repeated_call(make_semaphore):
    sem = make_semaphore(capacity=3)
    first = acquire(sem.name, external_id="same")

    again = acquire(sem.name, external_id="same")

    assert again.pk == first.pk
    assert again.fencing_tokens == first.fencing_tokens
    with pytest.raises(IdempotencyConflict):
        acquire({sem.name: 2}, external_id="same")
    sem.refresh_from_db()
    assert sem.in_use == 1


def test_its_lock_wait_is_bounded(make_semaphore, settings):
    settings.DJANGO_SEMAPHORE = {"LOCK_WAIT_TIMEOUT": 1, "RETRY_ATTEMPTS": 1}
    sem = make_semaphore(capacity=1)
    with row_locked_elsewhere(sem.name), pytest.raises(LockContention):
        acquire(sem.name, external_id="k")
    assert not PermitRequest.objects.filter(external_id="k").exists()
    with connection.cursor() as cursor:  # the session is left as it was
        if connection.vendor == "mysql":
            cursor.execute("SELECT @@in_transaction")
            assert cursor.fetchone() == (0,)


def test_postgresql_function_is_the_one_the_code_renders():
    """A change of the rendered body needs a migration that installs it again."""
    if connection.vendor != "postgresql":
        pytest.skip("only PostgreSQL installs a function")
    with connection.cursor() as cursor:
        cursor.execute("SELECT prosrc FROM pg_proc WHERE proname = %s", [one_trip.FUNCTION])
        (installed,) = cursor.fetchone()
    assert installed == one_trip.OneTripStatements(connections["default"]).function_body()


def test_postgresql_without_the_function_asks_for_migrate(make_semaphore):
    if connection.vendor != "postgresql":
        pytest.skip("only PostgreSQL installs a function")
    sem = make_semaphore(capacity=1)
    one_trip.uninstall(connections["default"])
    try:
        with pytest.raises(SchemaOutOfDate):
            acquire(sem.name, external_id="k")
    finally:
        one_trip.install(connections["default"])
    assert acquire(sem.name, external_id="k").state == "ACQUIRED"


def test_refusal_is_the_general_one(make_semaphore):
    sem = make_semaphore(capacity=1)
    acquire(sem.name, external_id="holder")
    with pytest.raises(SemaphoreExhausted):
        acquire(sem.name, external_id="late")
