"""Who may wait: ``holds_permit``'s ``on_conflict`` and ``max_waiting``
decided when a ``PermitTask`` is sent (``parking.admission``), in one
transaction under the semaphores' row locks.

The first part checks the decisions with the publish recorded instead of
sent, so every rule can fail on its own; the second runs a real prefork
worker on Redis, with the peers' bug reports as scenarios.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery.result import AsyncResult
from django.conf import settings
from django.db import connections
from django.urls import reverse
from django.utils import timezone

from django_semaphore import acquire, holds_permit, parking, release, sweep
from django_semaphore.blockers import why_waiting
from django_semaphore.exceptions import InvalidRequest, LineFull, SemaphoreExhausted
from django_semaphore.models import ParkedTask, PermitRequest, Semaphore, Ticket
from django_semaphore.owners import TaskOwner
from django_semaphore.parking import deferred, wake
from django_semaphore.states import ReleaseReason, State
from tests import own_tasks, tasks
from tests.celery_app import app
from tests.conftest import unique
from tests.test_admin import staff
from tests.test_django_tasks import db_workers, finished, run_here
from tests.test_parked import eventually, parked_ids, settled
from tests.testapp.models import RunLog

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def once(db: Any) -> Semaphore:
    return Semaphore.objects.create(name=tasks.ONCE, capacity=1)


@pytest.fixture
def latest(db: Any) -> Semaphore:
    return Semaphore.objects.create(name=tasks.LATEST, capacity=1)


def woken() -> list[str]:
    return list(
        ParkedTask.objects.filter(woken_at__isnull=False)
        .order_by("id")
        .values_list("task_id", flat=True)
    )


# --- the decisions, the publish recorded ------------------------------------------


def test_a_task_that_fits_is_sent_and_keeps_its_room_until_it_runs(once, published):
    first = tasks.once.delay("a", 0)

    assert published == [first.id]
    assert woken() == [first.id]
    # Its ticket keeps the room: a plain grant now finds none.
    ticket = Ticket.objects.get(external_id=first.id)
    assert ticket.lacked
    with pytest.raises(Exception, match="celery-once"):
        acquire(tasks.ONCE, external_id="a-view")


def test_a_second_send_is_discarded_and_told_the_first(once, published):
    first = tasks.once.delay("a", 0)

    second = tasks.once.delay("b", 0)

    assert second.id == first.id
    assert published == [first.id]
    assert parked_ids() == [first.id]


def test_a_send_while_a_task_holds_is_told_the_holder(once, published):
    holder = TaskOwner("some-task-id", "tests.tasks.once", "worker@host", 4242)
    acquire(tasks.ONCE, external_id="some-task-id~2", owner=str(holder))

    result = tasks.once.delay("a", 0)

    assert result.id == "some-task-id"
    assert published == []
    assert parked_ids() == []


def test_a_send_no_task_can_be_named_for_is_refused(once, published):
    """A view holds the permit: no task to hand the caller, so the discard
    says so with ``SemaphoreExhausted``; nothing is written."""
    acquire(tasks.ONCE, external_id="a-view-request")

    with pytest.raises(SemaphoreExhausted, match="Discarded: no room on celery-once"):
        tasks.once.delay("a", 0)

    assert published == []
    assert parked_ids() == []


def test_a_full_rate_limit_discards_until_its_window_moves_on(published):
    Semaphore.objects.create(name=tasks.ONCE, capacity=1, window=60)
    first = tasks.once.delay("a", 0)
    acquire(tasks.ONCE, external_id=first.id, owner="a run")  # as its run would
    parking.started(first.id, {tasks.ONCE: 1})
    release(first.id)  # done: its slot counts for a minute still
    assert Ticket.objects.count() == 0

    with pytest.raises(SemaphoreExhausted):
        tasks.once.delay("b", 0)


def test_computed_names_discard_per_key(once, published):
    for customer in (1, 2):
        Semaphore.objects.create(name=f"{tasks.ONCE}:{customer}", capacity=1)

    sent = [tasks.once_per_customer.delay(customer, 0) for customer in (1, 2, 1, 2)]

    assert sent[2].id == sent[0].id
    assert sent[3].id == sent[1].id
    assert published == [sent[0].id, sent[1].id]


def test_a_family_member_is_created_when_first_sent(published):
    member = unique("member")

    first = tasks.once_per_member.delay(member)
    second = tasks.once_per_member.delay(member)

    assert Semaphore.objects.get(name=f"celery-family:{member}").capacity == 1
    assert second.id == first.id
    assert published == [first.id]


def test_an_expired_holder_does_not_discard(once, published):
    """Solid Queue #804: jobs piled up behind a semaphore nobody held any
    more. A holder whose lease lapsed is reclaimed by the send itself."""
    acquire(tasks.ONCE, external_id="dead-worker", ttl=1)
    PermitRequest.objects.filter(external_id="dead-worker").update(
        expires_at=PermitRequest.objects.get(external_id="dead-worker").created_at
    )

    result = tasks.once.delay("a", 0)

    assert published == [result.id]
    dead = PermitRequest.objects.get(external_id="dead-worker")
    assert dead.state == State.RELEASED
    assert dead.release_reason == ReleaseReason.EXPIRED


def test_replace_keeps_only_the_latest_waiting(latest, published):
    acquire(tasks.LATEST, external_id="held-by-the-test")

    sent = [tasks.latest.delay(label, 0) for label in ("a", "b", "c")]

    assert [r.id for r in sent] == [s.id for s in sent]  # each told its own id
    assert parked_ids() == [sent[2].id]
    assert published == []
    assert {sent[0].state, sent[1].state} == {"REVOKED"}
    assert Ticket.objects.filter(external_id__in=[sent[0].id, sent[1].id]).count() == 0


def test_replace_leaves_a_task_already_sent(latest, published):
    first = tasks.latest.delay("a", 0)  # fits: sent

    second = tasks.latest.delay("b", 0)

    assert published == [first.id]
    assert parked_ids() == [first.id, second.id]
    assert woken() == [first.id]


def test_max_waiting_refuses_the_send(latest, published):
    acquire(tasks.LATEST, external_id="held-by-the-test")
    tasks.at_most_two_wait.delay("a", 0)
    tasks.at_most_two_wait.delay("b", 0)

    with pytest.raises(LineFull):
        tasks.at_most_two_wait.delay("c", 0)

    assert len(parked_ids()) == 2


def test_a_celery_tasks_computed_priority_puts_it_ahead_in_line(latest, published):
    acquire(tasks.LATEST, external_id="held-by-the-test")
    low = [tasks.urgent_first.delay(label, False) for label in "ab"]
    urgent = tasks.urgent_first.delay("c", True)

    assert Ticket.objects.get(external_id=urgent.id).priority == 80
    release("held-by-the-test")
    wake.wake("default", [latest.pk])
    assert published == [urgent.id]
    assert parked_ids() == [*(task.id for task in low), urgent.id]


def test_a_celery_tasks_share_key_takes_its_turn_and_max_waiting_counts_per_key(latest, published):
    acquire(tasks.LATEST, external_id="held-by-the-test")
    a = [tasks.per_customer.delay("a", label) for label in ("a1", "a2")]
    with pytest.raises(LineFull, match="2 tasks of share 'a' already wait parked on"):
        tasks.per_customer.delay("a", "a3")
    b = tasks.per_customer.delay("b", "b1")

    line = Ticket.objects.filter(semaphore=latest).in_line()
    assert list(line.values_list("external_id", "share")) == [
        (a[0].id, "a"),
        (b.id, "b"),
        (a[1].id, "a"),
    ]
    release("held-by-the-test")
    wake.wake("default", [latest.pk])
    assert published == [a[0].id]


def test_max_waiting_counts_the_tasks_that_wait_not_the_one_sent(latest, published):
    sent = tasks.at_most_two_wait.delay("a", 0)  # fits: sent, its room kept until it runs
    waiting = [tasks.at_most_two_wait.delay(label, 0) for label in "bc"]

    with pytest.raises(LineFull) as refused:
        tasks.at_most_two_wait.delay("d", 0)

    assert str(refused.value) == f"2 tasks already wait parked on {tasks.LATEST}."
    assert published == [sent.id]
    assert parked_ids() == [sent.id, *(task.id for task in waiting)]


def test_a_delayed_task_already_sent_counts(once, published):
    """Solid Queue #597: discard did not see a delayed job already enqueued,
    so duplicates ran. Here the room is kept from the send, countdown or not."""
    delayed = tasks.once.apply_async(("later", 0), countdown=3600)

    again = tasks.once.delay("now", 0)

    assert again.id == delayed.id
    assert published == [delayed.id]


def test_sends_at_once_never_both_pass(once, published):
    """Twelve threads, each on its own connection, send at once: one is
    sent, the others are told its id."""
    barrier = threading.Barrier(12)
    ids: list[str] = []

    def send() -> None:
        try:
            barrier.wait(timeout=30)
            ids.append(tasks.once.delay("race", 0).id)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=send, daemon=True) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)

    assert len(ids) == 12
    assert len(published) == 1
    assert set(ids) == set(published)
    assert parked_ids() == published


def test_eager_tasks_are_sent_as_celery_sends_them(once, published):
    app.conf.task_always_eager = True
    try:
        result = tasks.once.delay("eager", 0)
    finally:
        app.conf.task_always_eager = False

    assert result.successful(), result.traceback
    assert published == []
    assert parked_ids() == []


@pytest.fixture
def debounced(db: Any) -> Semaphore:
    return Semaphore.objects.create(name=tasks.DEBOUNCED, capacity=1)


@pytest.fixture
def woken_later(monkeypatch) -> list[tuple[list[int], float]]:
    """The wake-ups a debounced send publishes for later, recorded instead."""
    later: list[tuple[list[int], float]] = []
    monkeypatch.setattr(wake, "wake_later", lambda alias, ids, s: later.append((sorted(ids), s)))
    return later


def test_sends_within_the_window_collapse_into_the_first(debounced, published, woken_later):
    first = tasks.debounced.delay("a", 0)
    again = [tasks.debounced.delay(label, 0) for label in ("b", "c")]

    assert [r.id for r in again] == [first.id, first.id]
    assert parked_ids() == [first.id]
    assert woken_later == [([debounced.pk], 1.0)]
    # Room, but its window is open: nothing is sent yet.
    wake.wake("default", [debounced.pk])
    assert published == []

    time.sleep(1.1)
    wake.wake("default", [debounced.pk])
    assert published == [first.id]


def test_why_says_a_debounced_task_waits_for_its_window(debounced, published, woken_later):
    first = tasks.debounced.delay("a", 0)

    waiting = why_waiting(first.id)

    assert waiting is not None
    assert waiting.not_before is not None
    assert f"  Debounced: not woken before {waiting.not_before:%Y-%m-%dT%H:%M:%S}" in "\n".join(
        waiting.explained()
    )


def test_a_debounced_tasks_admin_page_says_until_when(debounced, published, woken_later, client):
    first = tasks.debounced.delay("a", 0)
    client.force_login(staff("view_parkedtask"))
    parked = ParkedTask.objects.get(task_id=first.id)

    page = client.get(reverse("admin:django_semaphore_parkedtask_change", args=[parked.pk]))

    assert page.status_code == 200
    moment = parked.not_before.isoformat(timespec="seconds")
    assert f"Debounced: not woken before {moment}." in page.content.decode()


def test_a_send_after_the_burst_went_out_starts_another(debounced, published, woken_later):
    first = tasks.debounced.delay("a", 0)
    time.sleep(1.1)
    wake.wake("default", [debounced.pk])

    second = tasks.debounced.delay("b", 0)

    assert second.id != first.id
    assert parked_ids() == [first.id, second.id]
    assert published == [first.id]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"on_conflict": "skip"}, "on_conflict must be"),
        ({"on_conflict": "discard", "park": False}, "park=False"),
        ({"debounce": 1, "park": False}, "park=False"),
        ({"debounce": 1, "on_conflict": "replace"}, "takes no on_conflict"),
        ({"debounce": 0}, "debounce must be positive"),
        ({"debounce": "1s"}, "debounce"),
    ],
)
def test_a_bad_policy_is_refused_when_decorating(options, message):
    with pytest.raises(InvalidRequest, match=message):
        holds_permit("x", **options)


def test_on_conflict_without_its_task_class_fails_the_run(once):
    result = tasks.discards_without_its_class.apply()

    assert isinstance(result.result, InvalidRequest)
    assert "PermitTask" in str(result.result)


# --- Django's own tasks: django-tasks-db's backend ---------------------------------


@pytest.fixture
def django_once(db: Any) -> Semaphore:
    return Semaphore.objects.create(name=own_tasks.ONCE, capacity=1)


def result_rows() -> list[tuple[str, str, Any]]:
    from django_tasks_db.models import DBTaskResult

    rows = DBTaskResult.objects.order_by("enqueued_at")
    return [(str(id), *rest) for id, *rest in rows.values_list("id", "status", "run_after")]


def test_a_django_task_sent_twice_is_discarded_and_rolled_back(django_once, published):
    first = own_tasks.once.enqueue("a")

    second = own_tasks.once.enqueue("b")

    assert second.id == first.id
    assert [(id, status) for id, status, _ in result_rows()] == [(first.id, "READY")]
    assert woken() == [first.id]
    assert published == [first.id]  # resumed: it runs now


def test_a_django_task_that_waits_is_deferred_until_woken(django_once, published):
    acquire(own_tasks.ONCE, external_id="held-by-the-test")
    result = own_tasks.latest.enqueue("a")

    [(_, status, run_after)] = result_rows()
    assert status == "READY"
    assert run_after == deferred.PARKED_UNTIL
    assert parked_ids() == [result.id]

    release("held-by-the-test")
    wake.wake("default", [django_once.pk])
    assert published == [result.id]


def test_a_waiting_django_task_stands_in_line_at_its_own_priority(django_once, published):
    from tests.test_parked import park_row

    acquire(own_tasks.ONCE, external_id="held-by-the-test")
    low = park_row({own_tasks.ONCE: 1})
    urgent = own_tasks.latest.using(priority=60).enqueue("urgent")

    assert dict(Ticket.objects.values_list("external_id", "priority")) == {low: 0, urgent.id: 60}
    release("held-by-the-test")
    wake.wake("default", [django_once.pk])
    assert published == [urgent.id]


def test_a_waiting_django_task_takes_its_share_keys_turn(django_once, published):
    acquire(own_tasks.ONCE, external_id="held-by-the-test")
    sent = [own_tasks.shared_by_customers.enqueue(label) for label in ("a1", "a2", "b1")]

    line = Ticket.objects.filter(semaphore=django_once).in_line()
    assert list(line.values_list("external_id", "share")) == [
        (sent[0].id, "a"),
        (sent[2].id, "b"),
        (sent[1].id, "a"),
    ]
    release("held-by-the-test")
    wake.wake("default", [django_once.pk])
    assert published == [sent[0].id]


def test_replace_fails_the_waiting_django_tasks(django_once, published):
    acquire(own_tasks.ONCE, external_id="held-by-the-test")
    sent = [own_tasks.latest.enqueue(label) for label in ("a", "b", "c")]

    assert parked_ids() == [sent[2].id]
    for result in sent[:2]:
        result.refresh()
        assert result.status == "FAILED"
    dropped = {id: status for id, status, _ in result_rows()}
    assert dropped[sent[2].id] == "READY"


def test_a_debounced_django_task_runs_when_its_window_ends(django_once, published, woken_later):
    before = timezone.now()
    first = own_tasks.debounced.enqueue("a")
    assert own_tasks.debounced.enqueue("b").id == first.id

    [(_, status, run_after)] = result_rows()
    assert status == "READY"
    assert before + timedelta(seconds=1) <= run_after <= timezone.now() + timedelta(seconds=1)
    assert woken_later == []  # its worker takes it then: no wake-up needed
    wake.wake("default", [django_once.pk])
    assert published == []  # nor does a release's wake-up send it sooner


def test_a_django_policy_needs_its_task_class(django_once):
    result = own_tasks.discards_without_its_class.enqueue()

    result = run_here(result)

    assert result.status == "FAILED"
    assert "InvalidRequest" in result.errors[0].exception_class_path


def test_on_conflict_on_a_backend_that_cannot_defer_is_refused(django_once):
    with pytest.raises(InvalidRequest, match="need a backend that can defer"):
        own_tasks.once.using(backend="rq", queue_name=settings.RQ_QUEUE).enqueue("a")


@pytest.mark.slow
def test_a_debounced_burst_of_django_tasks_runs_once(django_once, wakes, tmp_path):
    started = time.monotonic()
    sent = [own_tasks.debounced.enqueue(label) for label in ("a", "b", "c")]
    with db_workers(1, tmp_path, batch=False, backend="permits-database") as workers:
        finished([sent[0]], workers, tmp_path)

    assert {r.id for r in sent} == {sent[0].id}
    assert sent[0].status == "SUCCESSFUL"
    assert time.monotonic() - started >= 1.0
    assert list(RunLog.objects.values_list("label", flat=True)) == ["a"]
    assert parked_ids() == []


@pytest.mark.slow
def test_one_django_task_runs_while_the_others_are_discarded(django_once, wakes, tmp_path):
    """Real db_workers: sent while the first runs, five more are told its
    id; one ran. Sent after it finished, one more runs."""
    first = own_tasks.once.enqueue("first", 1.0)
    with db_workers(2, tmp_path, batch=False, backend="permits-database") as workers:
        eventually(lambda: RunLog.objects.filter(label="first").exists(), "the first started")
        others = [own_tasks.once.enqueue("other") for _ in range(5)]
        finished([first], workers, tmp_path)
        after = own_tasks.once.enqueue("after")
        finished([after], workers, tmp_path)

    assert {r.id for r in others} == {first.id}
    assert [first.status, after.status] == ["SUCCESSFUL", "SUCCESSFUL"]
    assert list(RunLog.objects.order_by("started_at").values_list("label", flat=True)) == [
        "first",
        "after",
    ]
    assert parked_ids() == []


# --- a real worker on Redis --------------------------------------------------------


@pytest.mark.slow
def test_one_runs_while_others_are_sent_and_one_runs_after(once, celery_worker, wakes):
    first = tasks.once.delay("first", 1.0)
    others = [tasks.once.delay("other", 0) for _ in range(5)]
    assert {r.id for r in others} == {first.id}
    settled([first])

    after = tasks.once.delay("after", 0)
    settled([after])

    assert after.id != first.id
    assert [log.task_id for log in RunLog.objects.order_by("started_at")] == [first.id, after.id]
    assert parked_ids() == []
    assert not PermitRequest.objects.filter(state=State.ACQUIRED).exists()


@pytest.mark.slow
def test_its_own_retry_is_not_discarded(once, celery_worker, wakes):
    result = tasks.once_retried.delay("retried")
    settled([result])

    assert result.state == "SUCCESS", result.traceback
    assert RunLog.objects.filter(label="retried").count() == 1


@pytest.mark.slow
def test_the_replacing_task_runs_once_room_is_made(latest, celery_worker, wakes):
    acquire(tasks.LATEST, external_id="held-by-the-test")
    sent = [tasks.latest.delay(label, 0) for label in ("a", "b", "c")]

    release("held-by-the-test")
    settled([sent[2]])

    assert list(RunLog.objects.values_list("label", flat=True)) == ["c"]
    assert parked_ids() == []


@pytest.mark.slow
def test_a_capped_line_refuses_when_sent_and_the_rest_run(latest, celery_worker, wakes):
    acquire(tasks.LATEST, external_id="held-by-the-test")
    waiting = [tasks.at_most_two_wait.delay(label, 0) for label in ("a", "b")]
    for label in ("c", "d", "e"):
        with pytest.raises(LineFull):
            tasks.at_most_two_wait.delay(label, 0)

    release("held-by-the-test")
    settled(waiting)

    assert [r.state for r in waiting] == ["SUCCESS", "SUCCESS"]
    assert sorted(RunLog.objects.values_list("label", flat=True)) == ["a", "b"]
    assert parked_ids() == []


@pytest.mark.slow
def test_a_burst_runs_once_after_its_window(debounced, celery_worker, wakes):
    started = time.monotonic()
    sent = [tasks.debounced.delay(label, 0) for label in ("a", "b", "c")]
    assert {r.id for r in sent} == {sent[0].id}

    settled([sent[0]])

    assert time.monotonic() - started >= 1.0
    assert list(RunLog.objects.values_list("label", flat=True)) == ["a"]  # the first's arguments
    assert parked_ids() == []


@pytest.mark.slow
def test_a_sender_killed_between_decision_and_publish(once, celery_worker, settings):
    """SIGKILL after the decision committed, before the message went out:
    nothing is sent meanwhile (the room is kept), and the beat sweep
    publishes it: it runs once."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "SEMAPHORE_TEST_DATABASE_NAME": str(connections["default"].settings_dict["NAME"]),
    }
    child = subprocess.run(
        [sys.executable, "-c", _SEND_AND_DIE],
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    [task_id] = woken()
    assert tasks.once.delay("meanwhile", 0).id == task_id  # its room is kept

    settings.DJANGO_SEMAPHORE = {"PARKED_REPUBLISH_AFTER": timedelta(milliseconds=1)}
    assert sweep.sweep_parked().republished == 1
    settled([AsyncResult(task_id)])
    assert sweep.sweep_parked().republished == 0

    assert list(RunLog.objects.values_list("task_id", flat=True)) == [task_id]
    assert parked_ids() == []


_SEND_AND_DIE = """
import os, signal
import django
django.setup()
from django_semaphore.parking import wake
wake.publish = lambda alias, ids: os.kill(os.getpid(), signal.SIGKILL)
from tests import tasks
tasks.once.delay("killed", 0)
"""
