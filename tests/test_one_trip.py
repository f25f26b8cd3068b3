"""The grant in one round trip (``engine/statements/one_trip.py``): taken
when the call needs nothing else, declined without writing anything
otherwise, and what it writes is what the general grant writes."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_semaphore import acquire, release, set_window
from django_semaphore.engine import fairness, grant
from django_semaphore.engine.statements import grant_routine, one_trip, routines
from django_semaphore.exceptions import (
    IdempotencyConflict,
    LockContention,
    SemaphoreExhausted,
    SemaphoreNotFound,
)
from django_semaphore.migrations import _routines
from django_semaphore.models import Permit, PermitRequest, Semaphore, Ticket
from django_semaphore.validation import validate_demand
from tests.children import join, start_threads
from tests.conftest import behind_the_engine, unique
from tests.test_backends import row_locked_elsewhere
from tests.test_routines import NEWEST, server

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


def test_several_names_are_one_statement_with_permits_in_id_order(make_semaphore):
    """Names whose order by the database's collation is not Python's: the
    lock takes the manager's order, the permits go in semaphore id order."""
    prefix = unique("multi")
    made = [make_semaphore(capacity=3, name=f"{prefix}-{n}") for n in ("b", "A", "c")]
    demand = {made[0].name: 2, made[1].name: 1, made[2].name: 3}
    release(acquire(demand, external_id=unique()).external_id)  # statements built

    request, sent = statements_of(acquire, demand, external_id="k", ttl=10)

    assert len(sent) == 1
    assert request.fencing_tokens == dict.fromkeys(demand, 2)
    permits = Permit.objects.filter(request=request).order_by("id")
    assert [p.semaphore_id for p in permits] == sorted(s.pk for s in made)
    assert {p.semaphore.name: p.count for p in permits} == demand
    in_use = dict(
        Semaphore.objects.with_usage().filter(name__startswith=prefix).values_list("name", "in_use")
    )
    assert in_use == demand


def test_several_names_one_without_room_writes_nothing(make_semaphore, settings):
    settings.DJANGO_SEMAPHORE = {"LOCK_WAIT_TIMEOUT": 1, "RETRY_ATTEMPTS": 1}
    full, free = make_semaphore(capacity=1), make_semaphore(capacity=1)
    acquire(full.name, external_id=unique())

    with pytest.raises(SemaphoreExhausted):
        acquire([full.name, free.name], external_id="k")

    assert not PermitRequest.objects.filter(external_id="k").exists()
    free.refresh_from_db()
    assert (free.in_use, free.fencing_counter) == (0, 0)
    before = session_lock_wait()
    with row_locked_elsewhere(free.name), pytest.raises(LockContention):
        acquire([free.name, make_semaphore(capacity=1).name], external_id="k2")
    assert session_lock_wait() == before


def session_lock_wait() -> tuple[object, ...]:
    """MariaDB: whether a transaction is open, and the session's lock-wait bound."""
    if connection.vendor != "mysql":
        return ()
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@in_transaction, @@innodb_lock_wait_timeout")
        return tuple(cursor.fetchone())


@pytest.mark.parametrize(
    ("case", "refused"),
    [
        ("too many", SemaphoreExhausted),
        ("missing", SemaphoreNotFound),
    ],
)
def test_declines_without_writing_and_the_general_grant_refuses(make_semaphore, case, refused):
    sem = make_semaphore(capacity=1)
    names: object = {"too many": {sem.name: 2}, "missing": unique()}[case]

    with pytest.raises(refused):
        acquire(names, external_id="k")

    assert not PermitRequest.objects.filter(external_id="k").exists()
    sem.refresh_from_db()
    assert sem.in_use == 0


@pytest.mark.parametrize("timeout", [None, 60], ids=["fails fast", "waits"])
def test_a_refusal_without_more_to_do_is_one_statement(make_semaphore, timeout):
    """No room, nothing expired to reclaim, the key free: the routine's
    refusal is final for a caller that fails fast or waits in line (its
    ticket taken)."""
    sem = make_semaphore(capacity=1)
    acquire(sem.name, external_id="holder")
    ask = ask_for(sem.name, "late", timeout=timeout)

    refused, sent = statements_of(attempt, ask)

    assert isinstance(refused, fairness.Refusal)
    assert refused.error.names == [sem.name]
    assert refused.standing.ticketed == (timeout is not None)
    assert len(sent) == 1
    assert not PermitRequest.objects.filter(external_id="late").exists()


