"""Families: per-key semaphores created on first use (issue 17, part 2)."""

from __future__ import annotations

import io
import os
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from celery import shared_task
from django.contrib.auth import get_user_model
from django.core.checks import CheckMessage, Tags, run_checks
from django.db import connection, connections
from django.http import HttpResponse
from django.test.utils import CaptureQueriesContext
from django.urls import path
from django.utils import timezone

from django_semaphore import acquire, conf, holds_permit, permit, release, set_capacity, sweep
from django_semaphore.declared import create_declared_semaphores
from django_semaphore.exceptions import (
    FamilyFull,
    InvalidRequest,
    SemaphoreExhausted,
    SemaphoreNotFound,
)
from django_semaphore.guards import engine_writes
from django_semaphore.models import CapacityChange, Permit, Semaphore
from django_semaphore.states import State
from tests.conftest import unique

pytestmark = pytest.mark.django_db

THREADS = 8


@pytest.fixture
def family(settings) -> str:
    """A family ``<prefix>:*`` of capacity 2 (a declared semaphore beside it);
    returns the prefix."""
    prefix = unique("fam")
    settings.DJANGO_SEMAPHORE = {
        "SEMAPHORES": {f"{prefix}-declared": 5, f"{prefix}:*": 2},
        "MEMBER_IDLE_LIMIT": 3600,
    }
    Semaphore.objects.create(name=f"{prefix}-declared", capacity=5)
    return prefix


def key() -> str:
    return uuid.uuid4().hex


def members(prefix: str) -> list[str]:
    return sorted(Semaphore.objects.filter(family=f"{prefix}:*").values_list("name", flat=True))


def make_idle(*names: str) -> None:
    """As if last granted two hours ago (the limit is one)."""
    Semaphore.objects.filter(name__in=names).update(updated_at=timezone.now() - timedelta(hours=2))


# --- creation on first use ----------------------------------------------------


def test_first_acquire_creates_the_member_with_the_family_capacity(family):
    name = f"{family}:customer-1"

    granted = acquire(name, external_id=key())

    member = Semaphore.objects.get(name=name)
    assert (member.family, member.capacity, member.in_use, member.own_capacity) == (
        f"{family}:*",
        2,
        1,
        False,
    )
    # The template holds the family default (created by this first use, as
    # migrate had not run since the family was declared).
    template = Semaphore.objects.get(name=f"{family}:*")
    assert (template.family, template.capacity, template.in_use) == ("", 2, 0)
    # Tokens start at the database clock in microseconds, not at 1.
    assert granted.token(name) > 10**15


def test_a_member_grants_up_to_its_capacity_then_refuses(family):
    name = f"{family}:c"
    acquire(name, external_id=key())
    acquire(name, external_id=key())

    with pytest.raises(SemaphoreExhausted):
        acquire(name, external_id=key())
    assert Semaphore.objects.filter(name=name).count() == 1


def test_a_name_no_family_matches_is_not_found_and_nothing_is_created(family):
    with pytest.raises(SemaphoreNotFound) as caught:
        acquire(f"{family}-other:1", external_id=key())

    assert caught.value.names == [f"{family}-other:1"]
    assert not Semaphore.objects.filter(name__startswith=f"{family}-other").exists()


def test_an_unknown_name_beside_a_member_creates_nothing(family):
    with pytest.raises(SemaphoreNotFound):
        acquire([f"{family}:new", f"{family}-unknown"], external_id=key())

    assert members(family) == []


def test_the_pattern_itself_cannot_be_acquired(family):
    with pytest.raises(InvalidRequest, match="pattern"):
        acquire(f"{family}:*", external_id=key())


def test_a_member_and_a_declared_semaphore_in_one_request(family):
    declared, member = f"{family}-declared", f"{family}:x"

    with permit({declared: 2, member: 1}) as grant:
        assert grant.token(member) > grant.token(declared)
        assert Semaphore.objects.get(name=declared).in_use == 2
        assert Semaphore.objects.get(name=member).in_use == 1
    assert Semaphore.objects.get(name=member).in_use == 0


def test_a_repeated_call_with_the_same_key_is_answered_with_its_request(family):
    name, same = f"{family}:r", key()

    first = acquire(name, external_id=same)
    again = acquire(name, external_id=same)

    assert again.pk == first.pk
    assert Semaphore.objects.get(name=name).in_use == 1


