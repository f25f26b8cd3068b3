"""Rate limits: windowed semaphores (SPEC §7, docs/rates.md), on the real
database with real time, committed grants and concurrent clients."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.checks import Tags, run_checks
from django.db import connections

from django_semaphore import ReleaseOutcome, acquire, permit, release, set_capacity, set_window
from django_semaphore.declared import create_declared_semaphores
from django_semaphore.exceptions import (
    AcquireTimeout,
    InvalidRequest,
    SemaphoreExhausted,
    UnsafeWrite,
)
from django_semaphore.models import CapacityChange, ParkedTask, Permit, PermitRequest, Semaphore
from django_semaphore.parking import wake
from django_semaphore.validation import parse_rate
from tests import tasks, views
from tests.children import Outbox
from tests.clients import run_clients, take_slots
from tests.conftest import ago, behind_the_engine, unique
from tests.test_parked import park_row
from tests.testapp.models import RunLog

pytestmark = pytest.mark.django_db(transaction=True)


def rate_limit(capacity: int, window: int = 1, name: str | None = None) -> Semaphore:
    semaphore = Semaphore.objects.create(name=name or unique("rate"), capacity=capacity)
    set_window(semaphore.name, window)
    return Semaphore.objects.get(pk=semaphore.pk)


def in_use(name: str) -> int:
    return Semaphore.objects.get(name=name).in_use


def refused(names: object) -> SemaphoreExhausted:
    with pytest.raises(SemaphoreExhausted) as caught:
        acquire(names, external_id=unique())
    return caught.value


# --- the window -------------------------------------------------------------------------


def test_grants_at_most_capacity_in_a_window_released_or_not():
    stripe = rate_limit(3, window=1)
    for _ in range(3):
        release(acquire(stripe.name, external_id=unique()).external_id)

    # Released, but the slots stay until their window ends.
    assert in_use(stripe.name) == 3
    error = refused(stripe.name)
    assert error.names == [stripe.name]
    assert 0 < error.retry_after <= 1


def test_a_slot_frees_when_its_window_ends_not_before():
    stripe = rate_limit(1, window=1)
    acquire(stripe.name, external_id=unique())
    retry_after = refused(stripe.name).retry_after

    time.sleep(retry_after + 0.05)

    assert acquire(stripe.name, external_id=unique()).state == "ACQUIRED"


def test_the_window_slides_with_each_grant():
    stripe = rate_limit(3, window=1)
    acquire({stripe.name: 2}, external_id=unique())
    time.sleep(0.5)
    acquire(stripe.name, external_id=unique())
    time.sleep(0.6)

    # The first two slots ended, the third has not: room for two, not three.
    assert in_use(stripe.name) == 1
    with pytest.raises(SemaphoreExhausted):
        acquire({stripe.name: 3}, external_id=unique())
    acquire({stripe.name: 2}, external_id=unique())


def test_holders_do_not_count_on_a_rate_limit():
    """A windowed permit held past its window no longer counts: a rate
    limit limits grants, not holders (take a concurrency limit with it)."""
    stripe = rate_limit(1, window=1)
    held = acquire(stripe.name, external_id=unique())
    time.sleep(1.05)

    acquire(stripe.name, external_id=unique())
    assert release(held.external_id) == ReleaseOutcome.RELEASED
    assert in_use(stripe.name) == 1


def test_a_repeated_acquire_takes_no_second_slot():
    stripe = rate_limit(1)
    key = unique()
    first = acquire(stripe.name, external_id=key)

    assert acquire(stripe.name, external_id=key).pk == first.pk
    assert Permit.objects.filter(semaphore=stripe).count() == 1


def test_slots_end_a_window_after_the_grant_by_the_database_clock():
    stripe = rate_limit(5, window=60)
    request = acquire(stripe.name, external_id=unique())

    slot = Permit.objects.get(request=request)
    assert slot.slot_ends == request.created_at + timedelta(seconds=60)


# --- every door ----------------------------------------------------------------------------


def test_a_mixed_demand_takes_a_rate_slot_and_a_permit_together_or_neither():
    exports = Semaphore.objects.create(name=unique("exports"), capacity=1)
    stripe = rate_limit(1, window=60)
    acquire(exports.name, external_id="holder")

    # No room on exports: the slot is not spent.
    assert refused({exports.name: 1, stripe.name: 1}).names == [exports.name]
    assert in_use(stripe.name) == 0

    release("holder")
    acquire({exports.name: 1, stripe.name: 1}, external_id=unique())
    # No slot left: no permit taken either, and only the rate limit says when.
    release_all()
    error = refused({exports.name: 1, stripe.name: 1})
    assert error.names == [stripe.name]
    assert 59 < error.retry_after <= 60
    assert in_use(exports.name) == 0


def release_all() -> None:
    for key in PermitRequest.objects.filter(state="ACQUIRED").values_list("external_id", flat=True):
        release(key)


def test_a_timeout_waits_for_the_next_slot():
    stripe = rate_limit(1, window=1)
    acquire(stripe.name, external_id=unique())
    started = time.monotonic()

    acquire(stripe.name, external_id=unique(), timeout=3)

    assert 0.5 < time.monotonic() - started < 2


def test_a_timeout_shorter_than_the_next_slot_says_when_it_comes():
    stripe = rate_limit(1, window=60)
    acquire(stripe.name, external_id=unique())

    with pytest.raises(AcquireTimeout) as caught:
        acquire(stripe.name, external_id=unique(), timeout=0.3)
    assert 55 < caught.value.retry_after <= 60


def test_waiters_on_a_rate_limit_are_granted_in_order():
    stripe = rate_limit(1, window=1)
    acquire(stripe.name, external_id=unique())
    order: list[str] = []

    def wait(key: str) -> None:
        try:
            acquire(stripe.name, external_id=key, timeout=5)
            order.append(key)
        finally:
            connections.close_all()

    first = threading.Thread(target=wait, args=("first",), daemon=True)
    first.start()
    time.sleep(0.3)
    second = threading.Thread(target=wait, args=("second",), daemon=True)
    second.start()
    first.join(10)
    second.join(10)

    assert not first.is_alive()
    assert not second.is_alive()
    assert order == ["first", "second"]


def test_a_view_answers_429_with_the_seconds_to_the_next_slot(client):
    Semaphore.objects.create(name=views.VIEWS, capacity=5)
    rate_limit(1, window=30, name=views.RATED)

    assert client.get("/rated/").status_code == 200
    response = client.get("/rated/")

    assert response.status_code == 429
    assert 29 <= int(response["Retry-After"]) <= 30


def test_a_view_short_of_a_concurrency_permit_answers_with_its_own_retry_after(client):
    Semaphore.objects.create(name=views.VIEWS, capacity=1)
    rate_limit(5, window=30, name=views.RATED)
    acquire(views.VIEWS, external_id=unique())

    response = client.get("/rated/")

    assert (response.status_code, response["Retry-After"]) == (429, "7")


def test_the_context_manager_holds_a_slot_like_any_permit():
    stripe = rate_limit(1, window=60)
    with permit(stripe.name) as held:
        assert held.token(stripe.name) >= 1

    assert in_use(stripe.name) == 1


@pytest.mark.slow
def test_parked_tasks_are_woken_at_each_slot_in_order_without_a_release(celery_worker, wakes):
    """Tasks refused by a rate limit park; no release frees a slot, yet each
    runs as soon as a slot ends (a wake-up published for then, not the beat
    sweep), first in, first out, and none fails or runs early. The window
    outlasts a refused task's stand-by in its worker (``STANDBY_WAIT``):
    they park."""
    rate_limit(1, window=3, name=tasks.RATE_PARK)
    acquire(tasks.RATE_PARK, external_id=unique())  # the window's one slot
    results = []
    for n in range(3):
        results.append(tasks.rate_limited.delay("rated"))
        eventually(lambda n=n: ParkedTask.objects.count() + ran() >= n + 1, f"task {n} parked")

    for result in results:
        result.get(timeout=30, propagate=False)

    assert [r.state for r in results] == ["SUCCESS"] * 3, [r.traceback for r in results]
    runs = list(RunLog.objects.filter(label="rated").order_by("started_at"))
    assert [run.task_id for run in runs] == [r.id for r in results]  # first in, first out
    grants = sorted(
        PermitRequest.objects.filter(permits__semaphore__name=tasks.RATE_PARK).values_list(
            "created_at", flat=True
        )
    )
    gaps = [later - earlier for earlier, later in itertools.pairwise(grants)]
    assert all(gap >= timedelta(seconds=3) for gap in gaps), gaps  # never two in a window
    assert all(gap < timedelta(seconds=4.5) for gap in gaps), gaps  # woken at the slot's end


def test_a_tenant_at_its_rate_never_holds_back_another_on_the_shared_semaphore(published):
    """Tenant A's tasks parked for want of A's own rate leave the shared
    concurrency limit to tenant B's, and a release of the shared one wakes
    none of A's: its slot has not ended."""
    exports = Semaphore.objects.create(name=unique("exports"), capacity=3)
    a, b = rate_limit(1, window=60), rate_limit(1, window=60)
    acquire({exports.name: 1, a.name: 1}, external_id="a-runs")  # A's slot for a minute
    [park_row({exports.name: 1, a.name: 1}) for _ in range(3)]
    acquire({exports.name: 2}, external_id="fill")
    b_task = park_row({exports.name: 1, b.name: 1})  # exports is full now

    release("fill")
    release("a-runs")

    assert wake.wake("default", [exports.pk, a.pk]) == 1
    assert published == [b_task]


