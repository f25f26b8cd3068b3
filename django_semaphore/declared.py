"""Semaphores declared in settings: created after ``migrate``, and compared
with the database.

Only missing ones are created: from then on capacity (and a rate limit's
window) belongs to the admin and the capacity API, where every change is
recorded, so ``migrate`` never overwrites it. The same holds for a family's
default capacity, kept in the row named by its pattern (see
``engine/families.py``).

When settings and an existing row disagree (``"exports": 3`` became ``10``,
a ``rate`` was added), that is *drift*: ``migrate`` says so, the database
check ``django_semaphore.W012`` reports it, and ``manage.py semaphore_sync
--apply`` applies the settings on purpose, through ``set_capacity`` (capacity
and window as one change, recorded in the capacity history). A family is compared by
its pattern's row, the family default; its members are not compared (those
that follow the default follow it when it changes, those changed on their
own keep their capacity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TextIO

from django.db import router

from django_semaphore import routing
from django_semaphore.conf import app_settings
from django_semaphore.limits import Limit
from django_semaphore.models import Semaphore
from django_semaphore.validation import Declared, is_pattern, validate_declared

APPLY_COMMAND = "manage.py semaphore_sync --apply"


@dataclass(frozen=True)
class Drift:
    """A declared semaphore whose row is missing (``stored`` is ``None``)
    or has other limits than the settings declare."""

    name: str
    alias: str
    declared: Declared
    stored: Limit | None  # the row's; None: no row

    @property
    def settings_say(self) -> str:
        return str(self.declared.limit)

    @property
    def database_has(self) -> str:
        return "nothing" if self.stored is None else str(self.stored)

    def describe(self) -> str:
        what = "family default " if is_pattern(self.name) else ""
        return (
            f"Semaphore {what}{self.name!r} on {self.alias!r}: settings say "
            f"{self.settings_say}, the database has {self.database_has}."
        )


def drift(using: str, *, missing: bool = True) -> list[Drift]:
    """The declared semaphores (and family patterns) placed on ``using``
    whose row differs from settings (and, with ``missing``, those with no
    row), in name order.

    Raises:
        ImproperlyConfigured: ``SEMAPHORES`` (or the routing settings) is malformed.
        DatabaseError: the tables cannot be read (not migrated, unreachable).
    """
    declared = {
        name: validate_declared(name, value)
        for name, value in app_settings.SEMAPHORES.items()
        if routing.alias_for_name(name) == using
    }
    stored = {
        name: Limit(capacity, window)
        for name, capacity, window in Semaphore.objects.using(using)
        .filter(name__in=declared)
        .values_list("name", "capacity", "window")
    }
    return [
        Drift(name, using, limits, stored.get(name))
        for name, limits in sorted(declared.items())
        if (missing or name in stored) and stored.get(name) != limits.limit
    ]


def create_declared_semaphores(
    using: str, verbosity: int = 1, stdout: TextIO | None = None, **kwargs: Any
) -> None:
    """Each declared semaphore is created on the alias its name is placed on
    (``post_migrate``); existing ones are left alone, and where their limits
    differ from settings, ``migrate`` says so (at verbosity 1 and up)."""
    if not router.allow_migrate_model(using, Semaphore):
        return
    # A family's pattern is created too: its row holds the family default.
    Semaphore.objects.using(using).bulk_create(
        [
            Semaphore(name=each.name, capacity=each.declared.capacity, window=each.declared.window)
            for each in drift(using)
            if each.stored is None
        ],
        ignore_conflicts=True,
    )
    if verbosity >= 1 and stdout is not None:
        for found in drift(using, missing=False):
            stdout.write(
                f"  {found.describe()} migrate leaves an existing semaphore's limits alone: "
                f"{APPLY_COMMAND} applies the settings.\n"
            )
