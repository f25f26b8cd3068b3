"""Changing a semaphore's capacity: under its row lock, recorded in
``CapacityChange``, from ``set_capacity`` and from ``Semaphore.save()`` alike.

Below the public API, so the model's ``save()`` can use it without
importing the API layer back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import transaction

from django_semaphore import signals
from django_semaphore.exceptions import SemaphoreNotFound
from django_semaphore.guards import engine_writes
from django_semaphore.validation import validate_capacity

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser

    from django_semaphore.models import Semaphore


def change(
    alias: str,
    name: str,
    capacity: int,
    changed_by: AbstractBaseUser | None,
    reason: str,
) -> Semaphore:
    """``set_capacity``'s transaction (or its part of the caller's)."""
    from django_semaphore.models import Semaphore

    with transaction.atomic(using=alias):
        try:
            semaphore = Semaphore.objects.using(alias).select_for_update().get(name=name)
        except Semaphore.DoesNotExist:
            raise SemaphoreNotFound([name]) from None
        _record(alias, semaphore, capacity, changed_by, reason)
    return semaphore


def lock_for_save(alias: str, semaphore_id: int, capacity: int | None) -> bool:
    """``Semaphore.save()`` of an existing row: lock it and, if ``capacity``
    is given, change it as ``set_capacity`` does (no user, no reason).
    In the caller's transaction; ``False`` if no row has this id."""
    from django_semaphore.models import Semaphore

    if capacity is not None:
        capacity = validate_capacity(capacity)
    semaphore = Semaphore.objects.using(alias).select_for_update().filter(pk=semaphore_id).first()
    if semaphore is None:
        return False
    if capacity is not None:
        _record(alias, semaphore, capacity, None, "")
    return True


def _record(
    alias: str,
    semaphore: Semaphore,
    capacity: int,
    changed_by: AbstractBaseUser | None,
    reason: str,
) -> None:
    """On the locked row: record the change, then make it."""
    from django_semaphore.models import CapacityChange, Semaphore

    if semaphore.capacity == capacity:
        return
    CapacityChange.objects.using(alias).create(
        semaphore=semaphore,
        old_capacity=semaphore.capacity,
        new_capacity=capacity,
        changed_by_id=None if changed_by is None else changed_by.pk,
        reason=reason,
    )
    raised = capacity - semaphore.capacity
    semaphore.capacity = capacity
    # A family member changed on its own no longer follows its family default
    # (families.py), and the clean-up keeps it.
    semaphore.own_capacity = bool(semaphore.family)
    with engine_writes():
        semaphore.save(using=alias, update_fields=["capacity", "own_capacity", "updated_at"])
    if raised > 0 and signals.permits_freed.has_listeners(Semaphore):
        # Room made: parked tasks that fit now are woken once this commits.
        freed = {semaphore.pk: raised}
        transaction.on_commit(
            lambda: signals.permits_freed.send_robust(sender=Semaphore, freed=freed, using=alias),
            using=alias,
        )