def ran() -> int:
    return RunLog.objects.filter(label="rated").count()


def eventually(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


# --- declared, families, changes ------------------------------------------------------------


def test_declared_rates_are_created_as_windows(settings):
    settings.DJANGO_SEMAPHORE = {
        "SEMAPHORES": {"api-rate": {"rate": "100/s"}, "sync-rate": {"capacity": 5, "window": 60}}
    }

    create_declared_semaphores(using="default")

    rows = Semaphore.objects.filter(name__in=["api-rate", "sync-rate"])
    assert sorted(rows.values_list("name", "capacity", "window")) == [
        ("api-rate", 100, 1),
        ("sync-rate", 5, 60),
    ]


def test_a_family_gives_each_key_its_own_rate(settings):
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": {"stripe:account:*": {"rate": "2/m"}}}

    for _ in range(2):
        acquire("stripe:account:a", external_id=unique())
    assert refused("stripe:account:a").names == ["stripe:account:a"]
    acquire("stripe:account:b", external_id=unique())

    member = Semaphore.objects.get(name="stripe:account:b")
    assert (member.capacity, member.window, member.family) == (2, 60, "stripe:account:*")


def test_a_family_default_window_change_reaches_its_members(settings):
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": {"sync:*": {"rate": "2/m"}}}
    create_declared_semaphores(using="default")
    acquire("sync:a", external_id=unique())

    set_window("sync:*", 3600, reason="slower")

    member = Semaphore.objects.get(name="sync:a")
    assert member.window == 3600
    change = CapacityChange.objects.get(semaphore=member)
    assert (change.old_window, change.new_window, change.reason) == (60, 3600, "slower")


def test_window_changes_are_recorded_with_who_and_why():
    stripe = Semaphore.objects.create(name=unique(), capacity=10)
    staff = get_user_model().objects.create_user("ops")

    set_window(stripe.name, timedelta(minutes=1), changed_by=staff, reason="stripe's limit")
    set_capacity(stripe.name, 20)

    changes = CapacityChange.objects.filter(semaphore=stripe).order_by("id")
    assert [
        (c.old_capacity, c.new_capacity, c.old_window, c.new_window, c.changed_by) for c in changes
    ] == [(10, 10, None, 60, staff), (10, 20, 60, 60, None)]


def test_removing_the_window_ends_the_slots_and_counts_holders_again():
    stripe = rate_limit(2, window=60)
    held = acquire(stripe.name, external_id=unique())
    release(acquire(stripe.name, external_id=unique()).external_id)
    assert in_use(stripe.name) == 2

    set_window(stripe.name, None)

    assert in_use(stripe.name) == 1  # the holder, as any concurrency permit
    acquire(stripe.name, external_id=unique())
    release(held.external_id)
    # A window set again counts only the grants made from then on.
    set_window(stripe.name, 60)
    assert in_use(stripe.name) == 0


def test_a_window_changed_through_save_is_recorded_and_bulk_writes_are_refused():
    stripe = Semaphore.objects.create(name=unique(), capacity=10)
    stripe.window = 5
    stripe.save()

    change = CapacityChange.objects.get(semaphore=stripe)
    assert (change.old_window, change.new_window) == (None, 5)
    with pytest.raises(UnsafeWrite, match="set_window"):
        Semaphore.objects.filter(pk=stripe.pk).update(window=10)
    stripe.window = 0
    with pytest.raises(InvalidRequest):
        stripe.save()


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rate", ["100", "100/d", "1.5/s", "-1/s", "/s", "100/0s", "1/25h", 100, None, "\uff11/s"]
)
def test_malformed_rates_are_refused(rate):
    with pytest.raises(InvalidRequest):
        parse_rate(rate)


