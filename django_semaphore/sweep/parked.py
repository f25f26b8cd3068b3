"""The beat sweep of parked Celery tasks: the backstop of the wake-ups."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.db import transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from django_semaphore import routing
from django_semaphore.conf import app_settings
from django_semaphore.exceptions import SemaphoreNotFound
from django_semaphore.models import ParkedTask, PermitRequest, Ticket
from django_semaphore.models.parked import SENDING
from django_semaphore.parking import aside, deferred, wake
from django_semaphore.parking.rows import drop_parked, raw_delete

logger = logging.getLogger("django_semaphore")


@dataclass
class ParkedReport:
    """What one parked-task sweep did."""

    republished: int = 0  # woken rows whose run never started
    woken: int = 0
    dropped: int = 0  # past their expiry
    orphaned: int = 0  # dropped: they waited on no semaphore left
    unsent: int = 0  # dropped: their sender's transaction rolled back

    def __str__(self) -> str:
        return (
            f"Parked tasks: woken {self.woken}, republished {self.republished}, "
            f"dropped {self.dropped} expired, {self.orphaned} whose semaphore is gone "
            f"and {self.unsent} whose send was rolled back."
        )


def sweep_parked() -> ParkedReport:
    """The backstop of the wake-ups: drop expired rows, those whose
    semaphore is gone (deleted behind the delete guard's back: raw SQL, an
    older version; each logged, and a Django task's result recorded as
    failed with ``SemaphoreNotFound``) and those whose send was rolled back
    (``parking.aside``), publish again woken
    rows whose run has not started within ``PARKED_REPUBLISH_AFTER``, and
    wake what fits on every semaphore with parked tasks (releases made by a
    process that does not park tasks send no wake-up), and on rate limits
    publish the wake-up of their next slot."""
    report = ParkedReport()
    for alias in routing.aliases():
        # A row still SENDING is its sender's until it is found unsent.
        tasks = ParkedTask.objects.using(alias).exclude(not_before=SENDING)
        # By their keys, read first: a delete through a subquery would lock
        # (and wait for) the rows the subquery reads.
        expired = tasks.filter(expires_at__lte=timezone.now()).values_list("key", flat=True)
        report.dropped += drop_parked(alias, list(expired))
        report.orphaned += _drop_orphans(alias)
        report.unsent += _drop_unsent(alias)
        overdue_since = timezone.now() - app_settings.PARKED_REPUBLISH_AFTER
        woken = tasks.filter(woken_at__lte=overdue_since).order_by("id")
        overdue = list(woken.values_list("id", flat=True))
        if overdue:
            tasks.filter(id__in=overdue).update(woken_at=timezone.now())
            report.republished += wake.publish(alias, overdue)
        parked_on = Ticket.objects.using(alias).of_parked().values_list("semaphore_id", flat=True)
        semaphore_ids = set(parked_on.distinct())
        report.woken += wake.wake(alias, semaphore_ids)
        # A rate limit's wake-up at its next slot, published again if lost.
        wake.schedule_slots(alias, semaphore_ids)
    if report.republished or report.woken or report.dropped or report.orphaned or report.unsent:
        logger.info("%s", report)
    return report


def _drop_unsent(alias: str) -> int:
    """Drop the rows of sends whose transaction rolled back; how many.
    Their room goes to the next in line."""
    with transaction.atomic(using=alias):
        dropped, freed = aside.drop_abandoned(alias)
    wake.wake(alias, freed)
    return dropped


def _drop_orphans(alias: str) -> int:
    """Drop the parked tasks left with no ticket, no semaphore to wait on;
    not one whose run holds its permit already (its grant took the tickets,
    and ``parking.started`` deletes the row)."""
    runs = PermitRequest.objects.using(alias).filter(external_id=OuterRef("key"))
    orphans = ParkedTask.objects.using(alias).filter(tickets__isnull=True).filter(~Exists(runs))
    found = list(orphans.values_list("id", "task_name", "task_id", "backend"))
    if not found:
        return 0
    for _, task_name, task_id, _ in found:
        logger.warning(
            "Dropped parked task %s[%s]: the semaphore it waited on was deleted.",
            task_name,
            task_id,
        )
    if results := [task_id for _, _, task_id, backend in found if backend]:
        deferred.drop(results, SemaphoreNotFound)
    return raw_delete(ParkedTask.objects.using(alias).filter(id__in=[row[0] for row in found]))
