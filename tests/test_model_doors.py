"""Every ORM door that writes a semaphore refuses what set_capacity and
set_window refuse, with InvalidRequest, before anything is written; and the
fencing token of a name not held is a typed error."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from django_semaphore import acquire, permit, release
from django_semaphore.exceptions import (
    InvalidRequest,
    NameNotHeld,
    PermitNotEntered,
    SemaphoreError,
)
from django_semaphore.models import CapacityChange, Semaphore
from tests.conftest import unique

BAD_CAPACITIES = [-1, 2.5, None, "3", True, 2**31, 2**70]
BAD_WINDOWS = [0, -1, 1.5, 86_401, "1", True, timedelta(seconds=0.5), float("nan")]
BAD_NAMES = ["", "   ", "x" * 256, "a\x00b", "\ud800", None, 5]
BAD_FLAGS = [None, "yes", 1]


def create(**fields: Any) -> Semaphore:
    return Semaphore.objects.create(**fields)


def save_new(**fields: Any) -> None:
    Semaphore(**fields).save()


def get_or_create(**fields: Any) -> None:
    Semaphore.objects.get_or_create(name=fields.pop("name"), defaults=fields)


def update_or_create(**fields: Any) -> None:
    Semaphore.objects.update_or_create(name=fields.pop("name"), defaults=fields)


def bulk_create(**fields: Any) -> None:
    Semaphore.objects.bulk_create([Semaphore(name=unique(), capacity=1), Semaphore(**fields)])


CREATING_DOORS = [create, save_new, get_or_create, update_or_create, bulk_create]


def fields_with(**bad: Any) -> dict[str, Any]:
    return {"name": unique(), "capacity": 1, "window": None, **bad}


@pytest.mark.parametrize("door", CREATING_DOORS, ids=lambda door: door.__name__)
@pytest.mark.parametrize(
    "bad",
    [{"capacity": value} for value in BAD_CAPACITIES]
    + [{"window": value} for value in BAD_WINDOWS]
    + [{"name": value} for value in BAD_NAMES]
    + [{"fair": value} for value in BAD_FLAGS],
    ids=repr,
)
@pytest.mark.django_db
def test_every_creating_door_refuses_what_set_capacity_refuses(
    door: Callable[..., Any], bad: dict[str, Any]
):
    count = Semaphore.objects.count()

    with pytest.raises(InvalidRequest):
        door(**fields_with(**bad))

    assert Semaphore.objects.count() == count  # nothing written, bulk's good row neither


@pytest.mark.parametrize(
    ("window", "stored"), [(None, None), (1, 1), (60.0, 60), (timedelta(minutes=1), 60)]
)
@pytest.mark.django_db
def test_the_doors_take_what_set_window_takes(window, stored):
    for door in CREATING_DOORS:
        name = unique()
        door(name=name, capacity=0, window=window)
        assert Semaphore.objects.values_list("capacity", "window").get(name=name) == (0, stored)


@pytest.mark.parametrize(
    "bad", [{"capacity": -1}, {"capacity": 2.5}, {"window": 0}, {"window": 1.5}], ids=repr
)
@pytest.mark.django_db
def test_update_or_create_of_an_existing_row_refuses_it_too(bad):
    name = unique()
    create(name=name, capacity=3)

    with pytest.raises(InvalidRequest):
        update_or_create(name=name, **bad)

    assert Semaphore.objects.values_list("capacity", "window").get(name=name) == (3, None)
    assert not CapacityChange.objects.filter(semaphore__name=name).exists()


@pytest.mark.parametrize(
    "bad", [{"name": value} for value in BAD_NAMES] + [{"fair": value} for value in BAD_FLAGS]
)
@pytest.mark.django_db
def test_saving_or_updating_a_loaded_row_refuses_a_bad_name_or_flag(bad):
    name = unique()
    semaphore = create(name=name, capacity=3)
    for field, value in bad.items():
        setattr(semaphore, field, value)

    with pytest.raises(InvalidRequest):
        semaphore.save()
    with pytest.raises(InvalidRequest):
        Semaphore.objects.filter(name=name).update(**bad)

    assert Semaphore.objects.values_list("name", "fair").get(pk=semaphore.pk) == (name, False)


@pytest.mark.django_db
def test_a_window_of_zero_never_reaches_the_engine():
    """The issue's case: stored, window 0 limited nothing (6 grants at capacity 3)."""
    with pytest.raises(InvalidRequest, match="window"):
        create(name=unique(), capacity=3, window=0)


# --- the fencing token of a name not held -----------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_token_of_a_name_not_held_is_a_typed_key_error(make_semaphore):
    held = make_semaphore(capacity=1)
    request = acquire(held.name, external_id=unique("key"))
    try:
        with pytest.raises(NameNotHeld) as raised:
            request.token("not-held")
    finally:
        release(request.external_id)

    error = raised.value
    assert isinstance(error, SemaphoreError)
    assert isinstance(error, KeyError)
    assert (error.name, error.held) == ("not-held", [held.name])
    assert repr(held.name) in str(error)
    assert "'not-held'" in str(error)
    restored = pickle.loads(pickle.dumps(error))
    assert str(restored) == str(error)


@pytest.mark.parametrize("name", [None, 3, ["a"]])
@pytest.mark.django_db(transaction=True)
def test_the_token_of_a_name_that_is_no_str_is_the_same_error(make_semaphore, name):
    held = make_semaphore(capacity=1)
    with permit(held.name) as grant, pytest.raises(NameNotHeld):
        grant.token(name)


@pytest.mark.django_db(transaction=True)
def test_the_permit_outside_its_block_says_so(make_semaphore):
    held = make_semaphore(capacity=1)
    grant = permit(held.name)

    with pytest.raises(PermitNotEntered) as raised:
        grant.token(held.name)

    assert isinstance(raised.value, SemaphoreError)
    assert isinstance(raised.value, RuntimeError)
    with grant:
        assert grant.token(held.name) >= 1
        with pytest.raises(NameNotHeld, match=repr(held.name)):
            grant.token("other")