@pytest.mark.parametrize(
    ("rate", "limits"),
    [("100/s", (100, 1)), ("5/m", (5, 60)), ("1000/h", (1000, 3600)), ("3/10s", (3, 10))],
)
def test_rates_read_as_a_capacity_per_window(rate, limits):
    assert parse_rate(rate) == limits


@pytest.mark.parametrize(
    "value",
    [
        {"rate": "100/d"},
        {"rate": "100/s", "window": 1},
        {"rate": "100/s", "capacity": 100},
        {"window": 5},
        {"capacity": 5, "window": 0},
        {"capacity": 5, "window": 1.5},
        {"capacity": 5, "window": 100_000},
        pytest.param({"capacity": 5, "window": 10**400}, id="beyond-every-float"),
        {"capacity": 5, "max_members": 3},  # a family's only
    ],
)
def test_malformed_declared_rates_fail_the_system_check(settings, value):
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": {"stripe": value}}

    assert "django_semaphore.E009" in [m.id for m in run_checks(tags=[Tags.compatibility])]


@pytest.mark.parametrize(
    "window",
    [0, -1, 1.5, 86_401, pytest.param(10**400, id="huge"), "60", True, timedelta(milliseconds=10)],
)
def test_set_window_refuses_malformed_windows_and_writes_nothing(window):
    stripe = Semaphore.objects.create(name=unique(), capacity=10)

    with pytest.raises(InvalidRequest):
        set_window(stripe.name, window)
    assert Semaphore.objects.get(pk=stripe.pk).window is None
    assert not CapacityChange.objects.exists()


