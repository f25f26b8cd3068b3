"""Changing a semaphore's capacity or window from ``set_capacity`` and
``set_window``: its row locked, then ``Semaphore.record_change``, the one
home of a change (which ``Semaphore.save()`` uses too)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, TypedDict

from django.db import transaction

from django_semaphore.exceptions import SemaphoreNotFound
from django_semaphore.models import Semaphore

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser


class Limits(TypedDict, total=False):
    """What a change sets; what it leaves out stays as it is."""

    capacity: int
    window: int | None


def change_limits(
    alias: str, name: str, limits: Limits, changed_by: AbstractBaseUser | None, reason: str
) -> Semaphore:
    """``set_capacity``'s or ``set_window``'s transaction (or its part of the
    caller's): one change of what ``limits`` gives, capacity and window
    together, one ``CapacityChange``."""
    with transaction.atomic(using=alias):
        semaphore = Semaphore.objects.using(alias).filter(name=name).locked().first()
        if semaphore is None:
            raise SemaphoreNotFound([name])
        semaphore.record_change(
            replace(semaphore.limit, **limits), changed_by=changed_by, reason=reason, using=alias
        )
    return semaphore
