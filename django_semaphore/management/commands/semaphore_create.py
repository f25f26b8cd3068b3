"""``manage.py semaphore_create NAME CAPACITY``: a capacity, or a rate (``100/s``)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_semaphore import routing
from django_semaphore.exceptions import InvalidRequest
from django_semaphore.models import Semaphore
from django_semaphore.validation import parse_limit, validate_demand


class Command(BaseCommand):
    help = "Create a semaphore. An existing one is left alone (see semaphore_capacity)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("capacity", help="A capacity (3), or a rate (100/s): a rate limit.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            (name,) = validate_demand(options["name"]).names
            limit = parse_limit(options["capacity"])
        except InvalidRequest as exc:
            raise CommandError(str(exc)) from exc
        semaphore, created = Semaphore.objects.using(routing.alias_for_name(name)).get_or_create(
            name=name, defaults={"capacity": limit.capacity, "window": limit.window}
        )
        if not created:
            raise CommandError(
                f"Semaphore {name!r} exists (capacity {semaphore.limit}); "
                "change it with semaphore_capacity."
            )
        self.stdout.write(f"Created semaphore {name!r} with capacity {limit}.")
