"""Property-based bad-input tests (hypothesis) over the public API.

Whatever is passed -- random names, counts, keys, ttl and timeout values,
unicode, over-long and empty strings, wrong types -- every call either
succeeds as SPEC says or raises a ``django_semaphore.exceptions`` error; and
the database is never left with a half-written request.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.checks import ERROR
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db.models import Count, Q, Sum
from django.test import override_settings
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from django_semaphore import (
    acquire,
    fencing,
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
from django_semaphore.checks import check_settings
from django_semaphore.conf import DEFAULTS, app_settings
from django_semaphore.engine import verifier
from django_semaphore.exceptions import InvalidRequest, SemaphoreError
from django_semaphore.models import CapacityChange, FencingMark, Permit, PermitRequest, Semaphore
from django_semaphore.states import ReleaseOutcome, ReleaseReason, State
from django_semaphore.validation import MAX_COUNT, MAX_TOKEN

pytestmark = pytest.mark.django_db(transaction=True)

EXISTING = {"prop-a": 2, "prop-b": 1, "Prop-Ü": 3}

PROFILE = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Text as users and attackers send it: any unicode (emoji, NUL, right-to-left,
# combining marks), blank, huge, and the names that do exist in other cases.
texts = st.one_of(
    st.text(max_size=20),
    st.text(min_size=250, max_size=300),
    st.sampled_from(["", " ", "\t\n", "\x00", "a\x00b", "💥" * 64, "e\u0301", *EXISTING]),
    st.sampled_from([name.upper() for name in EXISTING] + [f"{n} " for n in EXISTING]),
)
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.binary(max_size=10),
    st.lists(st.integers(), max_size=3),
    st.just(object()),
)
hashable_junk = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.binary(max_size=10)
)
counts = st.one_of(st.integers(min_value=-3, max_value=5), st.integers(), junk)
names = st.one_of(
    texts,
    st.lists(st.one_of(texts, junk), max_size=4),
    st.dictionaries(st.one_of(texts, hashable_junk), counts, max_size=4),
    st.sets(texts, max_size=3),
    junk,
)
keys = st.one_of(texts, junk)
durations = st.one_of(
    st.none(),
    st.integers(min_value=-5, max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.timedeltas(min_value=timedelta(days=-2), max_value=timedelta(days=2)),
    junk,
)
# Timeouts kept short (or invalid): a property run must not sit waiting.
timeouts = st.one_of(
    st.just(0),
    st.floats(min_value=-1, max_value=0.02),
    st.sampled_from([math.nan, math.inf, -math.inf, -1, timedelta(seconds=-1), timedelta(0)]),
    junk.filter(lambda value: not isinstance(value, int | float) or value <= 0.02),
)


@pytest.fixture
def semaphores(db) -> None:
    for name, capacity in EXISTING.items():
        Semaphore.objects.get_or_create(name=name, defaults={"capacity": capacity})


def assert_database_consistent() -> None:
    """No half-written request, nothing over capacity, states agree."""
    assert not PermitRequest.objects.annotate(n=Count("permits")).filter(n=0).exists(), (
        "a request without permits"
    )
    assert not Permit.objects.filter(
        state=State.ACQUIRED, request__state=State.RELEASED
    ).exists(), "a released request still holds a permit"
    for semaphore in Semaphore.objects.annotate(
        used=Sum("permits__count", filter=Q(permits__state=State.ACQUIRED))
    ):
        assert (semaphore.used or 0) <= semaphore.capacity, semaphore.name


def call(function: Any, *args: Any, **kwargs: Any) -> tuple[Any, BaseException | None]:
    """The result, or the error -- which must be one of the app's."""
    try:
        return function(*args, **kwargs), None
    except SemaphoreError as exc:
        return None, exc
    # Anything else (TypeError, KeyError, a driver's error) fails the property.


def demand_of(request: PermitRequest) -> dict[str, int]:
    return dict(request.permits.values_list("semaphore__name", "count"))


def expected_demand(names: Any) -> dict[str, int]:
    if isinstance(names, str):
        return {names: 1}
    if isinstance(names, dict):
        return dict(names)
    return dict.fromkeys(names, 1)


@PROFILE
@given(names=names, key=keys, owner=st.one_of(texts, junk), ttl=durations, timeout=timeouts)
def test_acquire_succeeds_per_spec_or_raises_an_app_error(
    semaphores, names, key, owner, ttl, timeout
):
    request, error = call(acquire, names, external_id=key, owner=owner, ttl=ttl, timeout=timeout)

    if error is None:
        assert request.state == State.ACQUIRED
        assert request.external_id == key
        assert demand_of(request) == expected_demand(names)
        assert set(request.fencing_tokens) == set(expected_demand(names))
        assert release(key) is ReleaseOutcome.RELEASED
    assert_database_consistent()


