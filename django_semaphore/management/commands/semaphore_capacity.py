"""``manage.py semaphore_capacity NAME CAPACITY``: recorded in the history."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_semaphore import routing
from django_semaphore.api import set_capacity
from django_semaphore.exceptions import SemaphoreError
from django_semaphore.models import Semaphore
from django_semaphore.validation import validate_name

BY_COMMAND = "by command"


class Command(BaseCommand):
    help = (
        "Set a semaphore's capacity under its row lock; the change is recorded in "
        "its capacity history as made by command. Held permits are never revoked."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("capacity", type=int)
        parser.add_argument("--reason", default="", help="Why, for the capacity history.")

    def handle(self, *args: Any, **options: Any) -> None:
        reason = f"{BY_COMMAND}: {options['reason']}" if options["reason"] else BY_COMMAND
        try:
            name = validate_name(options["name"])  # before the read of its capacity
            previous = (
                Semaphore.objects.using(routing.alias_for_name(name))
                .filter(name=name)
                .values_list("capacity", flat=True)
                .first()
            )
            semaphore = set_capacity(name, options["capacity"], reason=reason)
        except SemaphoreError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(
            f"Semaphore {semaphore.name!r}: capacity {previous} -> {semaphore.capacity}."
        )
