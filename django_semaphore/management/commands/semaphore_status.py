"""``manage.py semaphore_status``: every semaphore's capacity, use and holders."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db.models import Count, Q

from django_semaphore.conf import app_settings
from django_semaphore.models import Semaphore, State


class Command(BaseCommand):
    help = "Show each semaphore: capacity, in use, available, holders."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("names", nargs="*", help="Only these semaphores.")

    def handle(self, *args: Any, **options: Any) -> None:
        semaphores = (
            Semaphore.objects.db_manager(app_settings.DATABASE)
            .with_usage()
            .annotate(
                holders=Count(
                    "permits__request", filter=Q(permits__state=State.ACQUIRED), distinct=True
                )
            )
            .order_by("name")
        )
        if options["names"]:
            semaphores = semaphores.filter(name__in=options["names"])
        rows = [("name", "capacity", "in use", "available", "holders")]
        for s in semaphores:
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
