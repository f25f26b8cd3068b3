from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from functools import partial

import pytest
from asgiref.sync import sync_to_async
from django.core.checks import CheckMessage, run_checks
from django.db import connection, connections
from django.db.models import DurationField, OuterRef, Subquery, Sum, Value
from django.db.models.functions import Coalesce
from django.dispatch import Signal

from django_semaphore import acquire, managers, parking, release, set_capacity
from django_semaphore.backends import DatabaseNow
from django_semaphore.guards import engine_writes
from django_semaphore.models import (
    CapacityChange,
    ParkedTask,
    Permit,
    PermitRequest,
    ReleaseCounter,
    Semaphore,
)
from django_semaphore.parking import wake
from django_semaphore.states import State
from django_semaphore.waiting import listening, standby
from tests.children import RUNTIME, STACKS_VARIABLE, dump_stacks_on_signal, stop

# scripts/watchdog.py reads which test each pytest process of the run is in.
PROGRESS_VARIABLE = "SEMAPHORE_PROGRESS_DIR"
_progress: dict[str, object] = {"pid": os.getpid()}


def pytest_configure(config: pytest.Config) -> None:
    """Stacks on SIGUSR1, for pytest-timeout's failures and the watchdog, in
    a directory the children inherit."""
    if STACKS_VARIABLE not in os.environ:
        RUNTIME.mkdir(exist_ok=True)
        os.environ[STACKS_VARIABLE] = tempfile.mkdtemp(prefix="stacks-", dir=RUNTIME)
        config.add_cleanup(partial(shutil.rmtree, os.environ[STACKS_VARIABLE], True))
    dump_stacks_on_signal()
    _report_progress(started=time.time(), test=None)


def pytest_runtest_protocol(item: pytest.Item) -> None:
    """The test starting, and its pytest-timeout timeout (0: none)."""
    marker = item.get_closest_marker("timeout")
    timeout = marker.args[0] if marker else item.config.getoption("timeout")
    if timeout is None:
        timeout = item.config.getini("timeout")
    _report_progress(test=item.nodeid, since=time.time(), timeout=float(timeout))


def pytest_sessionfinish() -> None:
    _report_progress(test=None, finished=time.time())


def _report_progress(**state: object) -> None:
    """Write this process's current test where the watchdog looks
    (atomically: it may read at any moment)."""
    _progress.update(state)
    directory = os.environ.get(PROGRESS_VARIABLE)
    if directory:
        path = os.path.join(directory, f"{os.getpid()}.json")
        with open(f"{path}.new", "w") as file:
            json.dump(_progress, file)
        os.replace(f"{path}.new", path)


@pytest.fixture(autouse=True)
def _no_child_left():
    """A child process a test leaves running (hung, or never joined) fails
    the test with its stacks, and is killed: pytest would wait for it at exit."""
    yield
    left = multiprocessing.active_children()
    if left:
        stacks = stop(left)
        pytest.fail(f"the test left {len(left)} child process(es) running:\n{stacks}")


@pytest.fixture(scope="session", autouse=True)
def _report_database(django_db_setup, django_db_blocker):
    """Fail loudly, never skip, when the configured database is unreachable."""
    with django_db_blocker.unblock():
        connection.ensure_connection()
    print(f"\nRunning on {connection.vendor} ({connection.settings_dict['NAME']})")
    yield
    # Before the test database is dropped: PostgreSQL refuses while the
    # waiting listener (a daemon thread's connection) is still connected.
    listening.LISTENER.stop()


@pytest.fixture
async def sync_thread_connections():
    """Close what an async test opened outside its own thread.

    asgiref runs sync code in one long-lived thread, and the async test
    client closes each response (releasing a view's permit) in the loop's
    executor, with Django's connection clean-up switched off. A connection
    left there keeps a session open, and the test database cannot be dropped.
    """
    yield
    await sync_to_async(connections.close_all)()
    await asyncio.get_running_loop().run_in_executor(None, connections.close_all)


def counter_drift(using: str = "default") -> dict[str, tuple[int, int]]:
    """Semaphore name -> (its in-use counter, the permits it holds), for each
    semaphore whose counter is not exact. One statement, so one snapshot: a
    release committing between two reads (a Celery task's, after its result
    is stored) cannot look like drift."""
    held = (
        Permit.objects.using(using)
        .filter(semaphore=OuterRef("pk"), state=State.ACQUIRED)
        .order_by()
        .values("semaphore")
        .annotate(total=Sum("count"))
        .values("total")
    )
    in_window = (
        Permit.objects.using(using)
        .filter(semaphore=OuterRef("pk"), slot_ends__gt=DatabaseNow())
        .order_by()
        .values("semaphore")
        .annotate(total=Sum("count"))
        .values("total")
    )
    rows = (
        Semaphore.objects.using(using)
        .annotate(
            counted=managers.held(ReleaseCounter),
            held=Coalesce(Subquery(held), 0),
            counted_slots=managers.in_window(Permit),
            slots=Coalesce(Subquery(in_window), 0),
        )
        .values_list("name", "counted", "held", "window", "counted_slots", "slots")
    )
    drift = {}
    for name, counted, held_now, window, counted_slots, slots in rows:
        if counted != int(held_now):
            drift[name] = (counted, int(held_now))
        elif window is not None and counted_slots != int(slots):
            drift[f"{name} (slots)"] = (counted_slots, int(slots))
    return drift


