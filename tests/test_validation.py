"""Bad input is refused with a typed error before anything is written."""

from __future__ import annotations

import math
import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured

from django_semaphore import (
    acquire,
    force_release,
    holds_permit,
    parking,
    permit,
    release,
    renew,
    sweep,
)
from django_semaphore.api import set_capacity
from django_semaphore.beat import beat_schedule
from django_semaphore.conf import app_settings
from django_semaphore.engine import verifier
from django_semaphore.exceptions import InvalidRequest, SemaphoreError
from django_semaphore.models import CapacityChange, PermitRequest
from django_semaphore.states import State
from tests.conftest import static_checks, unique

pytestmark = pytest.mark.django_db(transaction=True)

BAD_NAMES = [
    [],
    {},
    "",
    "   ",
    "x" * 256,
    b"bytes",
    42,
    None,
    ["ok", 3],
    ["ok", "ok"],
    {"ok": 0},
    {"ok": -1},
    {"ok": 1.5},
    {"ok": True},
    {"ok": "2"},
    {7: 1},
]


@pytest.mark.parametrize("names", BAD_NAMES, ids=repr)
def test_bad_names(make_semaphore, names):
    make_semaphore(name="ok", capacity=5)
    with pytest.raises(InvalidRequest):
        acquire(names, external_id=unique())
    assert not PermitRequest.objects.exists()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"external_id": ""},
        {"external_id": "  "},
        {"external_id": "k" * 256},
        {"external_id": 12},
        {"external_id": None},
        {"owner": None},
        {"owner": "o" * 256},
        {"ttl": 0},
        {"ttl": -5},
        {"ttl": timedelta(seconds=-1)},
        {"ttl": "60"},
        {"ttl": True},
        {"ttl": float("nan")},
        {"ttl": 2**40},
        {"ttl": 10**400},  # beyond every float
        {"timeout": -1},
        {"timeout": "5"},
        {"timeout": float("inf")},
        {"timeout": 10**400},
        {"timeout": 1e12},  # a deadline past what the clocks' types hold
        {"timeout": timedelta(days=10**6)},
        {"fair": "no"},  # truthy, yet meant as off
    ],
    ids=repr,
)
def test_bad_arguments(make_semaphore, kwargs):
    make_semaphore(name="ok", capacity=5)
    with pytest.raises(InvalidRequest) as excinfo:
        acquire("ok", **{"external_id": unique(), **kwargs})
    assert isinstance(excinfo.value, ValueError)
    assert isinstance(excinfo.value, SemaphoreError)
    assert not PermitRequest.objects.exists()


def test_fractional_ttl_rounds_up(make_semaphore):
    make_semaphore(name="ok")
    assert acquire("ok", external_id=unique(), ttl=0.2).ttl == 1


@pytest.mark.parametrize("key", ["", None, "k" * 256])
def test_release_and_renew_validate_the_key(key):
    with pytest.raises(InvalidRequest):
        release(key)
    with pytest.raises(InvalidRequest):
        renew(key)


@pytest.mark.parametrize("capacity", [-1, 1.5, "3", None, True])
def test_set_capacity_validates(make_semaphore, capacity):
    sem = make_semaphore(capacity=2)
    with pytest.raises(InvalidRequest):
        set_capacity(sem.name, capacity)
    sem.refresh_from_db()
    assert sem.capacity == 2


def test_permit_refuses_a_heartbeat_that_is_not_a_bool(make_semaphore):
    make_semaphore(name="ok")
    with pytest.raises(InvalidRequest, match="heartbeat"):
        permit("ok", ttl=30, heartbeat="no")
    assert not PermitRequest.objects.exists()


@pytest.mark.parametrize("name", ["", None, 5, "a\x00b", "x" * 256])
def test_set_capacity_validates_the_name(make_semaphore, name):
    with pytest.raises(InvalidRequest, match="name"):
        set_capacity(name, 3)
    assert not CapacityChange.objects.exists()


def test_set_capacity_validates_who_changed_it(make_semaphore):
    sem = make_semaphore(capacity=2)
    for who in ("bob", 5, get_user_model()(username="unsaved"), sem):
        with pytest.raises(InvalidRequest, match="changed_by"):
            set_capacity(sem.name, 3, changed_by=who)
    sem.refresh_from_db()
    assert sem.capacity == 2
    assert not CapacityChange.objects.exists()