# --- under load ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["threads", pytest.param("processes", marks=pytest.mark.slow)])
def test_concurrent_clients_never_exceed_the_rate_in_any_window(mode):
    """Eight clients (threads or processes, each on its own connection) take
    slots of a 10/s limit, mixed with a concurrency limit, for three
    seconds: a window slid over every grant's time (the database's clock,
    as the grant stamped it) never holds more than ten, and the limit is
    used (a rate limit that granted nothing would pass the first check)."""
    stripe = rate_limit(10, window=1)
    exports = Semaphore.objects.create(name=unique("exports"), capacity=4)
    errors = Outbox.create()

    run_clients(mode, take_slots, ({stripe.name: 1, exports.name: 1}, 3.0, errors))

    assert errors.items() == []
    grants = sorted(
        PermitRequest.objects.filter(permits__semaphore=stripe).values_list("created_at", flat=True)
    )
    assert len(grants) >= 25  # about ten a second for three seconds
    window = timedelta(seconds=1)
    over = [
        at for i, at in enumerate(grants) if sum(at <= g < at + window for g in grants[i:]) > 10
    ]
    assert over == []


# --- the sweeps ------------------------------------------------------------------------------


@pytest.mark.counter_drift_expected
def test_the_verifier_corrects_a_rate_limits_slot_counter():
    from django_semaphore.engine.verifier import verify

    stripe = rate_limit(5, window=60)
    acquire({stripe.name: 2}, external_id=unique())
    with behind_the_engine():
        Semaphore.objects.filter(pk=stripe.pk).update(slots_open=5)

    drifts = verify([stripe.name])

    assert [(d.counter, d.recorded, d.actual) for d in drifts] == [("slots", 5, 2)]
    assert in_use(stripe.name) == 2


def test_the_orphan_sweep_closes_the_slots_a_rate_limit_nobody_acquires_left(settings):
    from django_semaphore import sweep

    stripe = rate_limit(2, window=1)
    release(acquire({stripe.name: 2}, external_id=unique()).external_id)
    time.sleep(1.1)

    sweep.release_orphans()

    closed = Semaphore.objects.get(pk=stripe.pk)
    assert (closed.slots_open, closed.in_use) == (0, 0)
    assert closed.slots_closed_until > Permit.objects.get(semaphore=stripe).slot_ends


def test_the_clean_up_keeps_released_requests_whose_slots_still_count(settings):
    from django_semaphore import sweep

    settings.DJANGO_SEMAPHORE = {"RELEASED_RETENTION": timedelta(seconds=1)}
    stripe = rate_limit(2, window=60)
    plain = Semaphore.objects.create(name=unique(), capacity=2)
    counted, recent, old = unique(), unique(), unique()
    for key, name in ((counted, stripe.name), (recent, plain.name), (old, plain.name)):
        acquire(name, external_id=key)
        release(key)
    # Granted two days ago: no slot of it can count, whatever the window.
    PermitRequest.objects.filter(external_id=old).update(created_at=ago(days=2))
    time.sleep(1.1)

    sweep.clean_released()

    # The request whose slot counts stays, and so does one granted within a
    # day (a window at most) of the rate limit's last close; the old one goes.
    assert set(PermitRequest.objects.values_list("external_id", flat=True)) == {counted, recent}
    assert in_use(stripe.name) == 1
