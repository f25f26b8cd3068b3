"""``manage.py semaphore_status``: every semaphore's capacity, use and holders."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db.models import Count, Q, QuerySet

from django_semaphore import routing
from django_semaphore.models import Semaphore, State


class Command(BaseCommand):
    help = "Show each semaphore: capacity, in use, available, holders."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("names", nargs="*", help="Only these semaphores.")

    def handle(self, *args: Any, **options: Any) -> None:
        rows = [("name", "capacity", "in use", "available", "holders")]
        # Every alias holding semaphores (sharded by name: see routing.py).
        for s in sorted(
            (s for alias in routing.aliases() for s in self._semaphores(alias, options["names"])),
            key=lambda s: s.name,
        ):
            in_use: int = s.in_use  # type: ignore[attr-defined]
            available = str(s.capacity - in_use) if in_use <= s.capacity else "0 (over)"
            rows.append((s.name, str(s.capacity), str(in_use), available, str(s.holders)))  # type: ignore[attr-defined]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            cells = [row[0].ljust(widths[0])] + [
                c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
            ]
            self.stdout.write("  ".join(cells).rstrip())
        if len(rows) == 1:
            self.stdout.write("(no semaphores)")

    def _semaphores(self, alias: str, names: list[str]) -> QuerySet[Semaphore]:
        semaphores = (
            Semaphore.objects.db_manager(alias)
            .with_usage()
            .annotate(
                holders=Count(
                    "permits__request", filter=Q(permits__state=State.ACQUIRED), distinct=True
                )
            )
        )
        return semaphores.filter(name__in=names) if names else semaphores
