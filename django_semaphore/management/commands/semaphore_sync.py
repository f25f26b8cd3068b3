"""``manage.py semaphore_sync [--apply]``: apply the declared ``SEMAPHORES``
to the database on purpose.

``migrate`` creates the declared semaphores that are missing and leaves
existing ones alone (their limits belong to the admin and the capacity API
from then on). This command is how a change of settings is applied: a dry
run by default, listing what would change; with ``--apply``, missing ones
are created as ``migrate`` creates them, and each differing capacity and
window is changed through ``set_capacity`` (both at once), recorded in the
capacity history as one change with the reason ``settings``. A family's pattern is
its default: its members that follow the default follow it; members whose
capacity was changed on their own keep it.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import Error

from django_semaphore import routing
from django_semaphore.api import set_capacity
from django_semaphore.declared import Drift, create_declared_semaphores, drift
from django_semaphore.exceptions import SemaphoreError

BY_SETTINGS = "settings"


class Command(BaseCommand):
    help = (
        "Apply the semaphores declared in DJANGO_SEMAPHORE['SEMAPHORES'] to the database: "
        "create missing ones, and change the capacity and window of those that differ "
        "(recorded in their capacity history). A dry run unless --apply is given."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--apply", action="store_true", help="Make the changes (default: only list them)."
        )
        parser.add_argument("--reason", default="", help="Why, for the capacity history.")

    def handle(self, *args: Any, **options: Any) -> None:
        reason = f"{BY_SETTINGS}: {options['reason']}" if options["reason"] else BY_SETTINGS
        try:
            found = [each for alias in routing.aliases() for each in drift(alias)]
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        except Error as exc:
            raise CommandError(f"The semaphore tables cannot be read: {exc}") from exc
        if not found:
            self.stdout.write("The database has the limits the settings declare: nothing to do.")
            return
        apply = options["apply"]
        for each in found:
            self.stdout.write(_line(each, apply))
            if apply:
                try:
                    _apply(each, reason)
                except SemaphoreError as exc:
                    raise CommandError(f"{each.name!r}: {exc}") from exc
        if not apply:
            self.stdout.write(
                f"Dry run: {len(found)} semaphore(s) differ; --apply applies the settings."
            )


def _line(each: Drift, applied: bool) -> str:
    if each.stored is None:
        verb = "created" if applied else "would be created"
        return f"{each.name!r} on {each.alias!r}: missing, {verb} with {each.settings_say}."
    verb = "changed" if applied else "would change"
    return f"{each.name!r} on {each.alias!r}: {each.database_has} -> {each.settings_say} ({verb})."


def _apply(each: Drift, reason: str) -> None:
    if each.stored is None:
        # As migrate creates them (all of the alias's missing ones at once).
        create_declared_semaphores(using=each.alias, verbosity=0)
        return
    # One change: nobody is granted under the new capacity with the old
    # window (or the reverse), and the history has one record of it.
    set_capacity(each.name, each.declared.capacity, window=each.declared.window, reason=reason)