@pytest.mark.parametrize(
    ("timeout", "one_call"), [(None, True), (60, False)], ids=["fails fast", "waits"]
)
def test_several_names_refused_without_more_to_do(make_semaphore, timeout, one_call):
    """Several names, room on one but not on the two others: one statement
    for a caller that fails fast, naming both; nothing written."""
    full, free, also_full = (make_semaphore(capacity=c) for c in (1, 2, 1))
    acquire(full.name, external_id="h1")
    acquire(also_full.name, external_id="h2")
    ask = ask_for([full.name, free.name, also_full.name], "late", timeout=timeout)

    refused, sent = statements_of(attempt, ask)

    assert isinstance(refused, fairness.Refusal)
    assert refused.error.names == sorted([full.name, also_full.name])
    assert (len(sent) == 1) is one_call
    assert not PermitRequest.objects.filter(external_id="late").exists()
    free.refresh_from_db()
    assert (free.in_use, free.fencing_counter) == (0, 0)


@pytest.mark.parametrize("several", [False, True], ids=["one name", "several names"])
@pytest.mark.parametrize("case", ["expired holder", "key taken"])
def test_a_refusal_with_more_to_do_is_the_general_grants(make_semaphore, case, several):
    sem = make_semaphore(capacity=1)
    names = [sem.name, make_semaphore(capacity=1).name] if several else sem.name
    acquire(names, external_id="holder", ttl=60)
    if case == "expired holder":
        PermitRequest.objects.filter(external_id="holder").update(expires_at=timezone.now())
        assert acquire(names, external_id="k").state == "ACQUIRED"
        assert PermitRequest.objects.get(external_id="holder").release_reason == "expired"
    else:
        again, sent = statements_of(acquire, names, external_id="holder")
        assert again.external_id == "holder"
        assert len(sent) > 1


@pytest.mark.parametrize(
    "case", ["rate limit", "one of two a rate limit", "queue live on one of two"]
)
def test_declines_without_writing_and_the_general_grant_grants(make_semaphore, case):
    sem = make_semaphore(capacity=1)
    names: object = [sem.name, make_semaphore(capacity=1).name]
    if case == "one of two a rate limit":
        set_window(names[1], 60)
    elif case == "rate limit":
        names = sem.name
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


def ask_for(name: str | list[str], key: str, timeout: float | None = 60) -> fairness.Ask:
    """An acquire of ``name`` with a timeout (``None``: failing fast), as the
    engine is asked it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    return fairness.Ask(key, "me", validate_demand(name), deadline)


def attempt(
    ask: fairness.Ask, standing: fairness.Standing | None = None
) -> PermitRequest | fairness.Refusal:
    """One attempt of ``ask`` standing where it stands (first: nowhere), as
    the doors make it."""
    return grant.acquire_once(connections["default"], ask, standing or fairness.Standing(), None, 5)


def test_a_fair_line_of_one_name_is_served_in_one_statement(make_semaphore):
    """The routine for one name serves a fair line as the general grant
    does: a waiter's refusal takes its ticket, a newcomer is refused the
    room the ticket lacks, and the waiter's grant deletes its ticket."""
    sem = make_semaphore(capacity=1)
    acquire(sem.name, external_id="holder")
    ask = ask_for(sem.name, "waiter")

    refusal, sent = statements_of(attempt, ask)

    assert len(sent) == 1
    assert isinstance(refusal, fairness.Refusal)
    assert refusal.error.names == [sem.name]
    assert refusal.standing.ticketed
    assert refusal.standing.lacked == {sem.pk}
    assert refusal.standing.semaphores == ((sem.pk, sem.name, 1),)
    assert refusal.standing.rounds == 0
    ticket = Ticket.objects.get(external_id="waiter")
    assert (ticket.semaphore_id, ticket.count, ticket.lacked) == (sem.pk, 1, True)
    # A lease (TICKET_LEASE, from the attempt's start) its waiter renews,
    # not its 60 s deadline.
    assert timedelta(seconds=9) < ticket.expires_at - ticket.created_at <= timedelta(seconds=10)
    sem.refresh_from_db()
    assert sem.queued_until == ticket.expires_at

    release("holder")
    with pytest.raises(SemaphoreExhausted):  # room, but the older ticket's
        acquire(sem.name, external_id="newcomer")
    later = ask_for(sem.name, "later")
    behind = attempt(later)
    assert isinstance(behind, fairness.Refusal)
    assert behind.standing.ticketed
    assert behind.standing.seq > refusal.standing.seq

    granted, sent = statements_of(attempt, ask, refusal.standing)

    assert len(sent) == 1
    assert isinstance(granted, PermitRequest)
    assert granted.fencing_tokens == {sem.name: 2}
    assert list(Ticket.objects.values_list("external_id", flat=True)) == ["later"]
    release("waiter")
    assert isinstance(attempt(later, behind.standing), PermitRequest)
    assert not Ticket.objects.exists()


