"""Parked Celery tasks: refused tasks wait in the database and are published
again, first in first out, when releases make room (``parking``).

The first part runs a real prefork worker on a real Redis broker; the second
checks the wake-up's choices on rows written directly, with the publish
replaced, so every rule can fail on its own.
"""

from __future__ import annotations

import importlib
import itertools
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from io import StringIO
from types import SimpleNamespace
from typing import Any

import pytest
from celery.result import AsyncResult
from django.contrib.admin.models import DELETION, LogEntry
from django.core.management import call_command
from django.db import connection, connections
from django.db.migrations.loader import MigrationLoader
from django.db.models import DurationField, Value
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_semaphore import acquire, force_release, parking, release, sweep
from django_semaphore.admin.semaphores import SemaphoreAdmin
from django_semaphore.api import set_capacity
from django_semaphore.backends import DatabaseNow
from django_semaphore.engine import fairness
from django_semaphore.exceptions import SemaphoreExhausted, SemaphoreNotFound, WaitersInLine
from django_semaphore.integrations import task_keys
from django_semaphore.models import ParkedTask, PermitRequest, Semaphore, Ticket
from django_semaphore.parking import rows, wake
from django_semaphore.states import State
from django_semaphore.waiting import standby
from tests import tasks
from tests.conftest import behind_the_engine, parking_in_this_process, unique
from tests.testapp.models import RunLog

pytestmark = pytest.mark.django_db(transaction=True)


