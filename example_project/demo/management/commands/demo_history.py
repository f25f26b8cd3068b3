"""Give the demo's ``exports`` semaphore a day of history, once."""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.utils import timezone

from django_semaphore import acquire, release, set_capacity
from django_semaphore.models import CapacityChange, PermitRequest, Semaphore

HOUR = timedelta(hours=1)


class Command(BaseCommand):
    help = (
        "Give the exports semaphore a day of past jobs and two capacity changes, so the "
        "demo's first screen has a chart to show; does nothing once exports has a history."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        exports = Semaphore.objects.get(name="exports")
        if CapacityChange.objects.filter(semaphore=exports).exists():
            return
        now = timezone.now()
        rng = random.Random(7)
        # Raised to 5 for a quarter-end run 14 h ago, back to 3 at 6 h: jobs
        # started while it was 5 run on past it, and the chart shows that as
        # over capacity.
        raised = (now - 14 * HOUR, now - 6 * HOUR)
        running: list[datetime] = []
        moment, stop = now - 24 * HOUR, now - 0.25 * HOUR
        jobs = 0
        while moment < stop:
            running = [end for end in running if end > moment]
            capacity = 5 if raised[0] <= moment < raised[1] else exports.capacity
            if len(running) < capacity and rng.random() < 0.45:
                end = min(moment + timedelta(minutes=rng.randint(15, 140)), stop)
                self.past_job(moment, end, f"celery@worker-{rng.randint(1, 4)}", jobs)
                running.append(end)
                jobs += 1
            moment += timedelta(minutes=rng.randint(3, 12))
        user = get_user_model().objects.filter(is_superuser=True).first()
        for new, reason, when in (
            (5, "Quarter-end exports", raised[0]),
            (exports.capacity, "Database load too high", raised[1]),
        ):
            set_capacity("exports", new, changed_by=user, reason=reason)
            change = CapacityChange.objects.filter(semaphore=exports).latest("id")
            CapacityChange.objects.filter(pk=change.pk).update(changed_at=when)
        self.stdout.write(f"exports: {jobs} past jobs and 2 capacity changes over the last day")

    def past_job(self, start: datetime, end: datetime, owner: str, n: int) -> None:
        """A job granted and released through the API, then dated in the past:
        the chart replays requests by their grant and release times."""
        key = f"exports-history-{n}"
        acquire("exports", external_id=key, owner=owner)
        release(key)
        PermitRequest.objects.filter(external_id=key).update(created_at=start, released_at=end)
