"""Nothing a Django developer does with the models corrupts a semaphore (issue 18):
each ORM call is either safe or refused with a typed error naming the call to use."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connections
from django.urls import reverse
from django.utils import timezone

from django_semaphore import acquire, release, set_capacity
from django_semaphore.exceptions import (
    InvalidRequest,
    PermitHeld,
    SemaphoreError,
    SemaphoreNotFound,
    UnsafeWrite,
)
from django_semaphore.models import CapacityChange, Permit, PermitRequest, Semaphore
from django_semaphore.states import State
from tests.conftest import behind_the_engine, unique

pytestmark = pytest.mark.django_db(transaction=True)


def grant(sem: Semaphore) -> PermitRequest:
    return acquire(sem.name, external_id=unique("key"))


def token(request: PermitRequest, sem: Semaphore) -> int:
    return request.token(sem.name)


# --- Semaphore.save() ----------------------------------------------------------------


def test_a_stale_save_writes_back_no_engine_owned_column(make_semaphore):
    sem = make_semaphore(capacity=3)
    stale = Semaphore.objects.get(pk=sem.pk)  # fencing_counter 0, queued_until None
    first = grant(sem)
    release(first.external_id)
    later = timezone.now() + timedelta(hours=1)
    with behind_the_engine():  # a fair waiter's deadline, as fair mode writes it
        Semaphore.objects.filter(pk=sem.pk).update(queued_until=later)

    stale.fair = True
    stale.save()

    fresh = Semaphore.objects.get(pk=sem.pk)
    assert fresh.fair is True
    assert fresh.fencing_counter == 1
    assert fresh.queued_until == later
    # The next grant neither collides with the token already issued nor re-issues it.
    assert token(grant(sem), sem) == 2


def test_a_capacity_changed_by_save_is_recorded_like_set_capacity(make_semaphore):
    sem = make_semaphore(capacity=3)
    stale = Semaphore.objects.get(pk=sem.pk)
    set_capacity(sem.name, 5, reason="autoscaler")

    stale.capacity = 1
    stale.save()

    assert Semaphore.objects.get(pk=sem.pk).capacity == 1
    change = CapacityChange.objects.filter(semaphore=sem).first()
    assert change is not None
    # The old value is the one read under the row lock, not the stale instance's.
    assert (change.old_capacity, change.new_capacity) == (5, 1)
    assert (change.changed_by, change.reason) == (None, "")
    assert CapacityChange.objects.filter(semaphore=sem).count() == 2


def test_a_stale_save_never_undoes_someone_elses_capacity_change(make_semaphore):
    sem = make_semaphore(capacity=3)
    stale = Semaphore.objects.get(pk=sem.pk)
    set_capacity(sem.name, 7)

    stale.fair = True
    stale.save()
    stale.save(update_fields=["capacity"])  # unchanged on the instance: nothing to write

    assert Semaphore.objects.get(pk=sem.pk).capacity == 7
    assert CapacityChange.objects.filter(semaphore=sem).count() == 1


def test_saving_twice_records_one_change(make_semaphore):
    sem = make_semaphore(capacity=3)
    sem.capacity = 4
    sem.save()
    sem.save()
    sem.refresh_from_db()
    sem.save()
    assert list(CapacityChange.objects.filter(semaphore=sem).values_list("new_capacity")) == [(4,)]


def test_update_or_create_changes_capacity_through_the_same_path(make_semaphore):
    sem = make_semaphore(capacity=3)
    grant(sem)
    Semaphore.objects.update_or_create(name=sem.name, defaults={"capacity": 9})
    assert Semaphore.objects.get(pk=sem.pk).capacity == 9
    assert CapacityChange.objects.get(semaphore=sem).new_capacity == 9
    assert Semaphore.objects.get(pk=sem.pk).fencing_counter == 1


def test_a_hand_built_instance_with_an_existing_pk_keeps_the_counters(make_semaphore):
    sem = make_semaphore(capacity=2)
    grant(sem)

    Semaphore(pk=sem.pk, name=sem.name, capacity=4, created_at=sem.created_at).save()

    fresh = Semaphore.objects.get(pk=sem.pk)
    assert (fresh.capacity, fresh.fencing_counter) == (4, 1)
    assert CapacityChange.objects.get(semaphore=sem).old_capacity == 2


def test_save_refuses_a_change_to_an_engine_owned_column(make_semaphore):
    sem = make_semaphore()
    grant(sem)
    loaded = Semaphore.objects.get(pk=sem.pk)
    loaded.fencing_counter = 0
    with pytest.raises(UnsafeWrite, match="fencing_counter"):
        loaded.save()
    with pytest.raises(UnsafeWrite, match="fencing_counter"):
        loaded.save(update_fields=["fencing_counter"])
    loaded.refresh_from_db()
    loaded.queued_until = timezone.now()
    with pytest.raises(UnsafeWrite, match="queued_until"):
        loaded.save(update_fields=["fair", "queued_until"])
    assert Semaphore.objects.get(pk=sem.pk).fencing_counter == 1


def test_save_validates_the_capacity_as_set_capacity_does(make_semaphore):
    sem = make_semaphore(capacity=2)
    sem.capacity = 2**40
    with pytest.raises(InvalidRequest):
        sem.save()
    assert Semaphore.objects.get(pk=sem.pk).capacity == 2


def test_creating_stays_as_it_is():
    created = Semaphore.objects.create(name=unique(), capacity=2)
    built = Semaphore(name=unique(), capacity=1, fencing_counter=10)
    built.save()
    assert Semaphore.objects.get(pk=built.pk).fencing_counter == 10  # nothing refers to it yet
    assert token(grant(built), built) == 11
    assert token(grant(created), created) == 1
    assert not CapacityChange.objects.exists()


def test_saving_a_deleted_semaphore(make_semaphore):
    sem = make_semaphore(capacity=2)
    Semaphore.objects.filter(pk=sem.pk).delete()
    with pytest.raises(SemaphoreNotFound):
        sem.save(update_fields=["fair"])
    sem.save()  # saved anew, as Django does
    assert Semaphore.objects.get(pk=sem.pk).capacity == 2


def test_stale_save_during_concurrent_grants(make_semaphore):
    """Threads grant and release while another loads, edits and saves the row:
    tokens stay strictly increasing, no acquire fails, one change is recorded."""
    sem = make_semaphore(capacity=4)
    grants: list[list[int]] = [[] for _ in range(3)]
    errors: list[BaseException] = []
    start = threading.Barrier(4)
    saved = threading.Event()

    def granter(mine: list[int]) -> None:
        try:
            start.wait()
            rounds = 0
            while not saved.is_set() or rounds < 15:
                request = acquire(sem.name, external_id=unique("key"), timeout=10)
                mine.append(request.token(sem.name))
                release(request.external_id)
                rounds += 1
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    def editor() -> None:
        try:
            stale = Semaphore.objects.get(pk=sem.pk)
            start.wait()
            while sum(map(len, grants)) < 10:  # the counter moves on meanwhile
                threading.Event().wait(0.01)
            stale.capacity = 2
            stale.save()
        except BaseException as exc:
            errors.append(exc)
        finally:
            saved.set()
            connections.close_all()

    threads = [threading.Thread(daemon=True, target=granter, args=(mine,)) for mine in grants]
    threads.append(threading.Thread(daemon=True, target=editor))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)

    assert not errors, errors
    for mine in grants:
        assert mine == sorted(set(mine))  # each thread sees its tokens increase
    issued = sorted(t for mine in grants for t in mine)
    assert issued == list(range(1, len(issued) + 1))  # every token once, none skipped
    fresh = Semaphore.objects.get(pk=sem.pk)
    assert (fresh.capacity, fresh.fencing_counter) == (2, len(issued))
    change = CapacityChange.objects.get(semaphore=sem)
    assert (change.old_capacity, change.new_capacity) == (4, 2)
    assert token(grant(sem), sem) == len(issued) + 1


# --- bulk writes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("column", "value"),
    [("capacity", 1), ("fencing_counter", 0), ("queued_until", None)],
)
def test_queryset_update_of_what_the_engine_owns_is_refused(make_semaphore, column, value):
    sem = make_semaphore(capacity=3)
    grant(sem)
    with pytest.raises(UnsafeWrite, match=column):
        Semaphore.objects.filter(pk=sem.pk).update(**{column: value})
    fresh = Semaphore.objects.get(pk=sem.pk)
    assert (fresh.capacity, fresh.fencing_counter) == (3, 1)


def test_capacity_update_names_set_capacity(make_semaphore):
    make_semaphore()
    with pytest.raises(UnsafeWrite, match="set_capacity"):
        Semaphore.objects.update(capacity=5)
    assert isinstance(UnsafeWrite("x"), SemaphoreError)


def test_queryset_update_of_other_columns_is_safe(make_semaphore):
    sem = make_semaphore()
    assert Semaphore.objects.filter(pk=sem.pk).update(fair=True) == 1
    assert Semaphore.objects.get(pk=sem.pk).fair is True


def test_bulk_update_of_what_the_engine_owns_is_refused(make_semaphore):
    sem = make_semaphore(capacity=3)
    sem.capacity, sem.fencing_counter, sem.fair = 1, 0, True
    for fields in (["capacity"], ["fair", "fencing_counter"]):
        with pytest.raises(UnsafeWrite):
            Semaphore.objects.bulk_update([sem], fields)
    Semaphore.objects.bulk_update([sem], ["fair"])
    fresh = Semaphore.objects.get(pk=sem.pk)
    assert (fresh.capacity, fresh.fair) == (3, True)


def test_bulk_create_may_not_overwrite_existing_rows_on_conflict(make_semaphore):
    sem = make_semaphore(capacity=3)
    grant(sem)
    again = Semaphore(name=sem.name, capacity=9)
    for fields in (["capacity"], ["fencing_counter"]):
        with pytest.raises(UnsafeWrite):
            Semaphore.objects.bulk_create(
                [again], update_conflicts=True, update_fields=fields, unique_fields=["name"]
            )
    fresh = Semaphore.objects.get(pk=sem.pk)
    assert (fresh.capacity, fresh.fencing_counter) == (3, 1)
    # New rows, or conflicts ignored, are creation: safe.
    Semaphore.objects.bulk_create(
        [again, Semaphore(name=unique(), capacity=1)], ignore_conflicts=True
    )
    assert Semaphore.objects.get(pk=sem.pk).capacity == 3


def test_request_state_and_permits_are_the_engines(make_semaphore):
    sem = make_semaphore()
    request = grant(sem)
    with pytest.raises(UnsafeWrite, match="release"):
        PermitRequest.objects.filter(pk=request.pk).update(state=State.RELEASED)
    with pytest.raises(UnsafeWrite):
        Permit.objects.filter(request=request).update(state=State.RELEASED)
    with pytest.raises(UnsafeWrite):
        Permit.objects.filter(request=request).update(semaphore_id=sem.pk)
    permit = request.permits.get()
    permit.count = 5
    with pytest.raises(UnsafeWrite):
        Permit.objects.bulk_update([permit], ["count"])
    # Its timing and owner are the holder's business.
    assert PermitRequest.objects.filter(pk=request.pk).update(owner="someone else") == 1
    assert request.permits.get().state == State.ACQUIRED


def test_a_stale_request_save_never_revives_or_rewrites_its_release(make_semaphore):
    sem = make_semaphore()
    request = grant(sem)
    stale = PermitRequest.objects.get(pk=request.pk)  # loaded ACQUIRED
    release(request.external_id)

    stale.owner = "renamed"
    stale.save()

    fresh = PermitRequest.objects.get(pk=request.pk)
    assert (fresh.owner, fresh.state, fresh.release_reason) == (
        "renamed",
        State.RELEASED,
        "released",
    )
    assert fresh.released_at is not None
    fresh.state = State.ACQUIRED
    with pytest.raises(UnsafeWrite, match="release"):
        fresh.save()
    grant(sem)  # the room stayed free


def test_a_permit_save_writes_nothing_and_a_change_is_refused(make_semaphore):
    sem = make_semaphore()
    request = grant(sem)
    permit = request.permits.get()
    permit.save()  # nothing changed: nothing written
    permit.state = State.RELEASED
    with pytest.raises(UnsafeWrite):
        permit.save()
    permit = request.permits.get()
    permit.fencing_token = 99
    with pytest.raises(UnsafeWrite):
        permit.save(update_fields=["fencing_token"])
    assert request.permits.get().fencing_token == 1


def test_requests_and_permits_are_created_only_by_acquire(make_semaphore):
    sem = make_semaphore()
    now = timezone.now()
    with pytest.raises(UnsafeWrite, match="acquire"):
        PermitRequest.objects.create(external_id=unique("key"), created_at=now)
    with pytest.raises(UnsafeWrite, match="acquire"):
        PermitRequest.objects.bulk_create([PermitRequest(external_id=unique(), created_at=now)])
    request = grant(sem)
    with pytest.raises(UnsafeWrite, match="acquire"):
        Permit.objects.create(semaphore=sem, request=request, fencing_token=2)
    assert Permit.objects.filter(semaphore=sem).count() == 1


# --- deletes ----------------------------------------------------------------------------


def test_deleting_a_held_semaphore_is_refused(make_semaphore):
    sem = make_semaphore()
    request = grant(sem)
    with pytest.raises(PermitHeld, match="release"):
        sem.delete()
    with pytest.raises(PermitHeld):
        Semaphore.objects.filter(pk=sem.pk).delete()
    assert Permit.objects.get(request=request).state == State.ACQUIRED

    release(request.external_id)
    sem.delete()
    assert not Semaphore.objects.filter(pk=sem.pk).exists()


def test_deleting_a_held_request_or_permit_is_refused(make_semaphore):
    sem = make_semaphore()
    request = grant(sem)
    with pytest.raises(PermitHeld):
        request.delete()
    with pytest.raises(PermitHeld):
        PermitRequest.objects.filter(pk=request.pk).delete()
    with pytest.raises(PermitHeld):
        request.permits.get().delete()
    with pytest.raises(PermitHeld):
        Permit.objects.filter(request=request).delete()
    assert Permit.objects.get(request=request).state == State.ACQUIRED

    release(request.external_id)
    PermitRequest.objects.filter(pk=request.pk).delete()  # released: its history, safe
    assert not Permit.objects.filter(semaphore=sem).exists()


# --- the admin ----------------------------------------------------------------------------


def test_the_admin_form_records_one_change_and_never_touches_the_counters(client, make_semaphore):
    user = get_user_model().objects.create_user(unique("staff"), password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(codename__in=["view_semaphore", "change_semaphore"])
    )
    client.force_login(user)
    sem = make_semaphore(capacity=3)
    grant(sem)
    url = reverse("admin:django_semaphore_semaphore_change", args=[sem.pk])

    response = client.post(
        url, {"capacity": "5", "reason": "more", "fencing_counter": "0", "queued_until": ""}
    )

    assert response.status_code == 302
    fresh = Semaphore.objects.get(pk=sem.pk)
    assert (fresh.capacity, fresh.fencing_counter) == (5, 1)
    change = CapacityChange.objects.get(semaphore=sem)
    assert (change.changed_by, change.reason, change.new_capacity) == (user, "more", 5)


async def test_the_async_calls_are_guarded_too(make_semaphore, sync_thread_connections):
    sem = await sync_to_async(make_semaphore)(capacity=3)
    with pytest.raises(UnsafeWrite):
        await Semaphore.objects.filter(pk=sem.pk).aupdate(capacity=1)
    with pytest.raises(UnsafeWrite):
        await Semaphore.objects.abulk_update([sem], ["fencing_counter"])
    sem.capacity = 4
    await sem.asave()
    assert await CapacityChange.objects.filter(semaphore=sem).acount() == 1
