"""The beat sweep of parked Celery tasks: the backstop of the wake-ups."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.utils import timezone

from django_semaphore import routing
from django_semaphore.conf import app_settings
from django_semaphore.models import ParkedTask, Ticket
from django_semaphore.parking import wake

logger = logging.getLogger("django_semaphore")


@dataclass
class ParkedReport:
    """What one parked-task sweep did."""

    republished: int = 0  # woken rows whose run never started
    woken: int = 0
    dropped: int = 0  # past their expiry

    def __str__(self) -> str:
        return (
            f"Parked tasks: woken {self.woken}, republished {self.republished}, "
            f"dropped {self.dropped} expired."
        )


def sweep_parked() -> ParkedReport:
    """The backstop of the wake-ups: drop expired rows, publish again woken
    rows whose run has not started within ``PARKED_REPUBLISH_AFTER``, and
    wake what fits on every semaphore with parked tasks (releases made by a
    process that does not park tasks send no wake-up), and on rate limits
    publish the wake-up of their next slot."""
    report = ParkedReport()
    for alias in routing.aliases():
        tasks = ParkedTask.objects.using(alias)
        dropped = tasks.filter(expires_at__lte=timezone.now())
        Ticket.objects.using(alias).filter(parked__in=dropped).delete()
        report.dropped += dropped.delete()[0]
        overdue_since = timezone.now() - app_settings.PARKED_REPUBLISH_AFTER
        overdue = list(
            tasks.filter(woken_at__lte=overdue_since).order_by("id").values_list("id", flat=True)
        )
        if overdue:
            tasks.filter(id__in=overdue).update(woken_at=timezone.now())
            report.republished += wake.publish(alias, overdue)
        semaphore_ids = set(
            Ticket.objects.using(alias)
            .of_parked()
            .values_list("semaphore_id", flat=True)
            .distinct()
        )
        report.woken += wake.wake(alias, semaphore_ids)
        # A rate limit's wake-up at its next slot, published again if lost.
        wake.schedule_slots(alias, semaphore_ids)
    if report.republished or report.woken or report.dropped:
        logger.info("%s", report)
    return report
