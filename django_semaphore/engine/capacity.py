"""Changing a semaphore's capacity from ``set_capacity``: its row locked,
then ``Semaphore.record_capacity_change``, the one home of a change (which
``Semaphore.save()`` uses too)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import transaction

from django_semaphore.exceptions import SemaphoreNotFound
from django_semaphore.models import Semaphore

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser


def change(
    alias: str,
    name: str,
    capacity: int,
    changed_by: AbstractBaseUser | None,
    reason: str,
) -> Semaphore:
    """``set_capacity``'s transaction (or its part of the caller's)."""
    with transaction.atomic(using=alias):
        semaphore = Semaphore.objects.using(alias).filter(name=name).locked().first()
        if semaphore is None:
            raise SemaphoreNotFound([name])
        semaphore.record_capacity_change(
            capacity, changed_by=changed_by, reason=reason, using=alias
        )
    return semaphore
