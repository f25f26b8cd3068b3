"""The routines and the general grant are one rule: the same random
histories -- acquires with and without keys taken, of one
name and several, releases, renewals, expiries, capacity changes -- run
through the routines (MariaDB, PostgreSQL) and through the general grant
alone, and through SQLite, give the same grants, refusals, fencing tokens
and counters. On SQLite all three runs take the general grant."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connections
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_semaphore import acquire, release, renew, routing
from django_semaphore.api import set_capacity
from django_semaphore.engine.statements.one_trip import OneTripStatements
from django_semaphore.exceptions import SemaphoreError
from django_semaphore.models import PermitRequest, Semaphore
from tests.conftest import unique

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default", "sqlite"]),
    pytest.mark.differential,
]

CAPACITIES = (1, 2, 3)  # of the history's semaphores, by index
KEYS = [f"k{i}" for i in range(6)]

demands = st.dictionaries(
    st.sampled_from(range(len(CAPACITIES))), st.integers(1, 3), min_size=1, max_size=3
)
steps = st.one_of(
    st.tuples(st.just("acquire"), demands, st.sampled_from(KEYS)),
    st.tuples(st.just("release"), st.sampled_from(KEYS)),
    st.tuples(st.just("renew"), st.sampled_from(KEYS)),
    st.tuples(st.just("expire"), st.sampled_from(KEYS)),
    st.tuples(st.just("capacity"), st.sampled_from(range(len(CAPACITIES))), st.integers(1, 4)),
)
histories = st.lists(steps, min_size=4, max_size=24)


def run(
    history: list[tuple[Any, ...]], alias: str, general: bool, monkeypatch: pytest.MonkeyPatch
) -> list:
    """What each step of ``history`` answered on ``alias``, and the counters
    at the end, on semaphores of its own (names by index)."""
    names = [unique("diff") for _ in CAPACITIES]
    for name, capacity in zip(names, CAPACITIES, strict=True):
        Semaphore.objects.using(alias).create(name=name, capacity=capacity)
    keys = {key: unique(key) for key in KEYS}
    with monkeypatch.context() as patch, routing.on_alias(alias):
        if general:
            patch.setattr(OneTripStatements, "applies", lambda self: False)
        seen: list[Any] = [answer(step, names, keys, alias) for step in history]
    for name in names:
        sem = Semaphore.objects.using(alias).get(name=name)
        seen.append((sem.in_use, sem.fencing_counter, sem.capacity))
    return seen


def answer(step: tuple[Any, ...], names: list[str], keys: dict[str, str], alias: str) -> Any:
    kind, *args = step
    try:
        if kind == "acquire":
            demand, key = args
            demand = {names[i]: n for i, n in demand.items()}
            request = acquire(demand, external_id=keys[key], ttl=60)
            tokens = request.fencing_tokens
            return sorted((names.index(name), token) for name, token in tokens.items())
        if kind == "release":
            return release(keys[args[0]]).value
        if kind == "renew":
            return renew(keys[args[0]]).state
        if kind == "expire":
            return (
                PermitRequest.objects.using(alias)
                .filter(external_id=keys[args[0]])
                .update(expires_at=timezone.now() - timedelta(seconds=1))
            )
        index, capacity = args
        return set_capacity(names[index], capacity).capacity
    except SemaphoreError as error:
        lacking = sorted(names.index(name) for name in getattr(error, "names", ()) or ())
        return type(error).__name__, lacking


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(history=histories)
def test_the_routines_answer_as_the_general_grant_and_sqlite(history, monkeypatch):
    routines = run(history, "default", general=False, monkeypatch=monkeypatch)
    general = run(history, "default", general=True, monkeypatch=monkeypatch)
    on_sqlite = run(history, "sqlite", general=True, monkeypatch=monkeypatch)
    assert routines == general
    assert general == on_sqlite
    connections["default"].close()  # a fresh session for the next history's settings