def test_an_existing_member_costs_the_statements_of_a_declared_semaphore(family):
    member, declared = f"{family}:warm", f"{family}-declared"
    release(acquire(member, external_id=key()).external_id)  # created, statements built

    def statements(name: str) -> list[str]:
        with CaptureQueriesContext(connection) as queries:
            release(acquire(name, external_id=key()).external_id)
        return [query["sql"].split()[0] for query in queries.captured_queries]

    statements(declared)  # the same warm-up for the declared one
    assert statements(member) == statements(declared)


def test_first_use_costs_one_short_transaction_more(family):
    with CaptureQueriesContext(connection) as queries:
        acquire(f"{family}:cold", external_id=key())

    inserts = [q["sql"] for q in queries.captured_queries if "INSERT" in q["sql"].upper()]
    created = [sql for sql in inserts if "django_semaphore_semaphore" in sql]
    assert len(created) == 2  # the template (absent before), then the member


# --- max_members ---------------------------------------------------------------


def test_max_members_refuses_a_new_member_and_keeps_the_existing(family, settings):
    limited = {f"{family}:*": {"capacity": 1, "max_members": 2}}
    declared = settings.DJANGO_SEMAPHORE
    settings.DJANGO_SEMAPHORE = {**declared, "SEMAPHORES": {**declared["SEMAPHORES"], **limited}}
    acquire(f"{family}:a", external_id=key())
    acquire(f"{family}:b", external_id=key())

    with pytest.raises(FamilyFull) as caught:
        acquire(f"{family}:c", external_id=key())

    assert caught.value.names == [f"{family}:c"]
    assert isinstance(caught.value, SemaphoreExhausted)  # a view answers 429
    assert members(family) == [f"{family}:a", f"{family}:b"]
    # Existing members are still granted (up to their capacity).
    with pytest.raises(SemaphoreExhausted):
        acquire(f"{family}:a", external_id=key())


# --- the family default ----------------------------------------------------------


def test_migrate_creates_the_family_default_row(family):
    create_declared_semaphores(using="default")

    assert Semaphore.objects.get(name=f"{family}:*").capacity == 2


def test_changing_the_default_changes_the_members_that_follow_it(
    family, admin_user, django_capture_on_commit_callbacks
):
    follower, own = f"{family}:follows", f"{family}:own"
    for name in (follower, own):
        release(acquire(name, external_id=key()).external_id)
    set_capacity(own, 7, reason="big customer")

    with django_capture_on_commit_callbacks(execute=True):  # followers: after the commit
        set_capacity(f"{family}:*", 4, changed_by=admin_user, reason="raised")

    assert Semaphore.objects.get(name=follower).capacity == 4
    assert Semaphore.objects.get(name=own).capacity == 7
    change = CapacityChange.objects.get(semaphore__name=follower)
    assert (change.old_capacity, change.new_capacity, change.changed_by, change.reason) == (
        2,
        4,
        admin_user,
        "raised",
    )
    # New members are created with the new default.
    acquire(f"{family}:new", external_id=key())
    assert Semaphore.objects.get(name=f"{family}:new").capacity == 4


def test_a_member_changed_on_its_own_keeps_its_capacity(family):
    name = f"{family}:m"
    release(acquire(name, external_id=key()).external_id)

    set_capacity(name, 5)

    assert Semaphore.objects.get(name=name).own_capacity is True


# --- the clean-up ------------------------------------------------------------------


def test_idle_members_are_deleted_with_their_history(family, django_capture_on_commit_callbacks):
    idle, held, recent, own = (f"{family}:{n}" for n in ("idle", "held", "recent", "own"))
    for name in (idle, recent, own):
        release(acquire(name, external_id=key()).external_id)
    holder = acquire(held, external_id=key())
    set_capacity(own, 3)
    with django_capture_on_commit_callbacks(execute=True):
        set_capacity(f"{family}:*", 3)  # history on the followers
    make_idle(idle, held, own, f"{family}:*", f"{family}-declared")

    report = sweep.clean_idle_members()

    assert report.deleted == 1
    assert report.permits == 1
    assert members(family) == sorted([held, recent, own])
    assert not CapacityChange.objects.filter(semaphore__name=idle).exists()
    assert Semaphore.objects.filter(name__in=[f"{family}:*", f"{family}-declared"]).count() == 2
    release(holder.external_id)