@pytest.fixture
def head_wait(monkeypatch):
    """PostgreSQL's function for one name installed with another head wait
    (seconds), the usual one again after the test."""

    def install(seconds: float) -> None:
        monkeypatch.setattr(grant_routine, "HEAD_WAIT_MS", int(seconds * 1000))
        install_rendered()

    yield install
    with connection.cursor() as cursor:  # what the migration installed, again
        for create in _routines._statements(NEWEST, server()):
            cursor.execute(create)


def install_rendered() -> None:
    with connection.cursor() as cursor:
        for create in routines.creates(connections["default"]):
            cursor.execute(create)


def release_once_waiting_at_the_head(key: str) -> None:
    """Release ``key`` once a grant sleeps in its routine, waiting for room."""
    sleeping = (
        "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'PgSleep'"
        if connection.vendor == "postgresql"
        else "SELECT 1 FROM information_schema.PROCESSLIST WHERE STATE = 'User sleep'"
    )
    try:
        with connection.cursor() as cursor:
            for _ in range(1000):
                cursor.execute(sleeping)
                if cursor.fetchone():
                    break
                time.sleep(0.01)
        release(key)
    finally:
        connections.close_all()


@pytest.mark.parametrize("holder_ttl", [None, 60], ids=["holder without ttl", "holder leased"])
def test_the_first_in_a_fair_line_waits_for_a_release_at_the_head(
    make_semaphore, head_wait, holder_ttl
):
    """The first waiter of a fair line waits in its grant call (the next in
    line behind it, in the names' queue): a release meanwhile grants it in
    that call, with no ticket; none, and it is refused once the head wait or
    its own deadline ran out, whichever comes first. The wait never holds
    up the holder's release (MariaDB's check for expired holders locks
    their requests: it is read after the wait)."""
    head_wait(30)
    sem = make_semaphore(capacity=1)
    acquire(sem.name, external_id="holder", ttl=holder_ttl)
    ask = ask_for(sem.name, "waiter")
    releaser = start_threads(release_once_waiting_at_the_head, ("holder",), 1)

    started = time.monotonic()
    granted, sent = statements_of(attempt, ask)

    join(releaser, within=30)
    assert time.monotonic() - started < 10
    assert isinstance(granted, PermitRequest)
    assert len(sent) == 1
    assert not Ticket.objects.exists()

    for wait, timeout in [(0.3, 60), (30, 0.3)]:
        head_wait(wait)
        ask = ask_for(sem.name, unique(), timeout)
        started = time.monotonic()
        refused = attempt(ask)
        assert isinstance(refused, fairness.Refusal)
        assert 0.3 <= time.monotonic() - started < 10
        assert refused.standing.ticketed
        # Taken once it waited (0.3 s at least), it expires at the deadline
        # the call came with, or its lease's end if that comes first.
        ticket = Ticket.objects.get(external_id=ask.key)
        assert ticket.expires_at - ticket.created_at < timedelta(seconds=timeout - 0.2)
        ticket.delete()


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_the_head_waits_only_at_read_committed(make_semaphore, head_wait, level):
    """From a snapshot the head would see no release, and at MariaDB's
    SERIALIZABLE every release would wait behind it: refused at once, its
    ticket taken, where at READ COMMITTED it would wait for the release."""
    head_wait(30)
    sem = make_semaphore(capacity=1)
    acquire(sem.name, external_id="holder", ttl=60)
    set_level = (
        "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL"
        if connection.vendor == "postgresql"
        else "SET SESSION TRANSACTION ISOLATION LEVEL"
    )
    with connection.cursor() as cursor:
        cursor.execute(f"{set_level} {level}")
    try:
        started = time.monotonic()
        refused = attempt(ask_for(sem.name, "waiter"))
        assert time.monotonic() - started < 10
    finally:
        connection.close()  # the next session at the project's level again
    assert isinstance(refused, fairness.Refusal)
    assert refused.standing.ticketed
    release("holder")
    assert isinstance(attempt(ask_for(sem.name, "waiter"), refused.standing), PermitRequest)


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


def test_refusal_is_the_general_one(make_semaphore):
    sem = make_semaphore(capacity=1)
    acquire(sem.name, external_id="holder")
    with pytest.raises(SemaphoreExhausted):
        acquire(sem.name, external_id="late")


@pytest.mark.counter_drift_expected
def test_counters_written_behind_the_engine_never_fail_the_grant(make_semaphore):
    """As the general grant: a negative difference counts as nothing held."""
    sem = make_semaphore(capacity=2)
    with behind_the_engine():
        Semaphore.objects.filter(pk=sem.pk).update(in_use_counter=0, released_folded=5)
    # One formula: the ORM's in_use (the admin, parking) says what the grant sees.
    assert Semaphore.objects.get(pk=sem.pk).in_use == 0
    acquire(sem.name, external_id=unique())  # the connection's statements built

    request, sent = statements_of(acquire, sem.name, external_id="k")

    assert len(sent) == 1
    assert request.state == "ACQUIRED"