# --- @holds_permit: every argument checked when decorating ------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout": "5"},
        {"timeout": -1},
        {"timeout": math.inf},
        {"retry_after": "soon"},
        {"retry_after": -1},
        {"retry_after": 1.5},
        {"count": 0},
        {"count": "2"},
        {"fair": "yes"},
        {"park": "false"},
        {"ttl": 0},
    ],
    ids=repr,
)
def test_holds_permit_refuses_bad_arguments_when_decorating(kwargs):
    """Not on the first request, where a view would answer them with a 503."""
    with pytest.raises(InvalidRequest):
        holds_permit("ok", **kwargs)
    with pytest.raises(InvalidRequest):
        holds_permit(lambda request: "ok", **kwargs)


def test_a_names_callable_that_cannot_take_the_calls_arguments_is_named():
    """Was a bare TypeError from inside the decorator, at the call or the send."""

    @holds_permit(lambda customer: f"export:{customer}")
    def export(customer, fmt):
        return fmt

    with pytest.raises(InvalidRequest, match=r"that names semaphores cannot take the arguments"):
        export("acme", "csv")

    @holds_permit(lambda customer: f"export:{customer + 1}")
    def broken(customer):
        return customer

    with pytest.raises(TypeError) as raised:  # its own error, as it raised it
        broken("acme")
    assert not isinstance(raised.value, InvalidRequest)


# --- sweeps, force-release, the counter verifier, parked tasks, beat ----------------


SWEEPS = [
    sweep.release_orphans,
    sweep.clean_released,
    sweep.clean_history,
    sweep.clean_idle_members,
    sweep.clean_tickets,
]


@pytest.mark.parametrize("sweeper", SWEEPS, ids=lambda sweeper: sweeper.__name__)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": -3},  # was Django's "Negative indexing is not supported"
        {"batch_size": 0},  # was taken as the setting's
        {"batch_size": True},
        {"batch_size": 2.5},
        {"batch_size": 2**40},
        {"time_budget": -1},  # was accepted: one batch, then stop
        {"time_budget": math.nan},
        {"time_budget": math.inf},
        {"time_budget": "60"},
    ],
    ids=repr,
)
@pytest.mark.parametrize("dry_run", [False, True])
def test_sweeps_refuse_a_bad_batch_size_or_time_budget(leftovers, sweeper, kwargs, dry_run):
    expired, old = leftovers
    with pytest.raises(InvalidRequest, match=next(iter(kwargs))):
        sweeper(dry_run=dry_run, **kwargs)
    expired.refresh_from_db()
    assert expired.state == State.ACQUIRED
    assert PermitRequest.objects.filter(pk=old.pk).exists()


def test_force_release_refuses_bad_keys_and_reasons(leftovers):
    expired, _ = leftovers
    for keys, reason in (
        (expired.external_id, None),  # one str: not its characters
        ([expired.external_id, ""], None),
        ([expired.external_id, None], None),
        ([expired.external_id], "bogus"),
    ):
        with pytest.raises(InvalidRequest):
            force_release(keys, reason)
    expired.refresh_from_db()
    assert expired.state == State.ACQUIRED


@pytest.mark.parametrize(
    "kwargs", [{"names": "abc"}, {"names": ["a\x00"]}, {"names": [3]}, {"batch_size": 0}], ids=repr
)
def test_counter_verify_refuses_bad_arguments(kwargs):
    with pytest.raises(InvalidRequest):
        verifier.verify(**kwargs)


@pytest.mark.parametrize("task_ids", ["a-task-id", [None], [""], 5])
def test_cancelling_parked_tasks_refuses_bad_ids(task_ids):
    with pytest.raises(InvalidRequest):
        parking.cancel(task_ids)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"release_orphans": 0},
        {"release_orphans": -60},
        {"clean_released": math.nan},
        {"clean_history": math.inf},
        {"wake_parked": "1m"},
        {"wake_parked": True},
        {"clean_history": timedelta(0)},
        {"queue": ""},
        {"queue": 5},
    ],
    ids=repr,
)
def test_beat_schedule_refuses_bad_intervals_and_queues(kwargs):
    with pytest.raises(InvalidRequest, match=next(iter(kwargs))):
        beat_schedule(**kwargs)


# --- settings: checked when read, by the system check's own rules ------------------

