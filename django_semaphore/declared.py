"""Semaphores declared in settings, created after ``migrate``.

Only missing ones are created: from then on capacity (and a rate limit's
window) belongs to the admin and
the capacity API, where every change is recorded, so settings never overwrite it.
The same holds for a family's default capacity, kept in the row named by its
pattern (see ``engine/families.py``).
"""

from __future__ import annotations

from typing import Any

from django.db import router

from django_semaphore import routing
from django_semaphore.conf import app_settings
from django_semaphore.models import Semaphore
from django_semaphore.validation import validate_declared


def create_declared_semaphores(using: str, **kwargs: Any) -> None:
    """Each declared semaphore is created on the alias its name is placed on."""
    if not router.allow_migrate_model(using, Semaphore):
        return
    # A family's pattern is created too: its row holds the family default.
    declared = {
        name: validate_declared(name, value)
        for name, value in app_settings.SEMAPHORES.items()
        if routing.alias_for_name(name) == using
    }
    if not declared:
        return
    existing = set(
        Semaphore.objects.using(using).filter(name__in=declared).values_list("name", flat=True)
    )
    Semaphore.objects.using(using).bulk_create(
        [
            Semaphore(name=name, capacity=limits.capacity, window=limits.window)
            for name, limits in sorted(declared.items())
            if name not in existing
        ],
        ignore_conflicts=True,
    )
