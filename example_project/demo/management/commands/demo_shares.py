"""Shares at work: one customer sends a backlog of exports, another a few
right after; the second customer's are done long before the backlog is.
Run it beside ``scripts/demo``, whose Celery worker runs the exports."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from django_semaphore.models import PermitRequest
from django_semaphore.states import ReleaseReason
from example_project.demo.tasks import customer_export


class Command(BaseCommand):
    help = (
        "Send customer acme's exports, then customer globex's (share keys: docs/shares.md), "
        "and print them as the demo's worker finishes them."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--backlog", type=int, default=20, help="acme's exports, sent first")
        parser.add_argument("--few", type=int, default=2, help="globex's, sent right after")
        parser.add_argument("--wait", type=float, default=300, help="seconds to wait for them")

    def handle(self, *args: Any, backlog: int, few: int, wait: float, **options: Any) -> None:
        started = timezone.now()
        sent = {
            customer_export.delay(customer, n).id: f"{customer} #{n}"
            for customer, count in (("acme", backlog), ("globex", few))
            for n in range(1, count + 1)
        }
        self.stdout.write(f"Sent {backlog} exports of acme, then {few} of globex.")
        finished: list[str] = []
        deadline = time.monotonic() + wait
        while len(finished) < len(sent):
            if time.monotonic() > deadline:
                raise CommandError(
                    f"{len(sent) - len(finished)} exports not done within {wait:.0f} s: "
                    "is the demo's worker running (scripts/demo)?"
                )
            for task_id in self.done_since(started):
                if task_id in sent and sent[task_id] not in finished:
                    finished.append(sent[task_id])
                    self.stdout.write(f"{len(finished):3d}. {sent[task_id]} done")
            time.sleep(0.5)
        last = max(i for i, export in enumerate(finished, start=1) if export.startswith("globex"))
        self.stdout.write(
            f"globex's {few} exports were done by finish {last} of {len(sent)}: "
            "they took turns with acme's backlog rather than wait behind it."
        )

    def done_since(self, started: Any) -> list[str]:
        """The task ids of the exports released since ``started``, in order:
        a task's permit is owned by ``task:<task id> <task name> on ...``."""
        owners = (
            PermitRequest.objects.filter(
                owner__contains=f" {customer_export.name} ",
                released_at__gte=started,
                release_reason=ReleaseReason.RELEASED,
            )
            .order_by("released_at", "pk")
            .values_list("owner", flat=True)
        )
        return [owner.split(" ", 1)[0].removeprefix("task:") for owner in owners]