@pytest.fixture(autouse=True)
def _exact_in_use_counter(request):
    """After every test that touches the database: each semaphore's in-use
    counter equals the permits it holds. Every path that changes a permit
    must change the counter in the same transaction, so any test that
    exercises one also checks it. Tests that write inconsistent rows on
    purpose are marked ``counter_drift_expected``."""
    uses_db = request.node.get_closest_marker("django_db") or {"db", "transactional_db"} & set(
        request.fixturenames
    )
    if uses_db:
        # Set up first, so its rollback (or flush) comes after this check.
        request.getfixturevalue("_django_db_helper")
    yield
    if uses_db and not request.node.get_closest_marker("counter_drift_expected"):
        assert counter_drift() == {}, "in-use counter drift (name: (counter, held))"


def behind_the_engine() -> AbstractContextManager[None]:
    """Write what only the engine may, as a crash between two statements, a
    manual SQL edit or a restore from backup would leave it (no guard sees
    those)."""
    return engine_writes()


def static_checks() -> list[CheckMessage]:
    """The system checks that open no database. Django 6.1 runs the model
    checks against every alias unless told none (a JSONField's, such as
    django-tasks-db's, reads the database's features), which a test without
    database access must not."""
    return run_checks(databases=[])


def unique(prefix: str = "sem") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def ago(**kwargs: float) -> object:
    """A moment in the past by the database's clock, for rows made old."""
    return DatabaseNow() - Value(timedelta(**kwargs), DurationField())


@pytest.fixture
def leftovers(make_semaphore) -> tuple[PermitRequest, PermitRequest]:
    """What the sweeps find: an expired request, one released 8 days ago,
    and a capacity change 31 days old."""
    sem = make_semaphore(capacity=5)
    expired = acquire(sem.name, external_id=unique(), ttl=60)
    PermitRequest.objects.filter(pk=expired.pk).update(expires_at=ago(seconds=1))
    old = acquire(sem.name, external_id=unique())
    release(old.external_id)
    PermitRequest.objects.filter(pk=old.pk).update(released_at=ago(days=8))
    set_capacity(sem.name, 6)
    CapacityChange.objects.update(changed_at=ago(days=31))
    return expired, old


@pytest.fixture
def make_semaphore(db) -> Callable[..., Semaphore]:
    def make(capacity: int = 1, name: str | None = None) -> Semaphore:
        return Semaphore.objects.create(name=name or unique(), capacity=capacity)

    return make


def forked_child_exit_code(pid: int, within: float, stuck: str) -> int:
    """The exit code of a forked child, which must end within ``within``
    seconds: past that it is killed and the test fails with ``stuck``."""
    deadline = time.monotonic() + within
    while (ended := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(stuck)
        time.sleep(0.01)
    return os.waitstatus_to_exitcode(ended[1])


# --- parked tasks (test_parked, test_tenants) ---------------------------------------


@contextmanager
def parking_in_this_process(enabled: bool) -> Iterator[None]:
    """Whether this process's releases wake parked tasks, for a while (on by
    default, PARK_TASKS; the state the process had is restored)."""
    was = parking.enabled()
    (parking.enable if enabled else parking.disable)()
    try:
        yield
    finally:
        (parking.enable if was else parking.disable)()


@contextmanager
def no_receivers(*signals: Signal) -> Iterator[None]:
    """Nobody listens to these signals, for a while. The app's signals cache
    their receivers per sender: the cache is emptied on the way in and out."""
    kept = [signal.receivers for signal in signals]
    try:
        for signal in signals:
            signal.receivers = []
            signal.sender_receivers_cache.clear()
        yield
    finally:
        for signal, receivers in zip(signals, kept, strict=True):
            signal.receivers = receivers
            signal.sender_receivers_cache.clear()


@pytest.fixture
def wakes() -> Iterator[None]:
    """This (test) process's releases wake parked tasks, as a worker's do."""
    with parking_in_this_process(True):
        yield


@pytest.fixture
def wakes_nobody() -> Iterator[None]:
    """This process's releases wake nobody: a process with PARK_TASKS off."""
    with parking_in_this_process(False):
        yield


@pytest.fixture
def published(monkeypatch, wakes_nobody) -> list[str]:
    """The task ids a wake-up publishes, instead of publishing them; the
    test's releases wake nobody: it calls ``wake`` itself."""
    sent: list[str] = []

    def publish(alias: str, parked: list[int]) -> int:
        ids = ParkedTask.objects.using(alias).filter(id__in=parked).order_by("id")
        sent.extend(ids.values_list("task_id", flat=True))
        return len(parked)

    monkeypatch.setattr(wake, "publish", publish)
    return sent


@pytest.fixture
def holds() -> Iterator[dict[str, float]]:
    """This process's memory of holds, empty for the test."""
    saved = dict(standby._holds)
    standby._holds.clear()
    yield standby._holds
    standby._holds.clear()
    standby._holds.update(saved)


from tests.celery_worker import celery_worker, short_lease_worker  # noqa: E402, F401  (fixtures)