def test_a_member_created_again_hands_out_higher_tokens(family):
    name = f"{family}:again"
    first = acquire(name, external_id=key())
    release(first.external_id)
    make_idle(name)
    assert sweep.clean_idle_members().deleted == 1

    second = acquire(name, external_id=key())

    assert second.token(name) > first.token(name)


def test_a_member_with_a_live_fair_waiter_is_kept(family):
    name = f"{family}:queued"
    release(acquire(name, external_id=key()).external_id)
    with engine_writes():  # as a fair waiter's ticket would
        Semaphore.objects.filter(name=name).update(queued_until=timezone.now() + timedelta(hours=1))
    make_idle(name)

    assert sweep.clean_idle_members(dry_run=True).deleted == 0


def test_a_member_a_parked_task_waits_for_is_kept(family):
    from tests.test_parked import park_row

    name = f"{family}:parked"
    release(acquire(name, external_id=key()).external_id)
    park_row({name: 1})
    make_idle(name)

    assert sweep.clean_idle_members().deleted == 0
    assert members(family) == [name]


def test_the_sweep_command_deletes_idle_members(family):
    from django.core.management import call_command

    name = f"{family}:cmd"
    release(acquire(name, external_id=key()).external_id)
    make_idle(name)

    call_command("semaphore_sweep", "--cleanup", stdout=io.StringIO())

    assert members(family) == []


# --- computed names --------------------------------------------------------------------


@holds_permit(lambda request: f"{request.GET['family']}:customer:{request.user.pk}", count=2)
def export(request: Any) -> HttpResponse:
    """A per-customer export: the customer's member holds 2 permits meanwhile."""
    member = Semaphore.objects.get(name=f"{request.GET['family']}:customer:{request.user.pk}")
    return HttpResponse(str(member.in_use))


@holds_permit(lambda request: f"{request.GET['family']}:async")
async def async_export(request: Any) -> HttpResponse:
    member = await Semaphore.objects.aget(name=f"{request.GET['family']}:async")
    return HttpResponse(str(member.in_use))


urlpatterns = [path("export/", export), path("async-export/", async_export)]


@pytest.mark.urls("tests.test_families")
def test_a_view_computes_its_semaphore_from_the_request(family, client):
    user = get_user_model().objects.create(username=unique("user"))
    client.force_login(user)

    response = client.get("/export/", {"family": family})

    assert (response.status_code, response.content) == (200, b"2")
    assert Semaphore.objects.get(name=f"{family}:customer:{user.pk}").in_use == 0  # sent
    # Another customer has a member of its own; a full one answers 429.
    other = get_user_model().objects.create(username=unique("user"))
    acquire(f"{family}:customer:{other.pk}", external_id=key())
    client.force_login(other)
    assert client.get("/export/", {"family": family}).status_code == 429


@pytest.mark.django_db(transaction=True)  # the view acquires in asgiref's thread
@pytest.mark.urls("tests.test_families")
@pytest.mark.usefixtures("sync_thread_connections")
async def test_an_async_view_computes_its_semaphore_from_the_request(family, async_client):
    response = await async_client.get("/async-export/", {"family": family})

    assert (response.status_code, response.content) == (200, b"1")
    member = await Semaphore.objects.aget(name=f"{family}:async")
    assert member.in_use == 0


@shared_task(bind=True)
@holds_permit(lambda customer_id, **_: f"{customer_id}")
def sync_customer(self: Any, customer_id: str, note: str = "") -> int:
    return Semaphore.objects.get(name=customer_id).in_use


def test_a_task_computes_its_semaphore_from_its_arguments(family):
    name = f"{family}:sync-1"

    result = sync_customer.apply(args=[name], kwargs={"note": "n"})

    assert result.get() == 1  # held while the body ran
    assert Semaphore.objects.get(name=name).in_use == 0  # released by task_postrun


def test_a_function_computes_its_semaphore_from_its_arguments(family):
    @holds_permit(lambda customer, **_: f"{family}:fn:{customer}")
    def work(customer: int, *, rows: int = 0) -> int:
        return Semaphore.objects.get(name=f"{family}:fn:{customer}").in_use

    assert work(3, rows=5) == 1
    assert Semaphore.objects.get(name=f"{family}:fn:3").in_use == 0


