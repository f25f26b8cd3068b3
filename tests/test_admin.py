"""The admin through Django's test client, with real users and permissions."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_semaphore import acquire, release, set_capacity
from django_semaphore.admin.display import usage_bar
from django_semaphore.models import CapacityChange, Permit, PermitRequest, Semaphore
from django_semaphore.states import ReleaseReason, State
from tests.conftest import unique

pytestmark = pytest.mark.django_db

SEMAPHORES = reverse("admin:django_semaphore_semaphore_changelist")
REQUESTS = reverse("admin:django_semaphore_permitrequest_changelist")
HISTORY = reverse("admin:django_semaphore_capacitychange_changelist")


def semaphore_url(sem: Semaphore, view: str = "change") -> str:
    return reverse(f"admin:django_semaphore_semaphore_{view}", args=[sem.pk])


def request_url(request: PermitRequest, view: str = "change") -> str:
    return reverse(f"admin:django_semaphore_permitrequest_{view}", args=[request.pk])


def staff(*codenames: str, superuser: bool = False):
    """A staff user holding exactly these django_semaphore permissions."""
    user = get_user_model().objects.create_user(
        unique("staff"), password="pw", is_staff=True, is_superuser=superuser
    )
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="django_semaphore", codename__in=codenames
        )
    )
    assert user.user_permissions.count() == len(codenames)
    return user


VIEW_ALL = ("view_semaphore", "view_permitrequest", "view_capacitychange")


@pytest.fixture
def viewer(client):
    client.force_login(staff(*VIEW_ALL))
    return client


@pytest.fixture
def operator(client):
    """Changes capacity, views everything, but cannot force-release."""
    client.force_login(staff(*VIEW_ALL, "change_semaphore"))
    return client


@pytest.fixture
def releaser(client):
    client.force_login(staff(*VIEW_ALL, "force_release_permitrequest"))
    return client


def hold(sem: Semaphore, count: int = 1, owner: str = "worker", **kwargs) -> PermitRequest:
    return acquire({sem.name: count}, external_id=unique("key"), owner=owner, **kwargs)


def capacity_form(sem: Semaphore, capacity: int, reason: str = "") -> dict[str, str]:
    return {"capacity": str(capacity), "reason": reason}


def messages_of(response) -> list[str]:
    return [str(message) for message in get_messages(response.wsgi_request)]


# --- semaphore changelist -----------------------------------------------------------


def test_changelist_shows_usage_holders_and_last_change(viewer, make_semaphore):
    sem = make_semaphore(capacity=4)
    hold(sem, 2)
    hold(sem, 1)
    set_capacity(sem.name, 5, reason="more room")

    response = viewer.get(SEMAPHORES, {"q": sem.name})

    assert response.status_code == 200
    row = response.context["cl"].result_list.get()
    assert (row.capacity, row.in_use, row.holders) == (5, 3, 2)
    html = response.content.decode()
    assert "60%" in html
    holders_link = f"{REQUESTS}?permits__semaphore__id__exact={sem.pk}&amp;state__exact=ACQUIRED"
    assert holders_link in html
    assert f"{HISTORY}?semaphore__id__exact={sem.pk}" in html


def test_changelist_counts_come_from_one_query_for_fifty_semaphores(viewer):
    prefix = unique("many")
    semaphores = Semaphore.objects.bulk_create(
        Semaphore(name=f"{prefix}-{i:02}", capacity=3) for i in range(50)
    )
    for sem in semaphores[:10]:
        hold(sem, 2)
        set_capacity(sem.name, 1)  # over capacity, with history

    def queries(search: str) -> list[str]:
        with CaptureQueriesContext(connection) as captured:
            response = viewer.get(SEMAPHORES, {"q": search})
        assert response.status_code == 200
        return [q["sql"] for q in captured.captured_queries]

    fifty = queries(prefix)
    one = queries(semaphores[0].name)
    # Session, user, two for permissions, the filtered and the full count,
    # then the rows: as many queries for 1 row as for 50, and only the one
    # listing rows reads permits and history.
    assert len(fifty) == len(one) == 7
    row_queries = [sql for sql in fifty if "django_semaphore_permit" in sql]
    assert len(row_queries) == 1
    assert "django_semaphore_capacitychange" in row_queries[0]


def test_changelist_flags_over_capacity(viewer, make_semaphore):
    sem = make_semaphore(capacity=2)
    hold(sem, 2)
    set_capacity(sem.name, 1)

    html = viewer.get(SEMAPHORES, {"q": sem.name}).content.decode()

    assert "over-capacity" in html
    assert "over by 1" in html
    assert "200%" in html


def test_usage_bar_states():
    assert "idle" in usage_bar(0, 3)
    assert "in-use" in usage_bar(1, 3)
    assert "full" in usage_bar(3, 3)
    assert "over-capacity" in usage_bar(4, 3)
    assert "closed" in usage_bar(0, 0)
    assert "over by 2" in usage_bar(2, 0)
    assert 'width="100"' in usage_bar(9, 3)  # the fill never overflows its track


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ("idle", {"idle", "closed"}),
        ("room", {"room"}),
        ("full", {"full", "over", "closed"}),
        ("over", {"over"}),
    ],
)
def test_usage_filter(viewer, make_semaphore, usage, expected):
    prefix = unique("filter")
    sems = {
        "idle": make_semaphore(capacity=2, name=f"{prefix}-idle"),
        "room": make_semaphore(capacity=2, name=f"{prefix}-room"),
        "full": make_semaphore(capacity=2, name=f"{prefix}-full"),
        "over": make_semaphore(capacity=2, name=f"{prefix}-over"),
        "closed": make_semaphore(capacity=0, name=f"{prefix}-closed"),
    }
    hold(sems["room"])
    hold(sems["full"], 2)
    hold(sems["over"], 2)
    set_capacity(sems["over"].name, 1)

    response = viewer.get(SEMAPHORES, {"q": prefix, "usage": usage})

    names = {sem.name.removeprefix(f"{prefix}-") for sem in response.context["cl"].result_list}
    assert names == expected


def test_changelist_orders_by_utilization(viewer, make_semaphore):
    prefix = unique("order")
    half = make_semaphore(capacity=4, name=f"{prefix}-a-half")
    full = make_semaphore(capacity=1, name=f"{prefix}-b-full")
    idle = make_semaphore(capacity=9, name=f"{prefix}-c-idle")
    closed = make_semaphore(capacity=1, name=f"{prefix}-d-closed-but-held")
    hold(half, 2)
    hold(full, 1)
    hold(closed, 1)
    set_capacity(closed.name, 0)

    column = viewer.get(SEMAPHORES).context["cl"].list_display.index("utilization")
    response = viewer.get(SEMAPHORES, {"q": prefix, "o": f"-{column}"})

    assert [s.pk for s in response.context["cl"].result_list] == [
        closed.pk,
        full.pk,
        half.pk,
        idle.pk,
    ]


def test_search_by_name(viewer, make_semaphore):
    sem = make_semaphore()
    make_semaphore()
    response = viewer.get(SEMAPHORES, {"q": sem.name})
    assert [s.pk for s in response.context["cl"].result_list] == [sem.pk]


# --- semaphore page -------------------------------------------------------------------


def test_semaphore_page_shows_holders_chart_and_history(operator, make_semaphore):
    sem = make_semaphore(capacity=3)
    held = hold(sem, 2, owner="worker-7", ttl=600)
    done = hold(sem, 1, owner="finished")
    time.sleep(0.005)  # SQLite's clock counts milliseconds: a shorter hold would not show
    release(done.external_id)
    set_capacity(sem.name, 4, reason="black friday")

    response = operator.get(semaphore_url(sem))

    assert response.status_code == 200
    html = response.content.decode()
    holders = response.context["holders"]
    assert [(h["owner"], h["key"], h["count"]) for h in holders] == [
        ("worker-7", held.external_id, 2)
    ]
    assert holders[0]["fencing_token"] == held.token(sem.name)
    assert holders[0]["expires"].startswith("in 9")  # "in 9 minutes" / "in 10 minutes"
    assert request_url(held) in html
    assert "finished" not in html  # released: not a holder
    assert "<svg" in html
    assert "now 2 of 4." in html  # the chart's summary
    assert "black friday" in html
    assert response.context["history_total"] == 1
    assert 'name="reason"' in html  # the change form asks why


def test_expired_holder_is_marked(operator, make_semaphore):
    sem = make_semaphore(capacity=2)
    held = hold(sem, ttl=60)
    PermitRequest.objects.filter(pk=held.pk).update(
        expires_at=timezone.now() - timedelta(minutes=5)
    )

    holder = operator.get(semaphore_url(sem)).context["holders"][0]

    assert holder["expired"]
    assert holder["expires"].startswith("expired")


def test_semaphore_page_without_requests_permission_does_not_link_them(client, make_semaphore):
    client.force_login(staff("view_semaphore"))
    sem = make_semaphore(capacity=2)
    held = hold(sem)

    response = client.get(semaphore_url(sem))

    assert response.status_code == 200
    assert held.external_id in response.content.decode()
    assert request_url(held) not in response.content.decode()
    assert response.context["holders_url"] == ""


@pytest.mark.django_db(transaction=True)
def test_capacity_change_goes_through_the_capacity_api_with_user_and_reason(client, make_semaphore):
    user = staff("view_semaphore", "change_semaphore")
    client.force_login(user)
    sem = make_semaphore(capacity=3)
    hold(sem, 2)
    # Someone changes it from code between the operator's GET and POST: the
    # history's old value is the one read under the row lock, not the form's.
    form = client.get(semaphore_url(sem)).context["adminform"].form
    assert form.initial["capacity"] == 3
    set_capacity(sem.name, 6, reason="autoscaler")

    response = client.post(semaphore_url(sem), capacity_form(sem, 1, "draining the node"))

    assert response.status_code == 302, response.context["adminform"].form.errors
    sem.refresh_from_db()
    assert sem.capacity == 1
    change = CapacityChange.objects.filter(semaphore=sem).first()
    assert change is not None
    assert (change.old_capacity, change.new_capacity) == (6, 1)
    assert change.changed_by == user
    assert change.reason == "draining the node"
    assert LogEntry.objects.filter(user=user, object_id=str(sem.pk), action_flag=CHANGE).exists()
    # Over capacity is allowed and shown, holders keep their permits.
    row = operator_row(client, sem)
    assert (row.in_use, row.capacity) == (2, 1)


def operator_row(client, sem: Semaphore) -> Semaphore:
    return client.get(SEMAPHORES, {"q": sem.name}).context["cl"].result_list.get()


def test_reason_without_a_capacity_change_is_refused(operator, make_semaphore):
    sem = make_semaphore(capacity=3)

    response = operator.post(semaphore_url(sem), capacity_form(sem, 3, "no-op"))

    assert response.status_code == 200
    assert "reason" in response.context["adminform"].form.errors
    assert not CapacityChange.objects.filter(semaphore=sem).exists()


@pytest.mark.parametrize("capacity", ["-1", "2147483648", "many"])
def test_invalid_capacity_is_a_form_error(operator, make_semaphore, capacity):
    sem = make_semaphore(capacity=3)

    response = operator.post(semaphore_url(sem), {"capacity": capacity, "reason": ""})

    assert response.status_code == 200
    assert "capacity" in response.context["adminform"].form.errors


def test_name_is_read_only_once_created(operator, make_semaphore):
    sem = make_semaphore(capacity=3)
    operator.post(semaphore_url(sem), {"name": "renamed", "capacity": "4", "reason": ""})
    sem.refresh_from_db()
    assert (sem.name, sem.capacity) != ("renamed", 4)
    assert sem.capacity == 4


def test_add_semaphore_writes_no_history(client):
    client.force_login(staff("view_semaphore", "add_semaphore"))
    name = unique()

    response = client.post(
        reverse("admin:django_semaphore_semaphore_add"), {"name": name, "capacity": "2"}
    )

    assert response.status_code == 302
    sem = Semaphore.objects.get(name=name)
    assert sem.capacity == 2
    assert not CapacityChange.objects.filter(semaphore=sem).exists()


def test_held_semaphore_cannot_be_deleted(client, make_semaphore):
    client.force_login(staff("view_semaphore", "delete_semaphore"))
    held_sem = make_semaphore(capacity=2)
    held = hold(held_sem)
    idle_sem = make_semaphore(capacity=2)
    set_capacity(idle_sem.name, 3)  # history goes with it

    refused = client.post(semaphore_url(held_sem, "delete"), {"post": "yes"})
    deleted = client.post(semaphore_url(idle_sem, "delete"), {"post": "yes"})

    assert refused.status_code == 200
    assert held.external_id in refused.content.decode()
    assert Semaphore.objects.filter(pk=held_sem.pk).exists()
    assert deleted.status_code == 302
    assert not Semaphore.objects.filter(pk=idle_sem.pk).exists()


# --- view-only staff ----------------------------------------------------------------------


def test_view_only_staff_sees_everything(viewer, make_semaphore):
    sem = make_semaphore(capacity=2)
    held = hold(sem)
    set_capacity(sem.name, 3)
    change = CapacityChange.objects.get(semaphore=sem)

    for url in [
        SEMAPHORES,
        semaphore_url(sem),
        REQUESTS,
        request_url(held),
        HISTORY,
        reverse("admin:django_semaphore_capacitychange_change", args=[change.pk]),
    ]:
        assert viewer.get(url).status_code == 200, url
    page = viewer.get(semaphore_url(sem)).content.decode()
    assert 'name="capacity"' not in page
    assert 'name="reason"' not in page
    assert "Force-release" not in viewer.get(REQUESTS).content.decode()


def test_view_only_staff_posts_are_refused(viewer, make_semaphore):
    sem = make_semaphore(capacity=2)
    held = hold(sem)
    set_capacity(sem.name, 3)
    change = CapacityChange.objects.get(semaphore=sem)

    posts = {
        semaphore_url(sem): capacity_form(sem, 9, "nope"),
        semaphore_url(sem, "delete"): {"post": "yes"},
        reverse("admin:django_semaphore_semaphore_add"): {"name": unique(), "capacity": "1"},
        SEMAPHORES: {"action": "delete_selected", "_selected_action": [sem.pk]},
        request_url(held): {"owner": "me"},
        request_url(held, "delete"): {"post": "yes"},
        REQUESTS: {"action": "force_release", "_selected_action": [held.pk]},
        reverse("admin:django_semaphore_capacitychange_change", args=[change.pk]): {},
        reverse("admin:django_semaphore_capacitychange_delete", args=[change.pk]): {"post": "yes"},
    }
    for url, data in posts.items():
        assert viewer.post(url, data).status_code == 403, url

    sem.refresh_from_db()
    assert sem.capacity == 3
    assert PermitRequest.objects.get(pk=held.pk).state == State.ACQUIRED
    assert CapacityChange.objects.filter(semaphore=sem).count() == 1


@pytest.mark.parametrize(
    "url",
    [
        reverse("admin:django_semaphore_permitrequest_add"),
        reverse("admin:django_semaphore_capacitychange_add"),
    ],
)
def test_nobody_adds_permits_or_history_by_hand(client, url):
    client.force_login(staff(superuser=True))
    assert client.get(url).status_code == 403
    assert client.post(url, {}).status_code == 403


def test_no_page_offers_to_add_or_delete_permits(client, make_semaphore):
    client.force_login(staff(superuser=True))
    held = hold(make_semaphore())

    changelist = client.get(REQUESTS)
    detail = client.get(request_url(held))

    assert changelist.context["has_add_permission"] is False
    assert "delete_selected" not in changelist.content.decode()
    assert detail.context["has_delete_permission"] is False
    assert detail.context["has_change_permission"] is False
    assert client.post(request_url(held, "delete"), {"post": "yes"}).status_code == 403
    assert PermitRequest.objects.filter(pk=held.pk).exists()


# --- permit requests -------------------------------------------------------------------------


def test_requests_list_filters_and_search(viewer, make_semaphore):
    sem, other = make_semaphore(capacity=5), make_semaphore(capacity=5)
    owner = unique("owner")
    mine = hold(sem, 2, owner=owner)
    theirs = hold(other, owner=owner)
    expired = hold(sem, owner=owner, ttl=60)
    PermitRequest.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(1))
    ended = hold(sem, owner=owner)
    release(ended.external_id)

    def listed(**params) -> set[int]:
        response = viewer.get(REQUESTS, {"q": owner, **params})
        assert response.status_code == 200
        return {r.pk for r in response.context["cl"].result_list}

    assert listed() == {mine.pk, theirs.pk, expired.pk, ended.pk}
    assert listed(state__exact="RELEASED") == {ended.pk}
    assert listed(permits__semaphore__id__exact=other.pk) == {theirs.pk}
    assert listed(release_reason__exact="released") == {ended.pk}
    assert listed(expired="yes") == {expired.pk}
    assert listed(expired="no") == {mine.pk, theirs.pk, ended.pk}
    assert viewer.get(REQUESTS, {"q": mine.external_id}).context["cl"].result_count == 1
    assert f"{sem.name} (2)" in viewer.get(REQUESTS, {"q": owner}).content.decode()


def test_request_detail_is_read_only_with_its_permits(viewer, make_semaphore):
    sem = make_semaphore(capacity=5)
    held = acquire({sem.name: 2}, external_id=unique(), owner="w")

    response = viewer.get(request_url(held))

    assert response.status_code == 200
    formset = response.context["inline_admin_formsets"][0]
    assert [p.pk for p in formset.formset.queryset] == list(
        Permit.objects.filter(request=held).values_list("pk", flat=True)
    )
    assert not formset.has_change_permission
    assert 'name="owner"' not in response.content.decode()


def test_force_release_needs_its_own_permission(client, make_semaphore):
    # Even change permission on requests (unused by the admin) is not enough.
    client.force_login(staff(*VIEW_ALL, "change_permitrequest", "delete_permitrequest"))
    held = hold(make_semaphore())

    page = client.get(REQUESTS).content.decode()
    response = client.post(REQUESTS, {"action": "force_release", "_selected_action": [held.pk]})

    assert "force_release" not in page
    assert response.status_code == 403
    assert PermitRequest.objects.get(pk=held.pk).state == State.ACQUIRED


@pytest.mark.django_db(transaction=True)
def test_force_release_ends_requests_and_records_who(client, make_semaphore):
    user = staff(*VIEW_ALL, "force_release_permitrequest")
    client.force_login(user)
    sem = make_semaphore(capacity=5)
    first, second = hold(sem), hold(sem, 2)
    already = hold(sem)
    release(already.external_id)

    assert "force_release" in client.get(REQUESTS).content.decode()
    response = client.post(
        REQUESTS,
        {"action": "force_release", "_selected_action": [first.pk, second.pk, already.pk]},
    )

    assert response.status_code == 302
    assert messages_of(response) == [
        "2 permit requests were force-released.",
        "1 selected permit request was not held and was left as it was.",
    ]
    for request in (first, second):
        request.refresh_from_db()
        assert (request.state, request.release_reason) == (State.RELEASED, ReleaseReason.ADMIN)
        assert request.released_at is not None
    already.refresh_from_db()
    assert already.release_reason == ReleaseReason.RELEASED
    assert operator_row(client, sem).in_use == 0
    logged = LogEntry.objects.filter(user=user, action_flag=CHANGE)
    assert sorted(int(entry.object_id) for entry in logged) == sorted([first.pk, second.pk])
    assert "Force-released" in logged.first().get_change_message()
    # The holder learns at its next release that it had lost the permit.
    assert release(first.external_id).name == "ALREADY_RELEASED"
    history = client.get(request_url(first, "history"))
    assert user.get_username() in history.content.decode()


@pytest.mark.django_db(transaction=True)
def test_force_release_of_one_request_says_so_in_the_singular(client, make_semaphore):
    client.force_login(staff(*VIEW_ALL, "force_release_permitrequest"))
    held = hold(make_semaphore())

    response = client.post(REQUESTS, {"action": "force_release", "_selected_action": [held.pk]})

    assert messages_of(response) == ["1 permit request was force-released."]


# --- capacity history ------------------------------------------------------------------------


def test_history_list_filters_by_semaphore_and_user(viewer, make_semaphore):
    sem, other = make_semaphore(capacity=1), make_semaphore(capacity=1)
    alice, bob = staff(), staff()
    set_capacity(sem.name, 2, changed_by=alice, reason="alice's")
    set_capacity(sem.name, 3, changed_by=bob)
    set_capacity(other.name, 2, changed_by=alice)

    def listed(**params) -> list[tuple[int, int]]:
        response = viewer.get(HISTORY, params)
        assert response.status_code == 200
        return [(c.old_capacity, c.new_capacity) for c in response.context["cl"].result_list]

    assert listed(semaphore__id__exact=sem.pk) == [(2, 3), (1, 2)]
    assert listed(semaphore__id__exact=sem.pk, changed_by__id__exact=alice.pk) == [(1, 2)]
    assert listed(q="alice's") == [(1, 2)]
    page = viewer.get(HISTORY, {"semaphore__id__exact": sem.pk}).content.decode()
    assert re.search(r"1\s*→\s*2", page)


# --- the app's own database alias -------------------------------------------------------------


@pytest.fixture
def on_apps_alias(settings):
    """The app on its own alias (a second connection to the same database)."""
    settings.DJANGO_SEMAPHORE = {"DATABASE": "semaphores"}
    with CaptureQueriesContext(connections["semaphores"]) as queries:
        yield queries


@pytest.mark.django_db(transaction=True, databases=["default", "semaphores"])
def test_admin_reads_and_force_releases_through_the_apps_alias(
    client, on_apps_alias, make_semaphore
):
    client.force_login(staff(*VIEW_ALL, "force_release_permitrequest"))
    sem = make_semaphore(capacity=2)
    held = hold(sem)

    listed = client.get(SEMAPHORES, {"q": sem.name})
    page = client.get(semaphore_url(sem))
    released = client.post(REQUESTS, {"action": "force_release", "_selected_action": [held.pk]})

    assert [row.in_use for row in listed.context["cl"].result_list] == [1]
    assert [h["key"] for h in page.context["holders"]] == [held.external_id]
    assert released.status_code == 302
    assert PermitRequest.objects.get(pk=held.pk).release_reason == ReleaseReason.ADMIN
    sql = " ".join(query["sql"] for query in on_apps_alias.captured_queries)
    assert "django_semaphore_permit" in sql
    assert "django_semaphore_capacitychange" in sql


@pytest.mark.skipif(
    connection.vendor == "sqlite",
    reason="One writer per SQLite file: the admin's save transaction on one alias and "
    "set_capacity on another would wait on each other (see docs/admin.md).",
)
@pytest.mark.django_db(transaction=True, databases=["default", "semaphores"])
def test_capacity_change_through_the_apps_alias(client, on_apps_alias, make_semaphore):
    client.force_login(staff(*VIEW_ALL, "change_semaphore"))
    sem = make_semaphore(capacity=2)

    response = client.post(semaphore_url(sem), capacity_form(sem, 3, "via the alias"))

    assert response.status_code == 302
    assert CapacityChange.objects.get(semaphore=sem).reason == "via the alias"
    sql = " ".join(query["sql"] for query in on_apps_alias.captured_queries)
    assert "FOR UPDATE" in sql


@pytest.mark.parametrize("url", [SEMAPHORES, REQUESTS, HISTORY])
def test_lists_show_filter_counts(viewer, make_semaphore, url):
    sem = make_semaphore(capacity=1)
    hold(sem)
    set_capacity(sem.name, 2, changed_by=staff(), reason="facets")

    response = viewer.get(url, {"_facets": "True"})

    assert response.status_code == 200
    assert response.context["cl"].add_facets
