"""Why a waiter waits: ``blockers.why_waiting``, ``semaphore_status --why``
and the admin's answer, for fair waiters, parked tasks and rate limits."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse
from django.utils import timezone

from django_semaphore import acquire
from django_semaphore.blockers import why_waiting
from django_semaphore.models import ParkedTask, Semaphore, Ticket
from tests.conftest import unique
from tests.test_admin import semaphore_url, staff
from tests.test_parked import park_row

pytestmark = pytest.mark.django_db(transaction=True)


def ticket(semaphore: Semaphore, key: str, *, count: int = 1, lacked: bool = True) -> Ticket:
    now = timezone.now()
    return Ticket.objects.create(
        semaphore=semaphore,
        external_id=key,
        owner=f"waiter {key}",
        count=count,
        lacked=lacked,
        created_at=now,
        expires_at=now + timedelta(minutes=5),
    )


@pytest.fixture
def full(make_semaphore) -> Semaphore:
    """Capacity 2, both held: one under a lease, one without."""
    semaphore = make_semaphore(2, name=unique("exports"))
    acquire(semaphore.name, external_id="holder-1", owner="web-1", ttl=60)
    acquire(semaphore.name, external_id="holder-2", owner="web-2")
    return semaphore


def test_a_fair_waiter_is_told_what_lacks_room_who_holds_it_and_who_is_ahead(full, make_semaphore):
    free = make_semaphore(2, name=unique("network"))
    ticket(full, "older")
    ticket(full, "mine")
    ticket(free, "mine", lacked=False)

    waiting = why_waiting("mine")

    assert waiting is not None
    assert (waiting.key, waiting.waiter, waiting.task_id) == ("mine", "waiter mine", "")
    lacking, other = waiting.blockers
    assert (lacking.semaphore, other.semaphore) == (full.name, free.name)
    assert waiting.lacking == [lacking]
    assert (lacking.wants, lacking.limit.capacity, lacking.in_use) == (1, 2, 2)
    assert (lacking.kept, lacking.older, lacking.older_named) == (1, 1, ["waiter older"])
    assert [holder.key for holder in lacking.holders] == ["holder-1", "holder-2"]
    assert [holder.owner for holder in lacking.holders] == ["web-1", "web-2"]
    assert lacking.holders[0].expires_at is not None
    assert lacking.holders[1].expires_at is None
    assert (lacking.held_by, lacking.room, lacking.next_slot) == (2, 0, None)
    assert (other.room, other.lacks_room, other.holders) == (2, False, [])


def test_a_younger_waiter_is_not_ahead_and_an_older_one_that_had_room_keeps_none(full):
    ticket(full, "had-room", lacked=False)  # older, but never lacked room: keeps nothing
    ticket(full, "mine")
    ticket(full, "younger")

    [blocker] = why_waiting("mine").blockers

    assert (blocker.kept, blocker.older) == (0, 0)


def test_a_parked_task_is_found_by_its_task_id(full):
    task_id = park_row({full.name: 1})
    key = f"{task_id}~2"
    # Its permit under the task id was released once: it waits under ~2.
    Ticket.objects.filter(external_id=task_id).update(external_id=key)
    ParkedTask.objects.filter(task_id=task_id).update(key=key)

    waiting = why_waiting(task_id)

    assert waiting is not None
    assert (waiting.key, waiting.task_id, waiting.woken) == (key, task_id, False)
    assert waiting.waiter == "parked tests.parked"
    assert waiting.lacking[0].semaphore == full.name


def test_a_rate_limit_says_when_its_next_slot_opens():
    rated = Semaphore.objects.create(name=unique("rated"), capacity=1, window=60)
    acquire(rated.name, external_id="first")
    ticket(rated, "mine")

    [blocker] = why_waiting("mine").blockers

    assert (blocker.in_use, blocker.limit.window, blocker.lacks_room) == (1, 60, True)
    assert blocker.next_slot is not None
    assert timedelta(seconds=55) < blocker.next_slot - timezone.now() <= timedelta(seconds=60)


def test_nobody_waits_under_an_unknown_or_expired_key(full):
    gone = ticket(full, "gone")
    Ticket.objects.filter(pk=gone.pk).update(expires_at=timezone.now() - timedelta(seconds=1))

    assert why_waiting("gone") is None
    assert why_waiting("never-waited") is None


def test_the_status_command_says_why(full):
    ticket(full, "older")
    ticket(full, "mine")
    out = StringIO()

    call_command("semaphore_status", "--why", "mine", stdout=out)

    text = out.getvalue()
    assert text.startswith("mine waits: waiter mine, since ")
    summary = f"  {full.name}: lacks room: wants 1, 2 of 2 in use, 1 kept for 1 waiter(s) ahead"
    assert summary in text
    assert "    waiters ahead: waiter older\n" in text
    assert "    held by web-1 (holder-1): 1 since " in text
    assert "held by web-2 (holder-2): 1 since " in text
    assert "lease until never" in text
    with pytest.raises(CommandError, match="Nobody waits under 'nobody'"):
        call_command("semaphore_status", "--why", "nobody", stdout=StringIO())


def test_a_parked_tasks_admin_page_says_why_it_waits(client, full):
    task_id = park_row({full.name: 1})
    client.force_login(staff("view_parkedtask"))

    parked = ParkedTask.objects.get(task_id=task_id)
    html = client.get(reverse("admin:django_semaphore_parkedtask_change", args=[parked.pk]))
    text = html.content.decode()

    assert html.status_code == 200
    assert f"<strong>{full.name}: lacks room: wants 1, 2 of 2 in use" in text
    assert "held by web-1 (holder-1): 1 since " in text
    Ticket.objects.filter(external_id=task_id).update(expires_at=timezone.now())  # expired
    text = client.get(
        reverse("admin:django_semaphore_parkedtask_change", args=[parked.pk])
    ).content.decode()
    assert "It no longer waits in line" in text


def test_the_semaphores_queue_says_who_has_room_there_and_links_parked_tasks(
    client, make_semaphore
):
    semaphore = make_semaphore(2)
    acquire(semaphore.name, external_id="holder", owner="web-1")
    ticket(semaphore, "first")  # lacked: keeps the one permit left
    task_id = park_row({semaphore.name: 1})
    client.force_login(staff("view_semaphore", "view_parkedtask"))

    text = client.get(semaphore_url(semaphore)).content.decode()

    rows = text.split('class="waiter"')[1:]
    assert 'class="has-room"' in rows[0]
    assert 'class="lacks-room"' in rows[1]
    assert "lacks room (0 free for it)" in rows[1]
    parked = ParkedTask.objects.get(task_id=task_id)
    assert reverse("admin:django_semaphore_parkedtask_change", args=[parked.pk]) in rows[1]
