"""Bad input is refused with a typed error before anything is written."""

from __future__ import annotations

from datetime import timedelta

import pytest

from django_semaphore import acquire, release, renew
from django_semaphore.exceptions import InvalidRequest, SemaphoreError
from django_semaphore.models import PermitRequest, Semaphore
from tests.conftest import unique

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
        {"timeout": -1},
        {"timeout": "5"},
        {"timeout": float("inf")},
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
        Semaphore.objects.set_capacity(sem.name, capacity)
    sem.refresh_from_db()
    assert sem.capacity == 2
