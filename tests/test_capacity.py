from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.db import transaction

from django_semaphore import acquire, set_capacity
from django_semaphore.exceptions import SemaphoreExhausted, SemaphoreNotFound
from django_semaphore.models import CapacityChange, Semaphore
from tests.conftest import unique

pytestmark = pytest.mark.django_db(transaction=True)


def test_capacity_change_is_recorded_with_who_and_why(make_semaphore):
    sem = make_semaphore(capacity=2)
    staff = get_user_model().objects.create_user("ops")

    set_capacity(sem.name, 5, changed_by=staff, reason="more workers")

    sem.refresh_from_db()
    assert sem.capacity == 5
    change = CapacityChange.objects.get(semaphore=sem)
    assert (change.old_capacity, change.new_capacity) == (2, 5)
    assert change.changed_by == staff
    assert change.reason == "more workers"
    assert change.changed_at is not None


def test_unchanged_capacity_writes_no_history(make_semaphore):
    sem = make_semaphore(capacity=2)
    set_capacity(sem.name, 2)
    assert not CapacityChange.objects.filter(semaphore=sem).exists()


def test_lowering_below_use_keeps_holders_and_blocks_new_grants(make_semaphore):
    sem = make_semaphore(capacity=3)
    held = [acquire(sem.name, external_id=unique()) for _ in range(3)]

    set_capacity(sem.name, 1)

    assert Semaphore.objects.with_usage().get(pk=sem.pk).in_use == 3
    assert all(r.permits.get().state == "ACQUIRED" for r in held)
    with pytest.raises(SemaphoreExhausted):
        acquire(sem.name, external_id=unique())


def test_unknown_semaphore():
    with pytest.raises(SemaphoreNotFound):
        set_capacity(unique(), 3)


def test_capacity_change_joins_the_callers_transaction(make_semaphore):
    sem = make_semaphore(capacity=2)

    def change_then_fail() -> None:
        with transaction.atomic():
            set_capacity(sem.name, 9)
            raise RuntimeError("the admin form failed")

    with pytest.raises(RuntimeError):
        change_then_fail()
    sem.refresh_from_db()
    assert sem.capacity == 2
    assert not CapacityChange.objects.filter(semaphore=sem).exists()


def test_declared_semaphores_are_created_after_migrate():
    # tests/settings.py declares "declared-in-settings": 4; migrate ran at setup.
    assert Semaphore.objects.get(name="declared-in-settings").capacity == 4
