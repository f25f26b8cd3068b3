"""``manage.py semaphore_capacity NAME CAPACITY``: recorded in the history.

``CAPACITY`` may be a rate (``100/s``, ``5/m``): the semaphore becomes a
rate limit with that window; ``--no-window`` makes it a concurrency limit
again. Capacity and window change together: one transaction, one record.
"""

from __future__ import annotations

from types import EllipsisType
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_semaphore import routing
from django_semaphore.api import set_capacity
from django_semaphore.exceptions import InvalidRequest, SemaphoreError
from django_semaphore.limits import Limit
from django_semaphore.models import Semaphore
from django_semaphore.validation import parse_limit, validate_name

BY_COMMAND = "by command"


class Command(BaseCommand):
    help = (
        "Set a semaphore's capacity, or its rate (100/s, 5/m, 1000/h), under its row "
        "lock; the change is recorded in its capacity history as made by command. Held "
        "permits are never revoked."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument(
            "capacity", help="A capacity (3), or a rate (100/s): a rate limit's capacity, window."
        )
        parser.add_argument(
            "--no-window", action="store_true", help="Remove the window: a concurrency limit again."
        )
        parser.add_argument("--reason", default="", help="Why, for the capacity history.")

    def handle(self, *args: Any, **options: Any) -> None:
        reason = f"{BY_COMMAND}: {options['reason']}" if options["reason"] else BY_COMMAND
        try:
            name = validate_name(options["name"])  # before the read of its limits
            capacity, window = _limits(options["capacity"], options["no_window"])
            previous = (
                Semaphore.objects.using(routing.alias_for_name(name))
                .filter(name=name)
                .values_list("capacity", "window")
                .first()
            )
            semaphore = set_capacity(name, capacity, window=window, reason=reason)
        except SemaphoreError as exc:
            raise CommandError(str(exc)) from exc
        before = "?" if previous is None else Limit(*previous)
        self.stdout.write(f"Semaphore {semaphore.name!r}: capacity {before} -> {semaphore.limit}.")


def _limits(given: str, no_window: bool) -> tuple[int, int | EllipsisType | None]:
    """The capacity, and the window to set with it (``...``: leave it as it is)."""
    limit = parse_limit(given)
    if limit.is_rate and no_window:
        raise InvalidRequest("A rate has a window: give a capacity with --no-window.")
    return limit.capacity, limit.window if limit.is_rate or no_window else ...
