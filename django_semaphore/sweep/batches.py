"""How every sweep works through rows: on each alias in turn, in batches of
``CLEANUP_BATCH_SIZE`` rows, each its own short transaction with a bounded
lock wait, until the time budget is spent. Every decision about time uses
the database's clock (``DatabaseNow``), never this machine's."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import TYPE_CHECKING, NamedTuple, ParamSpec, TypeVar

from django.db import connections
from django.db.models import QuerySet

from django_semaphore import backends, routing
from django_semaphore.conf import app_settings
from django_semaphore.exceptions import LockContention
from django_semaphore.parking.rows import raw_delete
from django_semaphore.retry import run_with_retries
from django_semaphore.sweep.reports import CleanupReport, OrphanReport
from django_semaphore.validation import validate_batch_size, validate_time_budget

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import Model

logger = logging.getLogger("django_semaphore")

T = TypeVar("T")
P = ParamSpec("P")
Report = TypeVar("Report", OrphanReport, CleanupReport)

# A clean-up run stops starting new batches after this many seconds; the next
# run goes on where it stopped. Generous for a 4-hourly task.
DEFAULT_TIME_BUDGET = 600.0


def _on_every_alias(sweep: Callable[P, Report]) -> Callable[P, Report]:
    """Run ``sweep`` on each alias holding semaphores and add the reports up."""

    @functools.wraps(sweep)
    def on_every_alias(*args: P.args, **kwargs: P.kwargs) -> Report:
        first, *others = routing.on_each_alias(lambda: sweep(*args, **kwargs))
        for other in others:
            for field in fields(first):
                mine, theirs = getattr(first, field.name), getattr(other, field.name)
                if isinstance(mine, bool):  # finished, dry_run: true only if on all
                    setattr(first, field.name, mine and theirs)
                elif isinstance(mine, int):
                    setattr(first, field.name, mine + theirs)
        return first

    return on_every_alias


def _delete_in_batches(
    old: QuerySet[Model],
    report: CleanupReport,
    limits: Limits,
    progress: Callable[[CleanupReport], None] | None,
    before: Callable[[list[int]], int] | None = None,
) -> CleanupReport:
    if report.dry_run:
        report.deleted = old.count()
        return report

    def batch() -> tuple[int, int, int]:
        """(rows found, rows deleted, dependent rows deleted). Counted into
        the report only once committed: a deadlock rolls a batch back and
        retries it."""
        # Locks only this batch's rows (by the index on the age column, under
        # READ COMMITTED: no gap locks); SKIP LOCKED lets a second clean-up
        # take the next rows instead of waiting for these.
        locked = old.select_for_update(skip_locked=True)
        ids = list(locked.values_list("pk", flat=True)[: limits.size])
        if not ids:
            return 0, 0, 0
        dependents = before(ids) if before is not None else 0
        # The permits of these requests are deleted just before (``before``).
        deleted = raw_delete(old.model._default_manager.using(old.db).filter(pk__in=ids))
        return len(ids), deleted, dependents

    report.finished = False
    for found, deleted, dependents in _batches(batch, limits.deadline, f"cleaning {report.what}"):
        report.deleted += deleted
        report.permits += dependents
        if not found:  # a short batch may only mean another clean-up holds rows
            report.finished = True
            break
        report.batches += 1
        if progress is not None:
            progress(report)
    if report.deleted:
        logger.info("%s", report)
    return report


class Limits(NamedTuple):
    """A run's rows per batch, the moment it starts no new batch, and
    whether it only counts what it would change."""

    size: int
    deadline: float | None
    dry_run: bool


def _limits(batch_size: int | None, time_budget: float | None, dry_run: bool) -> Limits:
    """A run's limits, checked before anything is read or written.

    Raises:
        InvalidRequest: a batch size or time budget out of range.
    """
    size = validate_batch_size(batch_size) or app_settings.CLEANUP_BATCH_SIZE
    budget = validate_time_budget(time_budget)
    return Limits(size, None if budget is None else time.monotonic() + budget, dry_run)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _batches(
    work: Callable[[], T], deadline: float | None, doing: str, *, once: bool = False
) -> Iterable[T]:
    """Run ``work`` in its own short transaction, again and again while the
    caller keeps iterating, until the time budget is spent.

    The lock wait is bounded as for acquire. Deadlocks and lock-wait timeouts
    (a sweep and an acquire reclaiming the same expired request at once) are
    retried; if they persist the run stops here and the next run goes on.
    """
    connection = connections[routing.current_alias()]
    while True:
        try:
            yield run_with_retries(connection, lambda: _in_transaction(connection, work))
        except LockContention as exc:
            logger.warning("Sweep stopped %s: %s", doing, exc)
            return
        if once or _past(deadline):
            return


def _in_transaction(connection: BaseDatabaseWrapper, work: Callable[[], T]) -> T:
    with backends.bounded_transaction(connection, app_settings.LOCK_WAIT_TIMEOUT):
        return work()
