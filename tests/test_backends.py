"""Lock waits, retries and lost connections, provoked for real on each database."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db import DatabaseError, connection, connections, transaction

from django_semaphore import ReleaseOutcome, acquire, backends, release
from django_semaphore.backends import Failure
from django_semaphore.engine import prelock
from django_semaphore.engine.releasing import release_requests
from django_semaphore.exceptions import LockContention, SemaphoreError
from django_semaphore.models import PermitRequest, ReleaseCounter, Semaphore
from django_semaphore.retry import run_with_retries
from tests.conftest import unique

pytestmark = pytest.mark.django_db(transaction=True)


@contextmanager
def row_locked_elsewhere(
    name: str, hold: float = 30.0, row: str = "semaphore"
) -> Iterator[threading.Event]:
    """Hold the semaphore's row lock (a grant's), or with ``row="release
    counter"`` its release counter's (a release's), from another connection
    for ``hold`` seconds (or until the yielded event is set)."""
    locked, done = threading.Event(), threading.Event()

    def hold_lock() -> None:
        try:
            with transaction.atomic():
                # On SQLite the IMMEDIATE transaction itself is the write lock.
                if row == "semaphore":
                    list(Semaphore.objects.select_for_update().filter(name=name))
                else:
                    list(ReleaseCounter.objects.locked().filter(semaphore__name=name))
                locked.set()
                done.wait(hold)
        finally:
            connections.close_all()

    thread = threading.Thread(daemon=True, target=hold_lock)
    thread.start()
    assert locked.wait(10)
    try:
        yield done
    finally:
        done.set()
        thread.join()


def session_lock_wait() -> object:
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute("SELECT @@SESSION.innodb_lock_wait_timeout")
        elif connection.vendor == "postgresql":
            cursor.execute("SHOW lock_timeout")
        else:
            cursor.execute("PRAGMA busy_timeout")
        return cursor.fetchone()[0]


def test_lock_wait_is_bounded_then_a_typed_error(make_semaphore, settings):
    settings.DJANGO_SEMAPHORE = {"LOCK_WAIT_TIMEOUT": 1, "RETRY_ATTEMPTS": 2}
    sem = make_semaphore()
    before = session_lock_wait()

    with row_locked_elsewhere(sem.name):
        started = time.monotonic()
        with pytest.raises(LockContention) as excinfo:
            acquire(sem.name, external_id=unique())
        elapsed = time.monotonic() - started

    assert 2 <= elapsed < 6  # two bounded waits, not the server's default
    assert isinstance(excinfo.value.__cause__, DatabaseError)  # kept for debugging
    assert session_lock_wait() == before  # restored for the rest of the session


def release_by(path: str, key: str) -> None:
    if path == "by key":
        assert release(key) is ReleaseOutcome.RELEASED
    else:
        request = PermitRequest.objects.get(external_id=key)
        assert release_requests(connection.alias, [request.pk], "released").ended == 1


@pytest.mark.parametrize("path", ["by key", "by request"])
def test_a_release_waits_for_its_release_counter_within_the_same_bound(
    make_semaphore, settings, path
):
    """Release locks the release counters it adds to: its wait is bounded
    like the grant's, then retried (by key: longer than an acquire's), then
    a typed error; the permit is still held and a later release frees it."""
    settings.DJANGO_SEMAPHORE = {"LOCK_WAIT_TIMEOUT": 1, "RETRY_ATTEMPTS": 1}
    sem = make_semaphore()
    key = unique()
    acquire(sem.name, external_id=key)
    before = session_lock_wait()

    with row_locked_elsewhere(sem.name, row="release counter"):
        started = time.monotonic()
        with pytest.raises(LockContention):
            if path == "by key":
                release(key)
            else:
                run_with_retries(connection, lambda: release_by(path, key))
        elapsed = time.monotonic() - started

    assert (4 if path == "by key" else 1) <= elapsed < 12  # bounded waits
    assert session_lock_wait() == before
    assert Semaphore.objects.get(pk=sem.pk).in_use == 1
    release_by(path, key)
    assert Semaphore.objects.get(pk=sem.pk).in_use == 0


@pytest.mark.parametrize("path", ["by key", "by request"])
def test_a_release_never_waits_behind_a_grant(make_semaphore, settings, path):
    """A grant holds the semaphore row locked until it commits, and grants
    queue on it: a release counts what it frees on the release counter, so
    it returns at once, and the next grant finds the room."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has one writer at a time: a release waits for the grant's commit.")
    settings.DJANGO_SEMAPHORE = {"LOCK_WAIT_TIMEOUT": 5}
    sem = make_semaphore(capacity=1)
    key = unique()
    acquire(sem.name, external_id=key)

    with row_locked_elsewhere(sem.name):
        started = time.monotonic()
        release_by(path, key)
        elapsed = time.monotonic() - started

    assert elapsed < 2, "the release waited for the semaphore row"
    assert Semaphore.objects.get(pk=sem.pk).in_use == 0
    acquire(sem.name, external_id=unique())  # the room is there at once


