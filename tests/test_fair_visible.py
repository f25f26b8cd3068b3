"""Fair waiters are visible: admin changelist and page, status command, and
dead tickets are swept."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_semaphore import sweep
from django_semaphore.models import Semaphore, Ticket
from tests.conftest import unique
from tests.test_admin import SEMAPHORES, semaphore_url, staff

pytestmark = pytest.mark.django_db


def queue(sem: Semaphore, *waits: float, dead: int = 0) -> list[Ticket]:
    """Live tickets that have waited ``waits`` seconds, and ``dead`` expired ones."""
    now = timezone.now()
    tickets = [
        Ticket.objects.create(
            semaphore=sem,
            external_id=unique("key"),
            owner=f"waiter {i}",
            count=i + 1,
            created_at=now - timedelta(seconds=wait),
            expires_at=now + timedelta(minutes=5),
        )
        for i, wait in enumerate(waits)
    ]
    for _ in range(dead):
        Ticket.objects.create(
            semaphore=sem,
            external_id=unique("dead"),
            created_at=now - timedelta(hours=2),
            expires_at=now - timedelta(hours=1),
        )
    return tickets


@pytest.fixture
def operator(client):
    client.force_login(staff("view_semaphore", "change_semaphore"))
    return client


def test_with_usage_counts_live_tickets_only(make_semaphore):
    busy, idle = make_semaphore(2), make_semaphore(2)
    queue(busy, 30, 5, dead=2)
    queue(idle, dead=1)
    rows = {s.pk: s for s in Semaphore.objects.with_usage().filter(pk__in=[busy.pk, idle.pk])}
    assert rows[busy.pk].waiters == 2
    assert timedelta(seconds=30) <= rows[busy.pk].longest_wait < timedelta(seconds=40)
    assert (rows[idle.pk].waiters, rows[idle.pk].longest_wait) == (0, None)


def test_changelist_shows_waiters_and_longest_wait_in_its_one_query(operator, make_semaphore):
    prefix = unique("queued")
    semaphores = [make_semaphore(1, name=f"{prefix}-{i}") for i in range(3)]
    queue(semaphores[0], 90, 10, dead=1)

    with CaptureQueriesContext(connection) as captured:
        response = operator.get(SEMAPHORES, {"q": prefix})
    assert response.status_code == 200
    rows = {row.pk: row for row in response.context["cl"].result_list}
    assert rows[semaphores[0].pk].waiters == 2
    assert rows[semaphores[1].pk].waiters == 0
    # The longest wait, 90 s, as timesince says it.
    assert 'field-longest_wait">1\xa0minute<' in response.content.decode()
    ticket_queries = [q["sql"] for q in captured.captured_queries if "_ticket" in q["sql"]]
    assert len(ticket_queries) == 1


def test_change_page_lists_the_queue_in_order(operator, make_semaphore):
    sem = make_semaphore(1)
    first, second = queue(sem, 60, 3, dead=1)
    html = operator.get(semaphore_url(sem)).content.decode()
    assert "Waiting in line (2)" in html
    assert html.index(first.external_id) < html.index(second.external_id)
    assert "waiter 0" in html
    assert "dead-" not in html


def test_status_prints_waiters_and_each_queue(make_semaphore):
    sem = make_semaphore(1)
    first, second = queue(sem, 42, 1, dead=1)
    out = StringIO()
    call_command("semaphore_status", sem.name, stdout=out)
    lines = out.getvalue().splitlines()
    row = lines[1].split()
    assert row[0] == sem.name
    # ... waiters, longest wait, parked tasks, oldest parked
    assert row[-4] == "2"
    assert 42 <= float(row[-3].rstrip("s")) < 60
    assert f"Waiting in line on {sem.name}, first served first:" in lines
    # place, owner ("waiter n"), key, count, since, expires at
    places = [line.split() for line in lines[lines.index("") + 3 :]]
    assert [(p[0], p[3], p[4]) for p in places] == [
        ("1", first.external_id, "1"),
        ("2", second.external_id, "2"),
    ]


def test_sweep_deletes_dead_tickets_only(make_semaphore):
    sem = make_semaphore(1)
    live = queue(sem, 1, dead=3)
    assert sweep.clean_tickets(dry_run=True).deleted == 3
    report = sweep.clean_tickets(batch_size=2)
    assert (report.deleted, report.batches) == (3, 2)
    assert list(Ticket.objects.filter(semaphore=sem)) == live
    out = StringIO()
    queue(sem, dead=1)
    call_command("semaphore_sweep", "--orphans", stdout=out)
    assert "Dead tickets: deleted 1 in 1 batches." in out.getvalue()
