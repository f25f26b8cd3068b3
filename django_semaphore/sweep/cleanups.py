"""The clean-ups: delete what the app no longer needs, in batches within a
time budget -- requests released longer ago than ``RELEASED_RETENTION``
(with their permits), ``CapacityChange`` rows older than
``HISTORY_RETENTION``, family members idle past ``MEMBER_IDLE_LIMIT``,
waiters' tickets that expired."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from django.db.models import Exists, Min, OuterRef, Q
from django.db.models.functions import Coalesce

from django_semaphore import routing
from django_semaphore.backends import DatabaseNow
from django_semaphore.conf import app_settings
from django_semaphore.models import (
    CapacityChange,
    Permit,
    PermitRequest,
    ReleaseCounter,
    Semaphore,
    Ticket,
)
from django_semaphore.parking.rows import raw_delete
from django_semaphore.states import State
from django_semaphore.sweep.batches import (
    DEFAULT_TIME_BUDGET,
    _delete_in_batches,
    _limits,
    _on_every_alias,
)
from django_semaphore.sweep.reports import CleanupReport
from django_semaphore.validation import MAX_WINDOW


@_on_every_alias
def clean_released(
    *,
    batch_size: int | None = None,
    time_budget: float | None = DEFAULT_TIME_BUDGET,
    dry_run: bool = False,
    progress: Callable[[CleanupReport], None] | None = None,
) -> CleanupReport:
    """Delete requests released longer ago than ``RELEASED_RETENTION``, with
    their permits (but none whose slot a rate limit may still count: none
    granted within a day of the oldest last close of a rate limit's slots),
    ``batch_size`` requests per short transaction, until none are left or
    ``time_budget`` seconds are spent.

    Args:
        batch_size: requests per batch (default ``CLEANUP_BATCH_SIZE``).
        time_budget: seconds after which no new batch starts (``None``: no limit).
        dry_run: count what would be deleted, delete nothing.
        progress: called with the running report after each batch.

    Raises:
        InvalidRequest: as for :func:`release_orphans`.
    """
    limits = _limits(batch_size, time_budget, dry_run)
    alias = routing.current_alias()
    old = PermitRequest.objects.using(alias).filter(
        state=State.RELEASED, released_at__lte=DatabaseNow() - app_settings.RELEASED_RETENTION
    )
    # A permit whose slot a rate limit still counts (open, or ended and not
    # closed yet) stays: its slot is closed by its end, read from the row.
    # Such a slot ends after its semaphore's last close, so its request was
    # granted less than a window (a day at most) before the oldest last
    # close of a rate limit that counts slots: a bound on the request's own
    # row, where a look at its permits would cost every batch a scan.
    counting = Semaphore.objects.using(alias).rate_limits().filter(slots_open__gt=0)
    oldest_close = counting.aggregate(at=Min(Coalesce("slots_closed_until", DatabaseNow())))["at"]
    if oldest_close is not None:
        old = old.filter(created_at__lte=oldest_close - timedelta(seconds=MAX_WINDOW))
    report = CleanupReport("released requests", dry_run=dry_run)
    if dry_run:
        report.permits = Permit.objects.using(alias).filter(request__in=old).count()

    def delete_permits(ids: list[int]) -> int:
        return raw_delete(Permit.objects.using(alias).filter(request_id__in=ids))

    return _delete_in_batches(
        old.order_by("released_at"), report, limits, progress, before=delete_permits
    )


@_on_every_alias
def clean_history(
    *,
    batch_size: int | None = None,
    time_budget: float | None = DEFAULT_TIME_BUDGET,
    dry_run: bool = False,
    progress: Callable[[CleanupReport], None] | None = None,
) -> CleanupReport:
    """Delete ``CapacityChange`` rows older than ``HISTORY_RETENTION``, in
    batches; arguments as for :func:`clean_released`."""
    limits = _limits(batch_size, time_budget, dry_run)
    alias = routing.current_alias()
    old = CapacityChange.objects.using(alias).filter(
        changed_at__lte=DatabaseNow() - app_settings.HISTORY_RETENTION
    )
    report = CleanupReport("capacity history", dry_run=dry_run)
    return _delete_in_batches(old.order_by("changed_at"), report, limits, progress)


@_on_every_alias
def clean_idle_members(
    *,
    batch_size: int | None = None,
    time_budget: float | None = DEFAULT_TIME_BUDGET,
    dry_run: bool = False,
    progress: Callable[[CleanupReport], None] | None = None,
) -> CleanupReport:
    """Delete family members (semaphores created on first use) that hold
    nothing, have no live waiter nor parked task and were not granted for
    ``MEMBER_IDLE_LIMIT``, with their released permits, dead tickets and
    capacity history, in batches; arguments as for :func:`clean_released`.

    Declared semaphores, family defaults and members whose capacity was
    changed on their own are never deleted. A member acquired again later
    is created again (its fencing tokens still increase, see ``families``).
    """
    limits = _limits(batch_size, time_budget, dry_run)
    alias = routing.current_alias()
    # The row lock of each batch re-reads these conditions on the latest
    # committed row (InnoDB's locking read; PostgreSQL re-checks a row
    # changed meanwhile), so a member granted since it was listed is kept.
    idle_since = DatabaseNow() - app_settings.MEMBER_IDLE_LIMIT
    idle = (
        Semaphore.objects.using(alias)
        .exclude(family="")
        .filter(Q(in_use=0), own_capacity=False, updated_at__lte=idle_since)
        .filter(Q(queued_until__isnull=True) | Q(queued_until__lte=DatabaseNow()))
        .filter(~Exists(Permit.objects.filter(semaphore=OuterRef("pk"), state=State.ACQUIRED)))
        # A parked task waits for it: deleting it would drop the task's demand.
        .filter(~Exists(Ticket.objects.filter(semaphore=OuterRef("pk"), parked__id__isnull=False)))
    )
    report = CleanupReport("idle family members", dry_run=dry_run)

    def delete_dependents(ids: list[int]) -> int:
        # What CASCADE would delete, without Django's collector reading it:
        # released permits only (nothing is held), dead tickets, the
        # history and the release counter.
        for model in (Ticket, CapacityChange, ReleaseCounter):
            raw_delete(model.objects.using(alias).filter(semaphore_id__in=ids))
        return raw_delete(Permit.objects.using(alias).filter(semaphore_id__in=ids))

    return _delete_in_batches(
        idle.order_by("family", "updated_at"), report, limits, progress, before=delete_dependents
    )


@_on_every_alias
def clean_tickets(
    *, batch_size: int | None = None, time_budget: float | None = None, dry_run: bool = False
) -> CleanupReport:
    """Delete waiters' tickets that expired, in batches.

    They block nobody already (a ticket stops counting at its ``expires_at``):
    their waiters were granted, gave up or died. This only keeps the table
    small; run with the orphan sweep.
    """
    limits = _limits(batch_size, time_budget, dry_run)
    dead = Ticket.objects.using(routing.current_alias()).filter(expires_at__lte=DatabaseNow())
    report = CleanupReport("dead tickets", dry_run=dry_run)
    return _delete_in_batches(dead.order_by("expires_at"), report, limits, None)
