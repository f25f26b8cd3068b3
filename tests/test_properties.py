"""Property-based bad-input tests (hypothesis) over the public API.

Whatever is passed -- random names, counts, keys, ttl and timeout values,
unicode, over-long and empty strings, wrong types -- every call either
succeeds as SPEC says or raises a ``django_semaphore.exceptions`` error; and
the database is never left with a half-written request.
"""

from __future__ import annotations

import math
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db.models import Count, Q, Sum
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from django_semaphore import acquire, fencing, permit, release, renew
from django_semaphore.exceptions import SemaphoreError
from django_semaphore.models import Permit, PermitRequest, Semaphore, State
from django_semaphore.outcomes import ReleaseOutcome

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


@PROFILE
@given(resource=st.one_of(texts, junk), token=st.one_of(st.integers(), junk))
def test_fencing_advance_accepts_or_raises_an_app_error(resource, token):
    call(fencing.advance, resource, token)


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