# --- settings checks ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("semaphores", "error"),
    [
        ({"a:*": {"capacity": -1}}, "django_semaphore.E009"),
        ({"a:*": {"capacity": 1, "max_members": 0}}, "django_semaphore.E009"),
        ({"a:*": {"capacity": 1, "typo": 3}}, "django_semaphore.E009"),
        ({"a": {"capacity": 1, "max_members": 3}}, "django_semaphore.E009"),  # families only
        ({"a:*": 1, "a:b:*": 1}, "django_semaphore.W006"),  # shadowed
    ],
)
def test_malformed_families_are_reported(settings, semaphores, error):
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": semaphores}

    assert error in [message.id for message in settings_checks()]


def test_well_formed_families_pass_the_checks(settings):
    settings.DJANGO_SEMAPHORE = {
        "SEMAPHORES": {"a:b:*": 1, "a:*": {"capacity": 2, "max_members": 10}, "x": 3},
        "MEMBER_IDLE_LIMIT": timedelta(hours=6),
    }

    ids = {message.id for message in settings_checks()}
    assert not ids & {"django_semaphore.E015", "django_semaphore.E009", "django_semaphore.W006"}


def test_a_change_of_settings_changes_the_families(settings):
    """The families are built once per settings state (every release asks
    which family each of its names is in), and afresh when settings change."""
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": {"x": 3}}
    assert conf.family_of("tenant:1") is None

    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": {"x": 3, "tenant:*": {"capacity": 2}}}

    assert conf.family_of("tenant:1") == conf.Family("tenant:*", 2, None, None)
    assert conf.declared_capacity("tenant:1") == 2


def settings_checks() -> list[CheckMessage]:
    """The checks of the app's settings only: the model checks of Django 6
    also ask every alias's server, which these tests have no need of."""
    return run_checks(tags=[Tags.compatibility])


# --- concurrency -------------------------------------------------------------------------


