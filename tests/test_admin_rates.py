"""Rate limits (windowed semaphores) in the admin, through Django's test
client with real users and permissions: the list's rate and grants in the
window, the page's next slot, chart and history, and the window edited
through ``set_window``."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.urls import reverse

from django_semaphore import acquire, release, set_capacity, set_window
from django_semaphore.admin.chart import describe
from django_semaphore.limits import Limit
from django_semaphore.models import CapacityChange, Semaphore
from django_semaphore.utilization import CapacityMark, Span, build_utilization
from django_semaphore.validation import parse_rate
from tests.conftest import unique
from tests.test_admin import HISTORY, SEMAPHORES, VIEW_ALL, semaphore_url, staff

pytestmark = pytest.mark.django_db(transaction=True)


def rate_limit(capacity: int, window: int) -> Semaphore:
    semaphore = Semaphore.objects.create(name=unique("rate"), capacity=capacity)
    set_window(semaphore.name, window)
    return semaphore


def grant(sem: Semaphore, count: int = 1, *, released: bool = False) -> None:
    request = acquire({sem.name: count}, external_id=unique("key"))
    if released:
        release(request.external_id)


def limits_form(capacity: int, window: int | None, reason: str = "") -> dict[str, str]:
    return {
        "capacity": str(capacity),
        "window": "" if window is None else str(window),
        "reason": reason,
    }


@pytest.mark.parametrize(
    ("capacity", "window", "text"),
    [
        (100, 1, "100/s"),
        (5, 60, "5/min"),
        (3, 10, "3/10s"),
        (1000, 7200, "1000/2h"),
        (7, 90, "7/90s"),
    ],
)
def test_a_rate_reads_in_its_largest_whole_unit(capacity, window, text):
    assert str(Limit(capacity, window)) == text
    assert parse_rate(text) == (capacity, window)


def test_the_list_shows_the_rate_and_the_grants_in_the_window(client, make_semaphore):
    client.force_login(staff(*VIEW_ALL))
    sem = rate_limit(5, 60)
    grant(sem, 2, released=True)  # released, still counted in its window
    grant(sem)
    plain = make_semaphore(capacity=4, name=f"{sem.name}-plain")
    grant(plain, 2)

    response = client.get(SEMAPHORES, {"q": sem.name})

    rows = {row.name: row for row in response.context["cl"].result_list}
    assert (rows[sem.name].in_use, rows[plain.name].in_use) == (3, 2)
    html = response.content.decode()
    assert '<td class="field-rate">5/min</td>' in html
    assert '<td class="field-rate">-</td>' in html  # a plain semaphore has no rate
    assert "3 in window" in html
    assert '<td class="field-in_use">2</td>' in html
    assert "60%" in html  # 3 of 5 slots of the window


def test_idle_means_nothing_granted_in_the_window(client, make_semaphore):
    client.force_login(staff(*VIEW_ALL))
    used, idle = rate_limit(5, 60), rate_limit(5, 60)
    grant(used, released=True)

    response = client.get(SEMAPHORES, {"q": "rate-", "usage": "idle"})

    names = {row.name for row in response.context["cl"].result_list}
    assert idle.name in names
    assert used.name not in names


def test_the_page_shows_the_grants_in_the_window_and_the_next_slot(client):
    client.force_login(staff(*VIEW_ALL))
    sem = rate_limit(2, 60)
    grant(sem, released=True)
    grant(sem)

    response = client.get(semaphore_url(sem))

    assert response.status_code == 200
    html = response.content.decode()
    assert "2 in window" in html
    # Full: the first slot ends a minute after its grant, by the database's clock.
    # (timesince writes "1 minute" with a no-break space)
    assert re.search(
        r'Next slot:</label>\s*<div class="readonly">in (1\xa0minute|5\d seconds)<', html
    )
    assert "now 2 of 2." in html  # the chart plots the grants in the window
    assert "in window" in response.context["utilization_chart"]


def test_with_room_the_next_slot_is_now(client):
    client.force_login(staff(*VIEW_ALL))
    sem = rate_limit(3, 60)
    grant(sem)

    html = client.get(semaphore_url(sem)).content.decode()

    assert '<div class="readonly">now</div>' in html


def test_a_plain_semaphore_has_no_next_slot(client, make_semaphore):
    client.force_login(staff(*VIEW_ALL))
    sem = make_semaphore(capacity=2)

    html = client.get(semaphore_url(sem)).content.decode()

    assert "Next slot" not in html


def test_the_window_change_goes_through_set_window_with_user_and_reason(client):
    user = staff("view_semaphore", "change_semaphore", "view_capacitychange")
    client.force_login(user)
    sem = rate_limit(5, 60)
    assert client.get(semaphore_url(sem)).context["adminform"].form.initial["window"] == 60

    response = client.post(semaphore_url(sem), limits_form(5, 1, "burst per second"))

    assert response.status_code == 302, response.context["adminform"].form.errors
    sem.refresh_from_db()
    assert (sem.capacity, sem.window) == (5, 1)
    change = CapacityChange.objects.filter(semaphore=sem).latest("id")
    assert (change.old_capacity, change.new_capacity) == (5, 5)
    assert (change.old_window, change.new_window) == (60, 1)
    assert change.changed_by == user
    assert change.reason == "burst per second"
    assert LogEntry.objects.filter(user=user, object_id=str(sem.pk), action_flag=CHANGE).exists()
    # Shown as old → new rate, on the page and in the history list.
    assert "5/min → 5/s" in client.get(semaphore_url(sem)).content.decode()
    assert "5/min → 5/s" in client.get(HISTORY, {"semaphore__id__exact": sem.pk}).content.decode()


def test_a_window_set_and_removed_from_the_form(client, make_semaphore):
    client.force_login(staff("view_semaphore", "change_semaphore"))
    sem = make_semaphore(capacity=3)

    assert client.post(semaphore_url(sem), limits_form(3, 10, "throttle")).status_code == 302
    assert Semaphore.objects.get(pk=sem.pk).window == 10
    assert client.post(semaphore_url(sem), limits_form(3, None, "unthrottle")).status_code == 302

    assert Semaphore.objects.get(pk=sem.pk).window is None
    changes = CapacityChange.objects.filter(semaphore=sem).order_by("id")
    assert [(c.old_window, c.new_window, c.reason) for c in changes] == [
        (None, 10, "throttle"),
        (10, None, "unthrottle"),
    ]
    history = client.get(semaphore_url(sem)).context["history"]
    assert [row["change"] for row in history] == ["3/10s → 3", "3 → 3/10s"]


def test_capacity_and_window_changed_together_are_one_record(client):
    client.force_login(staff("view_semaphore", "change_semaphore"))
    sem = rate_limit(5, 60)

    response = client.post(semaphore_url(sem), limits_form(10, 1, "new plan"))

    assert response.status_code == 302
    changes = CapacityChange.objects.filter(semaphore=sem, reason="new plan").order_by("id")
    assert [(c.old_capacity, c.new_capacity, c.old_window, c.new_window) for c in changes] == [
        (5, 10, 60, 1),
    ]


@pytest.mark.parametrize("window", ["0", "86401", "a minute"])
def test_an_invalid_window_is_a_form_error(client, window):
    client.force_login(staff("view_semaphore", "change_semaphore"))
    sem = rate_limit(5, 60)

    response = client.post(semaphore_url(sem), {"capacity": "5", "window": window, "reason": ""})

    assert response.status_code == 200
    assert "window" in response.context["adminform"].form.errors
    assert Semaphore.objects.get(pk=sem.pk).window == 60


def test_a_reason_without_a_change_is_refused(client):
    client.force_login(staff("view_semaphore", "change_semaphore"))
    sem = rate_limit(5, 60)

    response = client.post(semaphore_url(sem), limits_form(5, 60, "no-op"))

    assert response.status_code == 200
    assert "reason" in response.context["adminform"].form.errors
    assert CapacityChange.objects.filter(semaphore=sem).count() == 1  # the set_window above


def test_staff_without_change_permission_cannot_change_the_window(client):
    client.force_login(staff(*VIEW_ALL))
    sem = rate_limit(5, 60)

    page = client.get(semaphore_url(sem)).content.decode()
    response = client.post(semaphore_url(sem), limits_form(5, 1, "nope"))

    assert 'name="window"' not in page
    # Shown as a read-only value in its row (its label and help come first).
    row = page.split('class="form-row field-window"')[1].split('class="form-row')[0]
    assert re.search(r'<div class="readonly">\s*60\s*</div>', row)
    assert response.status_code == 403
    assert Semaphore.objects.get(pk=sem.pk).window == 60
    assert CapacityChange.objects.filter(semaphore=sem).count() == 1


def test_a_rate_limit_is_added_with_its_window_and_no_history(client):
    client.force_login(staff("view_semaphore", "add_semaphore"))
    name = unique("rate")

    response = client.post(
        reverse("admin:django_semaphore_semaphore_add"),
        {"name": name, "capacity": "5", "window": "60"},
    )

    assert response.status_code == 302
    sem = Semaphore.objects.get(name=name)
    assert (sem.capacity, sem.window) == (5, 60)
    assert not CapacityChange.objects.filter(semaphore=sem).exists()


def test_the_chart_marks_window_changes(client):
    client.force_login(staff(*VIEW_ALL))
    sem = rate_limit(5, 60)
    set_capacity(sem.name, 6)

    chart = client.get(semaphore_url(sem)).context["utilization_chart"]

    assert "capacity 5 → 5/min" in chart
    assert "capacity 5/min → 6/min" in chart


def test_the_chart_counts_holders_while_plain_and_slots_while_a_rate_limit():
    start = datetime(2026, 1, 1, tzinfo=UTC)
    hour = timedelta(hours=1)
    held = Span(2, start + hour, None)  # held since 01:00, still held
    slot = Span(1, start + 3 * hour, start + 3 * hour + timedelta(minutes=1), slot=True)
    windowed = CapacityMark(
        at=start + 2 * hour, old=Limit(5), new=Limit(5, 60), changed_by="", reason=""
    )

    utilization = build_utilization(
        [held, slot], 5, [windowed], start, start + 24 * hour, windowed=True
    )

    # Held counts until the window is set (then grants in the window count,
    # as in_use counts them): none after it but the one slot's minute.
    assert [(s.start.hour, s.start.minute, s.in_use) for s in utilization.segments] == [
        (0, 0, 0),
        (1, 0, 2),
        (2, 0, 0),
        (3, 0, 1),
        (3, 1, 0),
    ]
    assert "now 0 of 5" in describe(utilization)