def test_lock_wait_timeout_is_retried(make_semaphore, settings):
    settings.DJANGO_SEMAPHORE = {"LOCK_WAIT_TIMEOUT": 1, "RETRY_ATTEMPTS": 3}
    sem = make_semaphore()

    with row_locked_elsewhere(sem.name, hold=1.5):
        request = acquire(sem.name, external_id=unique())

    assert request.is_held


def test_real_deadlocks_are_classified_as_contention(make_semaphore):
    """Two transactions locking two rows in opposite orders, for real."""
    a, b = make_semaphore(), make_semaphore()
    barrier = threading.Barrier(2)
    errors: list[DatabaseError] = []

    def lock(first: str, second: str) -> None:
        try:
            if connection.vendor == "sqlite":
                with connection.cursor() as cursor:
                    cursor.execute("PRAGMA busy_timeout = 100")
            with transaction.atomic():
                list(Semaphore.objects.select_for_update().filter(name=first))
                barrier.wait(10)
                list(Semaphore.objects.select_for_update().filter(name=second))
        except DatabaseError as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [
        threading.Thread(daemon=True, target=lock, args=(a.name, b.name)),
        threading.Thread(daemon=True, target=lock, args=(b.name, a.name)),
    ]
    if connection.vendor == "sqlite":
        # SQLite has one write lock per file: the second IMMEDIATE transaction
        # never gets in to take its first row, so it reports "locked" instead.
        threads = threads[:1]
        with row_locked_elsewhere(a.name):
            threads[0].start()
            threads[0].join()
    else:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(errors) == 1
    assert backends.classify(connection, errors[0]) is Failure.CONTENTION


def kill_own_connection() -> None:
    """End this connection from the server side, as a failover or KILL would."""
    connection.ensure_connection()
    with connections["semaphores"].cursor() as killer:
        if connection.vendor == "mysql":
            thread_id = connection.connection.thread_id()
            killer.execute(f"KILL {int(thread_id)}")
        else:
            pid = connection.connection.info.backend_pid
            killer.execute("SELECT pg_terminate_backend(%s)", [pid])


@pytest.mark.django_db(transaction=True, databases=["default", "semaphores"])
def test_lost_connection_is_reconnected_and_retried(make_semaphore):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite is a file in this process: there is no connection to lose.")
    sem = make_semaphore()
    kill_own_connection()

    request = acquire(sem.name, external_id=unique())

    assert request.is_held
    assert Semaphore.objects.with_usage().get(pk=sem.pk).in_use == 1


def test_prelock_keeps_one_process_to_one_waiting_connection(make_semaphore, settings):
    settings.DJANGO_SEMAPHORE = {"PRELOCK_TIMEOUT": 0.2, "RETRY_ATTEMPTS": 2}
    busy, free = make_semaphore(), make_semaphore()
    outcome: list[object] = []

    def try_acquire(name: str) -> None:
        try:
            outcome.append(acquire(name, external_id=unique()))
        except LockContention as exc:
            outcome.append(exc)
        finally:
            connections.close_all()

    with prelock.prelocked([busy.name]):
        for name in (busy.name, free.name):
            thread = threading.Thread(daemon=True, target=try_acquire, args=(name,))
            thread.start()
            thread.join()

    busy_outcome, free_outcome = outcome
    assert isinstance(busy_outcome, LockContention)  # waited in memory, then gave up
    assert free_outcome.is_held  # other names are not held up


@pytest.mark.django_db(transaction=True)
def test_a_connection_the_driver_gave_up_on_is_replaced_and_the_operation_retried():
    """Closed under Django's feet, the driver's connection fails its next
    statement (MySQLdb: InterfaceError (0, ''), which is no DatabaseError);
    the retry closes it, reconnects and runs the operation again."""
    connection.ensure_connection()
    connection.connection.close()
    calls = []

    def operation() -> int:
        calls.append(1)
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            return cursor.fetchone()[0]

    if connection.vendor == "sqlite":
        # A file, not a server: a closed handle is a bug of ours, not a lost link.
        with pytest.raises(SemaphoreError):
            run_with_retries(connection, operation)
        connection.close()
    else:
        assert run_with_retries(connection, operation) == 1
        assert len(calls) == 2