def eventually(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def parked_ids() -> list[str]:
    return list(ParkedTask.objects.order_by("id").values_list("task_id", flat=True))


def settled(results: list[AsyncResult], timeout: float = 90) -> None:
    for result in results:
        result.get(timeout=timeout, propagate=False)
    keys = [r.id for r in results]
    eventually(
        lambda: (
            not PermitRequest.objects.filter(external_id__in=keys, state=State.ACQUIRED).exists()
        ),
        "every finished task released its permit",
        timeout=10,
    )


# --- a real worker on Redis ------------------------------------------------------------


@pytest.fixture
def park(celery_worker: Any) -> Semaphore:
    return Semaphore.objects.create(name=tasks.PARK, capacity=1)


@pytest.mark.slow
def test_a_backlog_parks_and_drains_first_in_first_out_without_failing(park, wakes):
    acquire(tasks.PARK, external_id="held-by-the-test")
    results = []
    for n in range(6):
        results.append(tasks.parked.delay("backlog", 0.1))
        # Parked one after the other, so their order is known.
        eventually(lambda n=n: len(parked_ids()) == n + 1, f"task {n} parked")
    assert parked_ids() == [r.id for r in results]
    assert {r.state for r in results} == {parking.PARKED}
    assert not RunLog.objects.filter(label="backlog").exists()

    release("held-by-the-test")
    settled(results)

    assert [r.state for r in results] == ["SUCCESS"] * 6, [r.traceback for r in results]
    runs = list(RunLog.objects.filter(label="backlog").order_by("started_at"))
    assert [run.task_id for run in runs] == [r.id for r in results]  # first in, first out
    for earlier, later in itertools.pairwise(runs):
        assert earlier.ended_at <= later.started_at, "two runs held a capacity-1 permit at once"
    assert parked_ids() == []
    # Parking is not a retry: the tasks have max_retries=0 and none was spent.
    assert PermitRequest.objects.filter(external_id__in=[r.id for r in results]).count() == 6


@pytest.mark.slow
def test_a_capacity_raise_wakes_as_many_as_fit(park, wakes):
    acquire(tasks.PARK, external_id="held-by-the-test")
    results = [tasks.parked.delay("raised", 1.0) for _ in range(3)]
    eventually(lambda: len(parked_ids()) == 3, "three tasks parked")

    set_capacity(tasks.PARK, 3)  # room for two: the test still holds one
    eventually(lambda: RunLog.objects.filter(label="raised").count() == 2, "two started")
    assert len(parked_ids()) == 1
    release("held-by-the-test")
    settled(results)

    assert [r.state for r in results] == ["SUCCESS"] * 3


@pytest.mark.slow
def test_a_release_where_parking_is_off_is_caught_by_the_beat_sweep(park, wakes_nobody):
    acquire(tasks.PARK, external_id="held-by-the-test")
    result = tasks.parked.delay("swept", 0)
    eventually(lambda: parked_ids() == [result.id], "the task parked")

    release("held-by-the-test")  # this process does not wake parked tasks
    time.sleep(0.5)
    assert parked_ids() == [result.id]
    report = sweep.sweep_parked()
    settled([result])

    assert report.woken == 1
    assert result.state == "SUCCESS"
    assert parked_ids() == []


@pytest.mark.slow
def test_a_multi_semaphore_task_parks_and_runs_when_both_have_room(park, wakes):
    Semaphore.objects.create(name=tasks.PARK_OTHER, capacity=1)
    acquire(tasks.PARK_OTHER, external_id="held-by-the-test")
    result = tasks.parked_on_two.delay("two", 0)
    eventually(lambda: parked_ids() == [result.id], "the task parked")

    release("held-by-the-test")
    settled([result])

    assert result.state == "SUCCESS"
    request = PermitRequest.objects.get(external_id=result.id)
    assert set(request.fencing_tokens) == {tasks.PARK, tasks.PARK_OTHER}


@pytest.mark.slow
def test_a_revoked_parked_task_is_dropped_when_its_turn_comes(park, wakes, celery_worker):
    acquire(tasks.PARK, external_id="held-by-the-test")
    revoked = tasks.parked.delay("revoked", 0)
    kept = tasks.parked.delay("kept", 0)
    eventually(lambda: len(parked_ids()) == 2, "both parked")
    revoked.revoke()
    time.sleep(0.5)  # the broadcast reaches the worker

    release("held-by-the-test")
    settled([kept])

    assert kept.state == "SUCCESS"
    eventually(lambda: parked_ids() == [], "the revoked task's row dropped")
    assert not RunLog.objects.filter(label="revoked").exists()
    assert AsyncResult(revoked.id).state == "REVOKED"


@pytest.mark.slow
def test_a_parked_task_past_its_expiry_is_dropped_not_run(park, wakes):
    acquire(tasks.PARK, external_id="held-by-the-test")
    expiring = tasks.parked.apply_async(args=["expiring", 0], expires=1)
    eventually(lambda: parked_ids() == [expiring.id], "the task parked")
    assert ParkedTask.objects.get().expires_at is not None
    time.sleep(1.5)

    release("held-by-the-test")  # passes it over: never published
    time.sleep(0.5)
    assert parked_ids() == [expiring.id]
    assert sweep.sweep_parked().dropped == 1

    assert parked_ids() == []
    assert not RunLog.objects.filter(label="expiring").exists()


@pytest.mark.slow
def test_a_parked_task_published_twice_runs_once(park, wakes):
    acquire(tasks.PARK, external_id="held-by-the-test")
    result = tasks.parked.delay("twice", 0)
    eventually(lambda: parked_ids() == [result.id], "the task parked")
    copy = ParkedTask.objects.get()

    release("held-by-the-test")
    settled([result])
    # The sweep publishing the same message again (it thought it lost).
    copy.save(using="default")
    ParkedTask.objects.filter(pk=copy.pk).update(woken_at=timezone.now())
    assert wake.publish("default", [copy.pk]) == 1
    eventually(lambda: parked_ids() == [], "the copy ran into its finished task")
    time.sleep(1.0)

    assert RunLog.objects.filter(label="twice").count() == 1
    assert PermitRequest.objects.filter(external_id__startswith=result.id).count() == 1


# --- the wake-up's choices, on rows written directly ----------------------------


def park_row(
    demand: dict[str, int],
    task_id: str | None = None,
    key: str | None = None,
    max_waiting: int | None = None,
    **fields: Any,
) -> str:
    task_id = task_id or unique("task")
    row = rows.Row(
        task_id,
        key or task_id,
        "tests.parked",
        b"{}",
        "application/json",
        "utf-8",
        fields.pop("expires_at", None),
    )
    parking._insert(connections["default"], row, demand, max_waiting)
    if fields:
        ParkedTask.objects.filter(task_id=row.task_id).update(**fields)
    return row.task_id


def semaphore(capacity: int) -> Semaphore:
    return Semaphore.objects.create(name=unique(), capacity=capacity)


def test_wake_is_first_in_first_out_and_a_big_demand_holds_back_younger_ones(published):
    s = semaphore(3)
    first = park_row({s.name: 1})
    big = park_row({s.name: 3})
    small = park_row({s.name: 1})
    acquire(s.name, external_id="a", owner="")
    acquire(s.name, external_id="b", owner="")
    acquire(s.name, external_id="c", owner="")

    assert wake.wake("default", [s.pk]) == 0  # no room
    release("a")
    assert wake.wake("default", [s.pk]) == 1
    assert published == [first]
    # Two free now, but the big one is next and needs three: small waits too.
    release("b")
    assert wake.wake("default", [s.pk]) == 0
    assert published == [first]
    parking.started(first, {s.name: 1})  # the first one's run took its permit
    release("c")
    assert wake.wake("default", [s.pk]) == 1
    assert published == [first, big]
    assert small in parked_ids()


@override_settings(DJANGO_SEMAPHORE={"TICKET_LEASE": 3})
def test_a_parked_tasks_tickets_live_by_its_row_not_by_a_ticket_lease(published):
    """A fair waiter's ticket lives by a short lease; a parked task's, with
    no process waiting, by its row: a renewal under its key (its woken
    run standing by) never shortens it."""
    s = semaphore(1)
    acquire(s.name, external_id="holder")
    task_id = park_row({s.name: 1})
    parked = Ticket.objects.annotate(now=DatabaseNow()).get(external_id=task_id)
    assert parked.expires_at > parked.now + timedelta(days=300)
    assert fairness.renew("default", [task_id], [s.pk]) == 1
    assert Ticket.objects.get(pk=parked.pk).expires_at == parked.expires_at
    assert Semaphore.objects.get(pk=s.pk).queued_until == parked.expires_at


def test_woken_tasks_keep_their_room_until_they_start(published):
    s = semaphore(2)
    one, two, three = (park_row({s.name: 1}) for _ in range(3))

    assert wake.wake("default", [s.pk]) == 2
    assert wake.wake("default", [s.pk]) == 0  # their room is kept for them
    parking.started(one, {s.name: 1})
    assert wake.wake("default", [s.pk]) == 1
    assert published == [one, two, three]


def test_a_grant_waits_behind_a_parked_task_in_the_one_line(published):
    """A parked task that lacked room keeps it from every younger caller, as
    a fair waiter's ticket does; once its run took it, the line is over
    and grants take one trip again."""
    s = semaphore(1)
    acquire(s.name, external_id="holder")
    task_id = park_row({s.name: 1})  # lacks room: first in line
    release("holder")

    with pytest.raises(SemaphoreExhausted):
        acquire(s.name, external_id=unique("younger"))  # its room is the task's
    assert wake.wake("default", [s.pk]) == 1
    with pytest.raises(SemaphoreExhausted):
        acquire(s.name, external_id=unique("younger"))  # kept while it is woken
    acquire(s.name, external_id=task_id)  # the woken task's run
    parking.started(task_id, {s.name: 1})
    assert not Ticket.objects.filter(semaphore=s).exists()
    release(task_id)
    acquire(s.name, external_id=unique("next"))
    assert Semaphore.objects.get(pk=s.pk).queued_until is None  # the line is over


def test_a_task_whose_permit_was_released_waits_under_its_next_key(published):
    """Its first run's permit was reclaimed (released) before the task
    ended: its next run claims under ``id~2``, and its tickets stand under
    that key, so its own place never holds its run back."""
    s = semaphore(1)
    task_id = unique("task")
    acquire(s.name, external_id=task_id)
    release(task_id)
    acquire(s.name, external_id="holder")
    key = task_keys.next_key(task_id)
    assert key == f"{task_id}~2"
    park_row({s.name: 1}, task_id=task_id, key=key)
    release("holder")

    assert wake.wake("default", [s.pk]) == 1
    acquire(s.name, external_id=key)  # its run: the room kept for it is its own
    parking.started(task_id, {s.name: 1})
    assert not Ticket.objects.filter(semaphore=s).exists()


def test_the_migration_puts_parked_demands_in_line_in_park_order(published):
    """Upgrading with tasks parked: each demand becomes its task's ticket, in
    park order, lacking room where it lacked it (everywhere for a woken
    task), and the wake-ups go on from there."""
    s = semaphore(1)
    acquire(s.name, external_id="holder")
    woken, waiting = unique("woken"), unique("waiting")
    migration = importlib.import_module("django_semaphore.migrations.0013_parked_tasks_in_line")
    # The models as 0013 hands them to the function: 0012's, with the
    # operations before it applied.
    loader = MigrationLoader(connection)
    state = loader.project_state(("django_semaphore", "0012_grant_queue"))
    operations = loader.get_migration("django_semaphore", "0013_parked_tasks_in_line").operations
    for operation in operations:
        if getattr(operation, "code", None) is migration.demands_to_tickets:
            break
        operation.state_forwards("django_semaphore", state)
    ParkedDemand = state.apps.get_model("django_semaphore", "ParkedDemand")
    with connection.schema_editor() as editor:  # the table as 0012 left it
        editor.create_model(ParkedDemand)
    try:
        for task_id, woken_at, lacked in ((woken, timezone.now(), False), (waiting, None, True)):
            task = ParkedTask.objects.create(
                task_id=task_id, key=task_id, task_name="tests.parked", body=b"{}",
                content_type="application/json", content_encoding="utf-8",
                parked_at=timezone.now(), woken_at=woken_at,
            )  # fmt: skip
            ParkedDemand.objects.create(task_id=task.pk, semaphore_id=s.pk, lacked=lacked)

        migration.demands_to_tickets(state.apps, SimpleNamespace(connection=connection))
    finally:
        with connection.schema_editor() as editor:
            editor.delete_model(ParkedDemand)

    line = Ticket.objects.filter(semaphore=s).order_by("id")
    assert list(line.values_list("external_id", "lacked")) == [(woken, True), (waiting, True)]
    assert Semaphore.objects.get(pk=s.pk).queued_until is not None
    release("holder")
    acquire(s.name, external_id=woken)  # the woken task's run: its room was kept
    parking.started(woken, {s.name: 1})
    release(woken)
    assert wake.wake("default", [s.pk]) == 1
    assert published == [waiting]


def test_wake_respects_the_other_semaphore_of_a_multi_semaphore_demand(published):
    a, b = semaphore(1), semaphore(1)
    older_on_b = park_row({b.name: 1})
    both = park_row({a.name: 1, b.name: 1})
    acquire(b.name, external_id="holds-b")

    assert wake.wake("default", [a.pk]) == 0  # b is full
    release("holds-b")
    # b's older parked task comes first there; "both" waits behind it.
    assert wake.wake("default", [a.pk]) == 0
    assert wake.wake("default", [b.pk]) == 1
    assert published == [older_on_b]
    parking.started(older_on_b, {b.name: 1})
    # "both" lacked room on b: b's next wake-up (its release's) finds it.
    assert wake.wake("default", [b.pk]) == 1
    assert published == [older_on_b, both]


def test_wake_leaves_room_to_earlier_fair_waiters(published):
    s = semaphore(1)
    now = timezone.now()
    Ticket.objects.create(
        semaphore=s, external_id="fair-waiter", count=1, created_at=now,
        expires_at=now + timedelta(minutes=1),
    )  # fmt: skip
    with behind_the_engine():  # as a fair waiter's attempt writes it
        Semaphore.objects.filter(pk=s.pk).update(queued_until=now + timedelta(minutes=1))
    task_id = park_row({s.name: 1})  # behind the fair waiter, in one line

    assert wake.wake("default", [s.pk]) == 0
    Ticket.objects.filter(external_id="fair-waiter").delete()
    assert wake.wake("default", [s.pk]) == 1
    assert published == [task_id]


def test_an_expired_row_is_passed_over_never_published(published):
    s = semaphore(1)
    gone = park_row({s.name: 1}, expires_at=timezone.now() - timedelta(seconds=1))
    live = park_row({s.name: 1})

    assert wake.wake("default", [s.pk]) == 1
    assert published == [live]
    assert parked_ids() == [gone, live]  # the sweep drops it (below)


def test_a_wake_up_reads_no_more_parked_tasks_than_fit(published):
    s = semaphore(3)
    rows = [park_row({s.name: 1}) for _ in range(5)]
    acquire(s.name, external_id=unique("held"))

    with CaptureQueriesContext(connection) as queries:
        assert wake.wake("default", [s.pk]) == 2
    assert published == rows[:2]
    windows = [q["sql"] for q in queries.captured_queries if "LIMIT" in q["sql"]]
    # The oldest that lacked room there, the oldest that lacked it nowhere
    # else; then, under the lock, the start of the line.
    assert [sql.rstrip()[-7:] for sql in windows] == ["LIMIT 2"] * 3, windows


def test_a_failed_publish_leaves_the_row_and_gives_its_room_back(monkeypatch):
    from celery import current_app

    s = semaphore(1)
    task_id = park_row({s.name: 1})
    ParkedTask.objects.filter(task_id=task_id).update(
        body=b'{"task": "tests.tasks.parked", "args": [], "kwargs": {}, "options": {}}'
    )

    def broker_down(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("broker down")

    monkeypatch.setattr(type(current_app.signature({"task": "x"})), "apply_async", broker_down)
    assert wake.wake("default", [s.pk]) == 1
    row = ParkedTask.objects.get(task_id=task_id)
    assert row.woken_at is None  # room given back: the next wake-up tries again


def test_the_sweep_publishes_overdue_wakes_again_and_drops_expired(published, settings):
    settings.DJANGO_SEMAPHORE = {"PARKED_REPUBLISH_AFTER": 60}
    s = semaphore(5)
    overdue = park_row({s.name: 1}, woken_at=timezone.now() - timedelta(minutes=2))
    recent = park_row({s.name: 1}, woken_at=timezone.now())
    expired = park_row({s.name: 1}, expires_at=timezone.now() - timedelta(seconds=1))
    waiting = park_row({s.name: 1})

    report = sweep.sweep_parked()

    assert (report.republished, report.woken, report.dropped) == (1, 1, 1)
    assert published == [overdue, waiting]
    assert set(parked_ids()) == {overdue, recent, waiting}
    assert expired not in parked_ids()


def test_a_task_parked_again_keeps_its_place(published):
    s = semaphore(1)
    first = park_row({s.name: 1})
    second = park_row({s.name: 1})
    assert wake.wake("default", [s.pk]) == 1
    park_row({s.name: 1}, task_id=first)  # woken, found no room again

    assert parked_ids() == [first, second]
    assert ParkedTask.objects.get(task_id=first).woken_at is None


def test_parking_on_an_unknown_semaphore_is_refused():
    with pytest.raises(SemaphoreNotFound):
        park_row({unique(): 1})


def test_cancel_drops_a_parked_task_and_offers_its_room(published):
    s = semaphore(1)
    first = park_row({s.name: 1})
    second = park_row({s.name: 1})
    assert wake.wake("default", [s.pk]) == 1

    assert parking.cancel([first]) == 1
    assert parked_ids() == [second]
    assert published == [first, second]


def test_a_semaphore_parked_tasks_wait_on_is_not_deleted(client):
    s = semaphore(1)
    task_id = park_row({s.name: 1})

    with pytest.raises(WaitersInLine, match="1 waiter"):
        s.delete()
    with pytest.raises(WaitersInLine):
        Semaphore.objects.filter(pk=s.pk).delete()
    page = staff_client(client, "delete_semaphore").post(
        reverse("admin:django_semaphore_semaphore_delete", args=[s.pk]), {"post": "yes"}
    )
    assert page.status_code == 200  # the confirmation again, listing it as protected
    row = ParkedTask.objects.get(task_id=task_id)
    link = reverse("admin:django_semaphore_parkedtask_change", args=[row.pk])
    assert page.context["protected"] == [
        f'Parked task: <a href="{link}">tests.parked[{task_id}]</a>'
    ]
    assert parked_ids() == [task_id]
    assert Ticket.objects.filter(semaphore=s).exists()

    parking.cancel([task_id])
    s.delete()
    assert not Semaphore.objects.filter(pk=s.pk).exists()


def test_the_sweep_drops_a_parked_task_whose_semaphore_is_gone(published, caplog):
    gone, kept = semaphore(1), semaphore(1)
    orphan = park_row({gone.name: 1})
    waiting = park_row({kept.name: 1})
    running = park_row({gone.name: 1})
    with behind_the_engine():  # raw SQL, or a version that let it through
        Semaphore.objects.filter(pk=gone.pk).delete()
        # This one's run holds its permit: its grant took its tickets, and
        # the run deletes its row (parking.started).
        PermitRequest.objects.create(external_id=running, created_at=timezone.now())

    report = sweep.sweep_parked()

    assert (report.orphaned, report.dropped) == (1, 0)
    assert "1 whose semaphore is gone" in str(report)
    assert parked_ids() == [waiting, running]
    assert f"Dropped parked task tests.parked[{orphan}]" in caplog.text


def test_every_door_that_frees_room_wakes_parked_tasks_there(wakes, monkeypatch):
    a, b, c = semaphore(3), semaphore(3), semaphore(3)
    woken: list[set[int]] = []
    monkeypatch.setattr(wake, "wake", lambda alias, ids: woken.append(set(ids)) or 0)
    acquire({a.name: 2, b.name: 1}, external_id="forced")
    acquire({a.name: 1, c.name: 1}, external_id="by-key")
    acquire({c.name: 1}, external_id="nothing-parked")
    park_row({a.name: 1})

    # A force release takes the general path, which knows all it freed.
    force_release(["forced"])
    # One statement where the database can, then a read of where tasks are
    # parked (on a, not on c); SQLite's general path knows all it freed.
    release("by-key")
    release("by-key")  # released already: nothing freed, nobody woken
    release("nothing-parked")
    set_capacity(c.name, 4)
    expired = acquire(b.name, external_id="expired", ttl=60)
    with behind_the_engine():
        PermitRequest.objects.filter(pk=expired.pk).update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )
    sweep.release_orphans()  # the sweep's release of an expired permit
    with parking_in_this_process(False):
        acquire(a.name, external_id="not-here")
        release("not-here")  # this process wakes nobody: the beat sweep does

    one_statement = connection.vendor in ("mysql", "postgresql")
    assert woken == [
        {a.pk, b.pk},
        {a.pk} if one_statement else {a.pk, c.pk},
        *([] if one_statement else [{c.pk}]),
        {c.pk},
        {b.pk},
    ]


def test_the_one_statement_release_wakes_the_task_parked_on_its_room(published):
    """Where parked tasks wait is read after the release committed: a task
    parked before that read is woken by it (one parked after it finds the
    room itself: ``parking.park`` looks once more)."""
    s = semaphore(1)
    acquire(s.name, external_id="holder")
    park_row({s.name: 1}, task_id="parked")
    with parking_in_this_process(True):
        release("holder")
    assert published == ["parked"]


# --- standing by ---------------------------------------------------------------------


def claimer(name: str, key: str) -> standby.Claim:
    def claim(timeout: float) -> str:
        acquire(name, external_id=key, timeout=timeout)
        return key

    return claim


def release_later(key: str, after: float) -> threading.Thread:
    def run() -> None:
        time.sleep(after)
        try:
            release(key)
        finally:
            connections.close_all()  # this thread's: the test database is dropped at the end

    thread = threading.Thread(daemon=True, target=run)
    thread.start()
    return thread


def test_a_refused_task_stands_by_and_takes_the_next_release(holds):
    s = semaphore(1)
    acquire(s.name, external_id="holder")
    holds[s.name] = 0.05  # a short hold seen: it probes every 5 ms
    started = time.monotonic()  # before the releaser's sleep starts
    releaser = release_later("holder", 0.3)

    key = standby.stand_by("new", {s.name: 1}, claimer(s.name, "new"))
    waited = time.monotonic() - started
    releaser.join()

    assert key == "new"
    # Woken by the release, well before its stand-by (STANDBY_WAIT) ends.
    assert 0.3 <= waited < 0.3 + 1.0, waited
    assert PermitRequest.objects.get(external_id="new").state == State.ACQUIRED
    assert parked_ids() == []


def test_a_refused_parking_task_stands_by_in_its_worker_and_runs(holds, wakes):
    Semaphore.objects.create(name=tasks.PARK, capacity=1)
    acquire(tasks.PARK, external_id="held-by-the-test")
    holds[tasks.PARK] = 0.05
    releaser = release_later("held-by-the-test", 0.3)

    result = tasks.parked.apply(args=["stood-by", 0.1])  # run here, as a worker would
    releaser.join()

    assert result.state == "SUCCESS", result.traceback
    assert RunLog.objects.filter(label="stood-by", task_id=result.id).exists()
    assert not ParkedTask.objects.exists()  # never parked
    assert holds[tasks.PARK] >= 0.1  # its own hold, for the next refused ones


def test_a_woken_task_stands_by_though_younger_ones_are_parked(holds, published):
    s = semaphore(1)
    woken = park_row({s.name: 1}, woken_at=timezone.now())
    park_row({s.name: 1})
    acquire(s.name, external_id="holder")
    releaser = release_later("holder", 0.1)

    assert standby.stand_by(woken, {s.name: 1}, claimer(s.name, woken)) == woken
    releaser.join()


def test_a_new_task_parks_behind_parked_ones_and_a_copy_of_a_parked_one_parks(holds, published):
    s = semaphore(1)
    acquire(s.name, external_id="holder")
    parked = park_row({s.name: 1})  # it lacked room: it holds back younger ones
    never = claimer(s.name, "never")

    started = time.monotonic()
    assert standby.stand_by("new", {s.name: 1}, never) is None
    assert standby.stand_by(parked, {s.name: 1}, never) is None
    assert time.monotonic() - started < 0.5
    assert not PermitRequest.objects.filter(external_id="never").exists()


def test_one_task_a_process_stands_by_on_a_semaphore_the_others_park(holds):
    s = semaphore(1)
    acquire(s.name, external_id="holder")
    holds[s.name] = 0.05
    first: list[str | None] = []
    standing = threading.Thread(
        daemon=True,
        target=lambda: first.append(
            standby.stand_by("first", {s.name: 1}, claimer(s.name, "first"))
        ),
    )
    standing.start()
    time.sleep(0.1)  # "first" stands by (a thread pool's other task comes now)

    started = time.monotonic()
    assert standby.stand_by("second", {s.name: 1}, claimer(s.name, "second")) is None
    assert time.monotonic() - started < 0.1
    release("holder")
    standing.join()
    assert first == ["first"]


def test_a_long_hold_parks_at_once_and_an_unanswered_standby_learns_it(holds, monkeypatch):
    s = semaphore(1)
    acquire(s.name, external_id="holder")
    never = claimer(s.name, "never")
    monkeypatch.setattr(standby, "STANDBY_WAIT", 0.2)

    started = time.monotonic()
    assert standby.stand_by("first", {s.name: 1}, never) is None  # nothing seen: stood by
    assert time.monotonic() - started >= 0.2
    assert holds == {s.name: 0.2}  # no release came: as long as its wait, here

    holds[s.name] = standby.SHORT_HOLD
    started = time.monotonic()
    assert standby.stand_by("second", {s.name: 1}, never) is None
    assert time.monotonic() - started < 0.1


def test_a_familys_members_share_what_a_stand_by_learned(holds, monkeypatch, settings):
    """Stand-by learns per family: of many members held long, only the first
    refused one stands by in this process; the others park at once."""
    family = f"{unique('stand-by-family')}:*"
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": {family: 1}}
    members = [family.replace("*", str(n)) for n in range(20)]
    for member in members:
        acquire(member, external_id=f"holder-{member}")  # created on first use, then held
    monkeypatch.setattr(standby, "SHORT_HOLD", 0.2)
    monkeypatch.setattr(standby, "STANDBY_WAIT", 0.2)
    waits = []
    for member in members:
        started = time.monotonic()
        assert standby.stand_by(unique("task"), {member: 1}, claimer(member, "never")) is None
        waits.append(time.monotonic() - started)

    assert waits[0] >= 0.2  # nothing seen yet: it stood by
    assert max(waits[1:]) < 0.1, waits  # the family is known held long
    assert holds == {family: 0.2}  # one entry for the family, none per member
    assert not PermitRequest.objects.filter(external_id="never").exists()


def test_a_members_run_teaches_its_family_and_other_names_stay_apart(holds, settings):
    family = f"{unique('held-family')}:*"
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": {family: 1}}
    lone = unique()

    standby.learn_hold({family.replace("*", "a"): 1, lone: 1}, 3.0)

    assert holds == {family: 3.0, lone: 3.0}
    assert standby.learned_holds({family.replace("*", "b"): 1}) == [3.0]
    assert standby.learned_holds({unique(): 1}) == []


# --- visible: admin, semaphore_status, metrics ------------------------------------


def staff_client(client: Any, *codenames: str) -> Any:
    from tests.test_admin import staff

    client.force_login(staff("view_semaphore", "view_parkedtask", *codenames))
    return client


def test_the_changelist_and_the_semaphore_page_show_parked_tasks(client):
    s = semaphore(1)
    park_row({s.name: 1})
    park_row({s.name: 1})
    viewer = staff_client(client)

    response = viewer.get(reverse("admin:django_semaphore_semaphore_changelist"), {"q": s.name})
    assert response.context["cl"].result_list.get().parked == 2
    parked_list = reverse("admin:django_semaphore_parkedtask_changelist")
    link = f"{parked_list}?tickets__semaphore__id__exact={s.pk}"
    assert link in response.content.decode()
    page = viewer.get(reverse("admin:django_semaphore_semaphore_change", args=[s.pk]))
    assert link in page.content.decode()
    listed = viewer.get(link.replace("&amp;", "&"))
    assert len(listed.context["cl"].result_list) == 2
    # Viewing is not dropping.
    assert listed.context["action_form"] is None


def test_the_drop_action_needs_the_delete_permission_and_drops(client):
    s = semaphore(1)
    dropped = park_row({s.name: 1})
    kept = park_row({s.name: 1})
    url = reverse("admin:django_semaphore_parkedtask_changelist")
    row = ParkedTask.objects.get(task_id=dropped)
    form = {"action": "drop", "_selected_action": [row.pk]}

    assert staff_client(client).post(url, form).status_code == 403
    assert parked_ids() == [dropped, kept]
    response = staff_client(client, "delete_parkedtask").post(url, form, follow=True)

    assert parked_ids() == [kept]
    assert "1 parked task was dropped." in [str(m) for m in response.context["messages"]]
    [entry] = LogEntry.objects.filter(object_id=str(row.pk), action_flag=DELETION)
    assert entry.user == response.context["user"]


def test_semaphore_status_and_the_metrics_count_parked_tasks(client):
    from django.core.management import call_command

    s = semaphore(1)
    for _ in range(3):
        park_row({s.name: 1})
    out = StringIO()
    call_command("semaphore_status", s.name, stdout=out)
    header, row = out.getvalue().splitlines()[:2]
    assert header.split()[-3:] == ["parked", "oldest", "parked"]
    assert row.split()[-2] == "3"

    metrics = client.get("/metrics/").content.decode()
    assert f'django_semaphore_parked_tasks{{semaphore="{s.name}"}} 3.0' in metrics


def aged(task_id: str, seconds: int) -> None:
    """Make a parked row ``seconds`` old by the database's clock."""
    ParkedTask.objects.filter(task_id=task_id).update(
        parked_at=DatabaseNow() - Value(timedelta(seconds=seconds), DurationField())
    )


def test_the_oldest_parked_task_is_aged_by_the_database_clock_everywhere(client):
    older, newer, idle = semaphore(1), semaphore(1), semaphore(1)
    aged(park_row({older.name: 1}), 150)
    aged(park_row({older.name: 1}), 20)  # younger, behind it in line
    aged(park_row({newer.name: 1}), 90)
    viewer = staff_client(client)
    changelist = reverse("admin:django_semaphore_semaphore_changelist")
    column = SemaphoreAdmin.list_display.index("oldest_parked")

    # Sorted by the column, oldest first; idle ones have none.
    response = viewer.get(changelist, {"o": str(column)})
    listed = [s.name for s in response.context["cl"].result_list if s.parked]
    assert listed == [older.name, newer.name]
    rows = {s.name: s.oldest_parked for s in response.context["cl"].result_list}
    assert 150 <= rows[older.name].total_seconds() < 210
    assert 90 <= rows[newer.name].total_seconds() < 150
    assert rows[idle.name] is None
    assert "2\xa0minutes" in response.content.decode()  # timesince's non-breaking space
    page = viewer.get(reverse("admin:django_semaphore_semaphore_change", args=[older.pk]))
    assert "Oldest parked" in page.content.decode()
    assert "2\xa0minutes" in page.content.decode()

    out = StringIO()
    call_command("semaphore_status", older.name, idle.name, stdout=out)
    table, *queues = out.getvalue().split("\n\n")
    header, *lines = table.splitlines()
    assert header.split()[-2:] == ["oldest", "parked"]
    last = {line.split()[0]: line.split()[-1] for line in lines}
    assert f"Waiting in line on {older.name}" in queues[0]
    assert "parked tests.parked" in queues[0]  # the parked tasks, in their place
    assert 150 <= float(last[older.name].rstrip("s")) < 210
    assert last[idle.name] == "-"

    scraped = client.get("/metrics/").content.decode()
    gauge = "django_semaphore_oldest_parked_seconds"
    assert 150 <= sample_of(scraped, gauge, older.name) < 210
    assert 90 <= sample_of(scraped, gauge, newer.name) < 150
    assert sample_of(scraped, gauge, idle.name) == 0


def sample_of(exposition: str, metric: str, semaphore: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return next(
        sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == metric and sample.labels == {"semaphore": semaphore}
    )


def test_the_oldest_parked_task_is_read_from_the_index_not_every_parked_row():
    s = semaphore(1)
    for _ in range(3):
        park_row({s.name: 1})

    with CaptureQueriesContext(connection) as queries:
        row = parking.with_parked(Semaphore.objects.filter(pk=s.pk)).get()

    assert (row.parked, len(queries)) == (3, 1)
    assert "LIMIT 1" in queries[0]["sql"].upper()