@PROFILE
@given(key=keys, ttl=durations)
def test_release_and_renew_answer_or_raise_an_app_error(semaphores, key, ttl):
    outcome, _ = call(release, key)
    assert outcome is None or isinstance(outcome, ReleaseOutcome)
    renewed, _ = call(renew, key, ttl)
    assert renewed is None or renewed.external_id == key
    assert_database_consistent()


def is_int_from(value: Any, least: int, most: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= most


# Around the ends of the token column (0 .. 2**63-1) and far past them.
tokens = st.one_of(
    st.integers(),
    st.integers(min_value=MAX_TOKEN - 3, max_value=2**80),
    st.integers(min_value=-(2**80), max_value=3),
    junk,
)


@PROFILE
@given(resource=st.one_of(texts, junk), token=tokens)
def test_fencing_advance_accepts_or_raises_an_app_error(resource, token):
    marks = dict(FencingMark.objects.values_list("resource", "token"))
    _, error = call(fencing.advance, resource, token)
    if not is_int_from(token, 0, MAX_TOKEN):
        assert isinstance(error, InvalidRequest)
    if isinstance(error, InvalidRequest):
        assert dict(FencingMark.objects.values_list("resource", "token")) == marks


@PROFILE
@given(names=names, key=st.one_of(st.none(), keys), ttl=durations, timeout=timeouts)
def test_permit_context_manager_enters_or_raises_an_app_error(semaphores, names, key, ttl, timeout):
    def use() -> None:
        with permit(names, external_id=key, ttl=ttl, timeout=timeout, heartbeat=False) as grant:
            assert grant.request is not None
            assert demand_of(grant.request) == expected_demand(names)

    call(use)
    assert not PermitRequest.objects.filter(state=State.ACQUIRED).exists(), "permit() leaked"
    assert_database_consistent()


@PROFILE
@given(first=st.sampled_from(["Key-1", "key-1", "KEY-1", "key-1 ", "kéy-1"]), data=st.data())
def test_keys_that_differ_never_share_a_request(semaphores, first, data):
    """Two different keys are two requests, even where the database's
    collation calls them equal (case, accents, trailing spaces on MySQL)."""
    second = data.draw(st.sampled_from(["Key-1", "key-1", "KEY-1", "key-1 ", "kéy-1"]))
    assume(first != second)
    # Examples share one database (no rollback between them): fresh keys each.
    suffix = uuid.uuid4().hex
    first, second = f"{suffix}{first}", f"{suffix}{second}"
    held, error = call(acquire, "prop-a", external_id=first)
    assert error is None
    other, error = call(acquire, "prop-a", external_id=second)
    if error is None:
        assert other.pk != held.pk, f"{second!r} was given {first!r}'s permit"
    outcome, _ = call(release, second)
    assert outcome is not ReleaseOutcome.RELEASED or other is not None, (
        f"release({second!r}) ended {first!r}'s permit"
    )
    assert PermitRequest.objects.get(pk=held.pk).state == State.ACQUIRED
    assert release(first) is ReleaseOutcome.RELEASED
    assert_database_consistent()


@PROFILE
@given(name=st.sampled_from([n.upper() for n in EXISTING] + [f"{n} " for n in EXISTING]))
def test_a_name_that_is_not_a_semaphore_is_not_found(semaphores, name):
    """``PROP-A`` is not ``prop-a``, though a case-insensitive collation says so."""
    request, _error = call(acquire, name, external_id=uuid.uuid4().hex)
    if request is not None:
        # Granted on the row the collation matched: it must at least be
        # reported under the name that was asked for, and be released.
        assert set(request.fencing_tokens) == {name}
        release(request.external_id)
    assert_database_consistent()


@pytest.mark.parametrize("text", ["\x00", "a\x00b", "\ud800", "💥"])
def test_odd_characters_in_keys_and_names_are_handled(semaphores, text):
    """NUL (PostgreSQL refuses it in text), a lone surrogate (not encodable
    as UTF-8), a 4-byte emoji (utf8mb4): an answer, never a driver error."""
    for args in ((text, {"external_id": uuid.uuid4().hex}), ("prop-a", {"external_id": text})):
        request, _ = call(acquire, args[0], **args[1])
        if request is not None:
            release(request.external_id)
    call(release, text)
    call(renew, text)
    call(fencing.advance, text, 1)
    assert_database_consistent()


def test_special_float_values_are_refused_before_any_write(semaphores):
    for bad in (math.nan, math.inf, -math.inf):
        for kwargs in ({"ttl": bad}, {"timeout": bad}):
            _, error = call(acquire, "prop-a", external_id=uuid.uuid4().hex, **kwargs)
            assert error is not None
    assert not PermitRequest.objects.exists()


# --- minimal cases of what the properties above found on MariaDB ---------------
# MariaDB/MySQL compare with the column's collation (utf8mb4_unicode_ci here,
# utf8mb4_0900_ai_ci by default on MySQL 8): case- and accent-insensitive, and
# blind to trailing spaces. Keys and names are exact strings to their callers.


def test_a_case_variant_name_is_not_found_not_a_crash(semaphores):
    _, error = call(acquire, "PROP-A", external_id=uuid.uuid4().hex)

    assert error is not None
    assert "PROP-A" in str(error)


def test_a_case_variant_key_neither_joins_nor_releases_another_callers_permit(semaphores):
    mine = acquire("prop-a", external_id="job-7")

    theirs, _ = call(acquire, "prop-a", external_id="JOB-7")  # its own permit, or refused
    call(release, "JOB-7")

    assert theirs is None or theirs.pk != mine.pk, "JOB-7 was handed job-7's permit"
    assert PermitRequest.objects.get(pk=mine.pk).state == State.ACQUIRED, (
        "release('JOB-7') ended job-7's permit"
    )
    assert release("job-7") is ReleaseOutcome.RELEASED


# --- the other entry points: each answers, or refuses with the app's error ------


@PROFILE
@given(
    name=st.one_of(texts, junk),
    capacity=counts,
    reason=st.one_of(texts, junk),
    changed_by=st.one_of(st.none(), junk),
)
def test_set_capacity_changes_or_refuses_without_a_trace(
    semaphores, name, capacity, reason, changed_by
):
    before = dict(Semaphore.objects.values_list("name", "capacity"))
    history = CapacityChange.objects.count()
    semaphore, error = call(set_capacity, name, capacity, reason=reason, changed_by=changed_by)
    if error is None:
        assert semaphore.capacity == capacity
    else:
        assert dict(Semaphore.objects.values_list("name", "capacity")) == before
        assert CapacityChange.objects.count() == history
    assert_database_consistent()


flags = st.one_of(st.booleans(), st.none(), st.integers(0, 1), st.sampled_from(["no", "yes"]))


@PROFILE
@given(
    names=st.one_of(names, st.just(lambda *args, **kwargs: "prop-a")),
    count=counts,
    ttl=durations,
    timeout=durations,
    retry_after=st.one_of(st.integers(), junk),
    park=flags,
)
def test_holds_permit_decorates_or_refuses_at_once(names, count, ttl, timeout, retry_after, park):
    """Pure: refused when decorating (never on the first call), nothing else."""
    decorate, error = call(
        holds_permit,
        names,
        count=count,
        ttl=ttl,
        timeout=timeout,
        retry_after=retry_after,
        park=park,
    )
    if error is None:
        assert callable(decorate)
        assert is_int_from(count, 1, MAX_COUNT)
        assert is_int_from(retry_after, 0, 2**31 - 1)
        assert park is None or isinstance(park, bool)
    else:
        assert isinstance(error, InvalidRequest)


batch_sizes = st.one_of(st.none(), st.integers(), st.integers(-3, 3), junk)
time_budgets = st.one_of(
    st.none(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.timedeltas(),
    junk,
)


def is_time_budget(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, int) and not isinstance(value, bool):
        return value >= 0
    if isinstance(value, float):
        return math.isfinite(value) and value >= 0
    return isinstance(value, timedelta) and value >= timedelta(0)


@PROFILE
@given(
    sweeper=st.sampled_from(
        [
            sweep.release_orphans,
            sweep.clean_released,
            sweep.clean_history,
            sweep.clean_idle_members,
            sweep.clean_tickets,
        ]
    ),
    batch_size=batch_sizes,
    time_budget=time_budgets,
    dry_run=st.booleans(),
)
def test_sweeps_run_or_refuse_their_limits(semaphores, sweeper, batch_size, time_budget, dry_run):
    _, error = call(sweeper, batch_size=batch_size, time_budget=time_budget, dry_run=dry_run)
    sound = (batch_size is None or is_int_from(batch_size, 1, MAX_COUNT)) and is_time_budget(
        time_budget
    )
    assert (error is None) == sound, error
    assert error is None or isinstance(error, InvalidRequest)
    assert_database_consistent()


@PROFILE
@given(
    keys=st.one_of(texts, st.lists(st.one_of(texts, junk), max_size=3), junk),
    reason=st.one_of(st.none(), st.sampled_from(ReleaseReason.values), texts, junk),
)
def test_force_release_releases_all_it_is_given_or_nothing(semaphores, keys, reason):
    held = acquire("prop-a", external_id=uuid.uuid4().hex)
    given_keys = [*keys, held.external_id] if isinstance(keys, list) else keys
    outcomes, error = call(force_release, given_keys, reason)
    held.refresh_from_db()
    if error is None:
        assert set(outcomes) == set(given_keys)
        assert held.state == State.RELEASED
        assert held.release_reason == (reason or ReleaseReason.ADMIN)
    else:
        assert held.state == State.ACQUIRED
        release(held.external_id)
    assert_database_consistent()


@PROFILE
@given(
    names=st.one_of(st.none(), texts, st.lists(st.one_of(texts, junk), max_size=3), junk),
    batch_size=batch_sizes,
)
def test_counter_verify_answers_or_refuses(semaphores, names, batch_size):
    drifts, error = call(verifier.verify, names, batch_size=batch_size)
    assert error is not None or drifts == []


@PROFILE
@given(task_ids=st.one_of(texts, st.lists(st.one_of(texts, junk), max_size=3), junk))
def test_cancelling_parked_tasks_answers_or_refuses(task_ids):
    dropped, error = call(parking.cancel, task_ids)
    assert error is not None or dropped == 0


intervals = st.one_of(
    st.none(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.timedeltas(),
    junk,
)


@PROFILE
@given(
    every=st.fixed_dictionaries(
        {},
        optional={
            "release_orphans": intervals,
            "clean_released": intervals,
            "clean_history": intervals,
            "wake_parked": intervals,
        },
    ),
    queue=st.one_of(st.none(), texts, junk),
)
def test_beat_schedule_is_built_or_refused_in_the_settings_file(every, queue):
    schedule, error = call(beat_schedule, **every, queue=queue)
    if error is None:
        for entry in schedule.values():
            assert entry["schedule"] > timedelta(0)
            assert entry["options"]["expires"] > 0


# --- commands: any text answers with output or a CommandError ------------------------

option_texts = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["-3", "0", "1", " 2 ", "2.5", "1e3", "nan", "inf", "-inf", "1e400", "many"]),
    st.integers().map(str),
)


@PROFILE
@given(batch_size=option_texts, time_budget=option_texts)
def test_sweep_command_runs_or_names_the_option_it_refuses(semaphores, batch_size, time_budget):
    error: CommandError | None = None
    try:
        call_command(
            "semaphore_sweep",
            "--dry-run",
            f"--batch-size={batch_size}",
            f"--time-budget={time_budget}",
            stdout=StringIO(),
        )
    except CommandError as exc:
        error = exc
    try:
        size_ok = 1 <= int(batch_size) <= MAX_COUNT
    except ValueError:
        size_ok = False
    try:
        budget = float(time_budget)
        budget_ok = math.isfinite(budget) and budget >= 0
    except ValueError:
        budget_ok = False
    assert (error is None) == (size_ok and budget_ok), error
    if not size_ok:
        assert "--batch-size" in str(error)
    elif not budget_ok:
        assert "--time-budget" in str(error)
    assert_database_consistent()


@PROFILE
@given(
    command=st.sampled_from(
        ["semaphore_create", "semaphore_capacity", "semaphore_status", "semaphore_release"]
    ),
    args=st.lists(st.one_of(texts, option_texts), max_size=3),
)
def test_commands_answer_or_raise_a_command_error(semaphores, command, args):
    # Anything but a CommandError (a driver's error, a ValueError) fails the property.
    with contextlib.suppress(CommandError):
        call_command(command, *args, stdout=StringIO(), stderr=StringIO())
    assert_database_consistent()


# --- settings: read if and only if the system check passes them ------------------------

setting_values = st.one_of(
    junk,
    texts,
    st.integers(min_value=-5, max_value=700),
    st.floats(allow_nan=True, allow_infinity=True),
    st.timedeltas(),
    st.sampled_from(["default", "semaphores", "no-such-alias", 429, 503, 2**31, 10**7]),
    st.dictionaries(texts, st.one_of(st.integers(-2, 5), texts, junk), max_size=3),
    st.dictionaries(
        st.sampled_from(["a:*", "b"]),
        st.dictionaries(
            st.sampled_from(["capacity", "max_members", "typo"]), st.integers(-1, 3), max_size=2
        ),
        max_size=2,
    ),
)
# Imported by the check and by the read: never random dotted paths.
checker_values = st.one_of(
    junk,
    st.lists(
        st.sampled_from(
            ["django_semaphore.liveness.CeleryTaskChecker", "no.such.Checker", "nodots", 5, None]
        ),
        max_size=2,
    ),
)


@PROFILE
@given(key=st.sampled_from(sorted(DEFAULTS)), data=st.data())
def test_a_setting_is_read_if_and_only_if_the_system_check_passes_it(key, data):
    value = data.draw(checker_values if key == "LIVENESS_CHECKERS" else setting_values)
    with override_settings(DJANGO_SEMAPHORE={key: value}):
        errors = [message.msg for message in check_settings() if message.level >= ERROR]
        if not errors:
            getattr(app_settings, key)
            return
        with pytest.raises(ImproperlyConfigured) as refused:
            getattr(app_settings, key)
        assert str(refused.value) == " ".join(errors)