BAD_SETTINGS = [
    ("LOCK_WAIT_TIMEOUT", "soon"),
    ("LOCK_WAIT_TIMEOUT", math.inf),
    ("LOCK_WAIT_TIMEOUT", 10**7),  # past PostgreSQL's lock_timeout
    ("LOCK_WAIT_TIMEOUT", 0.0005),  # 0 ms on PostgreSQL: no bound at all
    ("PRELOCK_TIMEOUT", -1),
    ("PRELOCK_TIMEOUT", 1e12),  # past threading.TIMEOUT_MAX
    ("RETRY_ATTEMPTS", "many"),
    ("RETRY_ATTEMPTS", 0),
    ("CLEANUP_BATCH_SIZE", -3),
    ("CLEANUP_BATCH_SIZE", 2.5),
    ("STALENESS_LIMIT", "1d"),
    ("STALENESS_LIMIT", math.inf),
    ("RELEASED_RETENTION", timedelta(days=10**6)),
    ("HISTORY_RETENTION", 0),
    ("MEMBER_IDLE_LIMIT", timedelta(seconds=-1)),
    ("PARKED_REPUBLISH_AFTER", None),
    ("LEASE", 0),
    ("LEASE", "60s"),
    ("LEASE", timedelta(seconds=-5)),
    ("TICKET_LEASE", 1),  # renewed every third of it: below what a waiter's loop keeps up with
    ("TICKET_LEASE", "10s"),
    ("VIEW_STATUS_CODE", "429"),
    ("PARK_TASKS", "false"),
    ("DATABASE", "no-such-alias"),
    ("DATABASE", ["default"]),
    ("SHARDS", {"a-*": "no-such-alias"}),
    ("SHARDS", ["default"]),
    ("LIVENESS_CHECKERS", "a.b"),
    ("LIVENESS_CHECKERS", ["no.such.Checker"]),
    ("LIVENESS_CHECKERS", [5]),
    ("SEMAPHORES", {"x": -1}),
    ("SEMAPHORES", {"x": "3"}),
    ("SEMAPHORES", ["x"]),
    ("METRICS_PER_MEMBER", "export:*"),
    ("METRICS_PER_MEMBER", [5]),
    ("METRICS_PER_MEMBER", ["export:*"]),  # a family declared nowhere (a typo)
]


def setting_errors() -> list[str]:
    return [m.msg for m in static_checks() if m.id and m.id.startswith("django_semaphore.E")]


@pytest.mark.parametrize(("key", "value"), BAD_SETTINGS, ids=repr)
def test_a_malformed_setting_is_refused_when_read_as_the_check_reports_it(settings, key, value):
    settings.DJANGO_SEMAPHORE = {key: value}

    with pytest.raises(ImproperlyConfigured, match=re.escape(f"DJANGO_SEMAPHORE[{key!r}]")) as exc:
        getattr(app_settings, key)
    assert setting_errors() == [str(exc.value)]  # one set of rules, the same words


@pytest.mark.parametrize(
    ("key", "value", "expects"),
    [
        ("LOCK_WAIT_TIMEOUT", "soon", "positive number of seconds"),
        ("RETRY_ATTEMPTS", "many", "an int from 1"),
    ],
)
def test_a_process_that_never_runs_the_checks_is_told_which_setting(
    settings, make_semaphore, key, value, expects
):
    """A Celery worker or a script: was a bare "could not convert string to float"."""
    sem = make_semaphore()
    settings.DJANGO_SEMAPHORE = {key: value}

    with pytest.raises(ImproperlyConfigured, match=f"{key}.*{expects}.*{value}"):
        acquire(sem.name, external_id=unique())
    assert not PermitRequest.objects.exists()


def test_a_settings_value_that_is_not_a_dict_is_refused_when_read(settings):
    settings.DJANGO_SEMAPHORE = "not a dict"
    with pytest.raises(ImproperlyConfigured, match="DJANGO_SEMAPHORE must be a dict") as exc:
        _ = app_settings.RETRY_ATTEMPTS
    assert setting_errors() == [str(exc.value)]


def test_sound_settings_are_read_as_given(settings):
    settings.DJANGO_SEMAPHORE = {
        "LOCK_WAIT_TIMEOUT": 2.5,
        "STALENESS_LIMIT": 3600,
        "HISTORY_RETENTION": timedelta(days=3),
        "SEMAPHORES": {"a": 0, "b:*": {"capacity": 2, "max_members": 5}},
        "METRICS_PER_MEMBER": ("b:*",),
    }
    assert {"b:*"} == app_settings.METRICS_PER_MEMBER
    durations = (app_settings.STALENESS_LIMIT, app_settings.HISTORY_RETENTION)
    assert durations == (timedelta(hours=1), timedelta(days=3))
    assert app_settings.LOCK_WAIT_TIMEOUT == 2.5
    assert app_settings.RETRY_ATTEMPTS == 3  # the default
    assert setting_errors() == []


def test_a_refused_sweep_leaves_no_alias_pinned():
    """While its error is alive (logged, stored, chained) later reads of the
    app's alias must not still see the alias the sweep was visiting."""
    from django_semaphore.routing import pinned_alias

    with pytest.raises(InvalidRequest) as excinfo:
        sweep.clean_history(batch_size=-3)
    assert excinfo.value is not None
    assert pinned_alias.get() is None
