from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connections, transaction
from django.db.models.signals import post_save

from django_semaphore import acquire, set_capacity
from django_semaphore.exceptions import InvalidRequest, SemaphoreExhausted, SemaphoreNotFound
from django_semaphore.limits import Limit
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


def test_set_capacity_changes_the_window_with_it_when_given(make_semaphore):
    sem = make_semaphore(capacity=2)
    with pytest.raises(InvalidRequest, match="window"):
        set_capacity(sem.name, 5, window=0)

    set_capacity(sem.name, 5, window=timedelta(minutes=1), reason="5/min")
    set_capacity(sem.name, 6)  # the window stays

    sem.refresh_from_db()
    assert (sem.capacity, sem.window) == (6, 60)
    changes = CapacityChange.objects.filter(semaphore=sem).order_by("id")
    assert [(c.old_limit, c.new_limit, c.reason) for c in changes] == [
        (Limit(2), Limit(5, 60), "5/min"),
        (Limit(5, 60), Limit(6, 60), ""),
    ]


def by_command(sem: Semaphore, client: Any, settings: Any) -> None:
    call_command("semaphore_capacity", sem.name, "3/h", stdout=StringIO())


def by_sync(sem: Semaphore, client: Any, settings: Any) -> None:
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": {sem.name: {"rate": "3/h"}}}
    call_command("semaphore_sync", "--apply", stdout=StringIO())


def by_admin(sem: Semaphore, client: Any, settings: Any) -> None:
    from tests.test_admin import semaphore_url, staff

    client.force_login(staff("view_semaphore", "change_semaphore"))
    form = {"capacity": "3", "window": "3600", "reason": "a rate"}
    assert client.post(semaphore_url(sem), form).status_code == 302


@pytest.mark.parametrize("door", [by_command, by_sync, by_admin])
def test_capacity_and_window_change_as_one(
    make_semaphore, client, settings, door: Callable[..., None]
):
    """Capacity 2, both held, becomes 3/h while a thread acquires in a loop:
    it is granted 3, never a permit of the 3-wide concurrency limit that
    the capacity alone would make (a window counts from when it is set, so
    such a permit would be a 4th grant in the hour); one history record."""
    sem = make_semaphore(capacity=2)
    for _ in range(2):
        acquire(sem.name, external_id=unique("holder"))
    granted: list[str] = []
    errors: list[BaseException] = []
    attempts = threading.Semaphore(0)
    got_one, stop = threading.Event(), threading.Event()

    def acquirer() -> None:
        try:
            while not stop.is_set():
                try:
                    granted.append(acquire(sem.name, external_id=unique("k")).external_id)
                    got_one.set()
                except SemaphoreExhausted:
                    pass
                attempts.release()
                stop.wait(0.002)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    def recorded(sender: Any, instance: CapacityChange, using: str, **kwargs: Any) -> None:
        # Once the (first) change commits, the acquirer gets its chance.
        if instance.semaphore_id == sem.pk:
            transaction.on_commit(lambda: got_one.wait(5), using=using)

    post_save.connect(recorded, sender=CapacityChange)
    thread = threading.Thread(target=acquirer, daemon=True)
    thread.start()
    try:
        door(sem, client, settings)
        while attempts.acquire(blocking=False):  # those made before it returned
            pass
        for _ in range(50):  # the acquirer goes on under the new limit
            assert attempts.acquire(timeout=10)
    finally:
        stop.set()
        thread.join(10)
        post_save.disconnect(recorded, sender=CapacityChange)
    assert not thread.is_alive()
    assert not errors, errors

    assert len(granted) == 3
    changes = CapacityChange.objects.filter(semaphore=sem)
    assert [(c.old_capacity, c.new_capacity, c.old_window, c.new_window) for c in changes] == [
        (2, 3, None, 3600)
    ]


def test_declared_semaphores_are_created_after_migrate():
    # tests/settings.py declares "declared-in-settings": 4; migrate ran at setup.
    assert Semaphore.objects.get(name="declared-in-settings").capacity == 4