def run_threads(target: Any, count: int = THREADS) -> list[BaseException]:
    """Run ``target(i)`` in ``count`` threads released together; their errors."""
    barrier, errors = threading.Barrier(count), []

    def run(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(daemon=True, target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


@pytest.mark.django_db(transaction=True)
def test_racing_first_acquires_create_one_member_and_never_over_grant(family):
    name = f"{family}:race"
    granted: list[int] = []

    def first_use(i: int) -> None:
        try:
            acquire(name, external_id=key(), timeout=0)
            granted.append(i)
        except SemaphoreExhausted:
            pass

    assert run_threads(first_use) == []
    assert Semaphore.objects.filter(name=name).count() == 1
    assert len(granted) == 2  # capacity 2: two granted, the others refused
    assert Permit.objects.filter(semaphore__name=name, state=State.ACQUIRED).count() == 2
    tokens = Permit.objects.filter(semaphore__name=name).values_list("fencing_token", flat=True)
    assert len(set(tokens)) == 2


@pytest.mark.django_db(transaction=True)
def test_racing_creations_never_pass_max_members(family, settings):
    limited = {f"{family}:*": {"capacity": 1, "max_members": 3}}
    declared = settings.DJANGO_SEMAPHORE
    settings.DJANGO_SEMAPHORE = {**declared, "SEMAPHORES": {**declared["SEMAPHORES"], **limited}}
    refused: list[int] = []

    def create(i: int) -> None:
        try:
            with permit(f"{family}:m{i}"):
                pass
        except FamilyFull:
            refused.append(i)

    assert run_threads(create) == []
    assert len(members(family)) == 3
    assert len(refused) == THREADS - 3


@pytest.mark.django_db(transaction=True)
def test_the_clean_up_racing_acquires_never_deletes_a_held_member(family):
    names = [f"{family}:churn{i}" for i in range(4)]
    for name in names:
        release(acquire(name, external_id=key()).external_id)
    held: list[str] = []

    def work(i: int) -> None:
        if i == 0:
            for _ in range(5):
                make_idle(*names)
                sweep.clean_idle_members()
            return
        for _ in range(10):
            name = names[i % len(names)]
            try:
                with permit(name):
                    held.append(name)
                    assert Semaphore.objects.filter(name=name, in_use__gte=1).exists()
            except SemaphoreExhausted:
                pass

    assert run_threads(work, count=5) == []
    assert held


# --- the admin -------------------------------------------------------------------------


def test_the_admin_filters_a_family_with_its_default_and_utilization(family, client):
    from tests.test_admin import SEMAPHORES, VIEW_ALL, staff

    client.force_login(staff(*VIEW_ALL))
    acquire(f"{family}:a", external_id=key())
    acquire(f"{family}:b", external_id=key(), ttl=60)

    changelist = client.get(SEMAPHORES, {"family": f"{family}:*"})

    rows = {row.name: row.in_use for row in changelist.context["cl"].result_list}
    assert rows == {f"{family}:*": 0, f"{family}:a": 1, f"{family}:b": 1}
    assert "semaphore-bar" in changelist.content.decode()  # the utilization column


def test_the_admin_changes_one_member_or_the_family_default(
    family, client, django_capture_on_commit_callbacks
):
    from tests.test_admin import VIEW_ALL, semaphore_url, staff

    user = staff(*VIEW_ALL, "change_semaphore")
    client.force_login(user)
    release(acquire(f"{family}:a", external_id=key()).external_id)
    release(acquire(f"{family}:b", external_id=key()).external_id)
    member = Semaphore.objects.get(name=f"{family}:a")
    template = Semaphore.objects.get(name=f"{family}:*")
    assert "default of this family" in client.get(semaphore_url(template)).content.decode()

    one = client.post(semaphore_url(member), {"capacity": "9", "reason": "big"})
    with django_capture_on_commit_callbacks(execute=True):
        default = client.post(semaphore_url(template), {"capacity": "4", "reason": "more"})

    assert (one.status_code, default.status_code) == (302, 302)
    capacities = dict(
        Semaphore.objects.filter(family=f"{family}:*").values_list("name", "capacity")
    )
    assert capacities == {f"{family}:a": 9, f"{family}:b": 4}
    assert CapacityChange.objects.get(semaphore__name=f"{family}:b").changed_by == user
    assert "capacity of its own" in client.get(semaphore_url(member)).content.decode()


@pytest.fixture
def celery_app_kept():
    """Importing ``example_project`` makes its Celery app (a filesystem broker)
    the current one; the real-worker tests publish through the current app."""
    from celery import _state

    current, default = _state.get_current_app(), _state.default_app
    yield
    _state._set_current_app(current)
    _state.set_default_app(default)


@pytest.mark.urls("example_project.urls")
@pytest.mark.usefixtures("celery_app_kept")
def test_the_example_projects_per_customer_export(settings, client, monkeypatch):
    from example_project.demo import views

    monkeypatch.setattr(views.time, "sleep", lambda seconds: None)
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": {"export:customer:*": 2}}
    customer = 10**9 + os.getpid() % 1000

    def url(customer: int) -> str:
        return f"/exports/customer/{customer}/report.csv"

    first, second = client.get(url(customer)), client.get(url(customer))
    third = client.get(url(customer))
    other = client.get(url(customer + 1))

    assert [r.status_code for r in (first, second, third, other)] == [200, 200, 429, 200]
    assert Semaphore.objects.get(name=f"export:customer:{customer}").in_use == 2
    for response in (first, second, other):
        assert b"".join(response.streaming_content).startswith(b"id,customer,amount")
    assert Semaphore.objects.get(name=f"export:customer:{customer}").in_use == 0


def test_the_orm_cannot_make_a_declared_semaphore_a_member(family):
    from django_semaphore.exceptions import UnsafeWrite

    with pytest.raises(UnsafeWrite, match="family"):
        Semaphore.objects.filter(name=f"{family}-declared").update(family=f"{family}:*")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_real_workers_tasks_compute_their_member_from_their_arguments(celery_worker):
    from tests import tasks

    member, other = unique("m"), unique("m")
    results = [
        tasks.per_member.delay(member, hold=0.5),
        tasks.per_member.delay(member, hold=0.5),  # capacity 1: waits its turn
        tasks.per_member.apply_async(args=[other], kwargs={"hold": 0.5}),
    ]

    assert [result.get(timeout=90) for result in results] == [1, 1, 1]
    assert (
        Semaphore.objects.filter(
            name__in=[f"celery-family:{member}", f"celery-family:{other}"]
        ).count()
        == 2
    )
    deadline = time.monotonic() + 10
    while Semaphore.objects.filter(name__startswith="celery-family:", in_use__gt=0).exists():
        assert time.monotonic() < deadline, "a finished task kept its permit"
        time.sleep(0.05)
