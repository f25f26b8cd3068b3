"""``manage.py semaphore_release KEY [KEY ...]``: force-release by key."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_semaphore.api import force_release
from django_semaphore.exceptions import InvalidRequest
from django_semaphore.states import ReleaseOutcome

MESSAGES = {
    ReleaseOutcome.RELEASED: "released",
    ReleaseOutcome.ALREADY_RELEASED: "was already released",
    ReleaseOutcome.NOT_FOUND: "not found",
}


class Command(BaseCommand):
    help = (
        "Release the permit requests with these keys (external_id) on an operator's "
        "behalf (release reason 'admin'). Exits with an error if a key is not found."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("keys", nargs="+", metavar="key")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            outcomes = force_release(options["keys"])
        except InvalidRequest as exc:
            raise CommandError(str(exc)) from exc
        for key, outcome in outcomes.items():
            self.stdout.write(f"{key}: {MESSAGES[outcome]}")
        missing = [key for key, outcome in outcomes.items() if outcome is ReleaseOutcome.NOT_FOUND]
        if missing:
            raise CommandError(f"No permit request has the key(s): {', '.join(missing)}")
