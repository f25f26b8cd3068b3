"""Leak recovery and clean-up: what the beat tasks, the ``semaphore_sweep``
command and the admin run.

- :func:`release_orphans` releases requests whose holder will not release
  them: TTL expired (``expired``), owner reported dead by a liveness checker
  (``owner_dead``), held past ``STALENESS_LIMIT`` (``stale``); completes
  half-released requests (rows edited or restored from outside); and has
  ``counter.verify`` check every in-use counter.
- :func:`clean_released` deletes requests released longer ago than
  ``RELEASED_RETENTION``, with their permits; :func:`clean_idle_members`
  deletes family members idle past ``MEMBER_IDLE_LIMIT``;
  :func:`clean_history` deletes ``CapacityChange`` rows older than
  ``HISTORY_RETENTION``;
  :func:`clean_tickets` deletes fair-mode tickets past their deadline.

Every decision about time uses the database's clock (``DatabaseNow``), never
this machine's. Work goes in batches of ``CLEANUP_BATCH_SIZE`` rows, each its
own short transaction, so no row stays locked for long and acquires keep
flowing. Two sweepers running at once (two beat hosts by mistake, cron and
beat) split the work instead of repeating it: each batch locks its rows with
``SELECT ... FOR UPDATE SKIP LOCKED`` and the other sweeper passes over them
(SQLite serializes writers instead, and the second finds nothing left).

With semaphores sharded over several aliases (``SHARDS``), each sweep visits
every alias in turn, its time budget applying to each; the reports add up.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from django.db import connections, transaction
from django.db.models import (
    DateTimeField,
    DurationField,
    Exists,
    ExpressionWrapper,
    F,
    Max,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Value,
)

from django_semaphore import backends, liveness, routing, signals
from django_semaphore.backends import DatabaseNow
from django_semaphore.conf import app_settings
from django_semaphore.engine import counter
from django_semaphore.engine.releasing import release_permits, release_requests
from django_semaphore.exceptions import InvalidRequest, LockContention
from django_semaphore.guards import engine_writes
from django_semaphore.retry import run_with_retries
from django_semaphore.states import ReleaseOutcome
from django_semaphore.validation import (
    validate_batch_size,
    validate_keys,
    validate_time_budget,
)

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import Model
    from django.db.models.expressions import CombinedExpression

    from django_semaphore.models import Permit, Semaphore
logger = logging.getLogger("django_semaphore")

T = TypeVar("T")
P = ParamSpec("P")
Report = TypeVar("Report", "OrphanReport", "CleanupReport")

# A clean-up run stops starting new batches after this many seconds; the next
# run goes on where it stopped. Generous for a 4-hourly task.
DEFAULT_TIME_BUDGET = 600.0


@dataclass
class OrphanReport:
    """How many requests one orphan sweep released, by reason, and what else
    it repaired that the engine did not write (see :data:`REPAIRS`)."""

    # Requests completed whose permits were all or partly released already:
    # a crash between release's updates, or an edit behind the engine's back.
    repaired: int = 0
    expired: int = 0
    owner_dead: int = 0
    stale: int = 0
    stray_permits: int = 0  # ACQUIRED permits of a RELEASED request, released
    orphan_permits: int = 0  # ACQUIRED permits whose request row is gone, released
    fencing_counters: int = 0  # counters raised to the highest token already issued
    # In-use counters found differing from the permits they count (corrected
    # unless dry_run): a bug, reported loudly by ``counter.verify``.
    counter_drift: int = 0
    dry_run: bool = False

    @property
    def total(self) -> int:
        """Requests released."""
        return self.repaired + self.expired + self.owner_dead + self.stale

    @property
    def repairs(self) -> int:
        """Inconsistent states repaired, whichever way they arose."""
        return self.repaired + self.stray_permits + self.orphan_permits + self.fencing_counters

    def __str__(self) -> str:
        verb = "would release" if self.dry_run else "released"
        counts = ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self)[:4])
        text = f"Orphans: {verb} {self.total} ({counts})."
        others = [f for f in fields(self)[4:7] if getattr(self, f.name)]
        if others:
            verb = "would repair" if self.dry_run else "repaired"
            repairs = ", ".join(f"{f.name} {getattr(self, f.name)}" for f in others)
            text += f" Also {verb}: {repairs}."
        if self.counter_drift:
            text += f" {self.counter_drift} in-use counters drifted."
        return text


# The kinds of repair, as sent in ``data_repaired`` and logged.
REPAIRS = {
    "partly_released": "held requests with released permits, completed",
    "stray_permits": "held permits of released requests, released",
    "orphan_permits": "held permits with no request, released",
    "fencing_counters": "fencing counters below a token already issued, raised",
}


@dataclass
class CleanupReport:
    """What one clean-up run deleted."""

    what: str
    deleted: int = 0  # requests, or capacity changes
    permits: int = 0  # permits deleted with their requests
    batches: int = 0
    finished: bool = True  # False: the time budget ran out first
    dry_run: bool = False

    def __str__(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        permits = (
            f" and {self.permits} permits"
            if self.what in {"released requests", "idle family members"}
            else ""
        )
        text = f"{self.what.capitalize()}: {verb} {self.deleted}{permits}"
        if not self.dry_run:
            text += f" in {self.batches} batches"
            if not self.finished:
                text += " (time budget spent; the next run goes on)"
        return text + "."


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


# --- orphans -------------------------------------------------------------------


@_on_every_alias
def release_orphans(
    *,
    batch_size: int | None = None,
    time_budget: float | None = None,
    dry_run: bool = False,
    checkers: Collection[liveness.LivenessChecker] | None = None,
) -> OrphanReport:
    """Release the requests whose holders are gone, and repair what the
    engine did not write.

    In order: held requests with released permits are completed
    (``repaired``); held permits of released requests, and held permits
    whose request row is gone, are released; fencing counters below a token
    already issued are raised (each repair logged at WARNING and sent as
    ``data_repaired``); then TTL-expired requests are released
    (``expired``), then those held past ``STALENESS_LIMIT`` (``stale``),
    then those whose owner the liveness checkers report dead
    (``owner_dead``; only a DEAD answer with no ALIVE one releases).

    Args:
        batch_size: rows per transaction (default ``CLEANUP_BATCH_SIZE``).
        time_budget: seconds after which no new batch starts (default: none).
        dry_run: count what would be released, change nothing.
        checkers: liveness checkers to ask (default: ``LIVENESS_CHECKERS``).

    Returns:
        The counts released, by reason, and the repairs.

    Raises:
        InvalidRequest: ``batch_size`` not an int of at least 1, or
            ``time_budget`` negative or not a number of seconds; nothing is
            changed.
    """
    from django_semaphore.states import ReleaseReason

    size, deadline = _limits(batch_size, time_budget)
    report = OrphanReport(dry_run=dry_run)
    alias = routing.current_alias()
    half_released = _partly_released()
    expired = Q(expires_at__lte=DatabaseNow())
    # The permits are free (or some of them), only the request still says
    # ACQUIRED: every release is one transaction, so only rows changed from
    # outside (a manual edit, a restore, a crash of a version before 0.1)
    # look like this. Its reason is lost; the TTL tells whether it was
    # expiring, otherwise it was its holder's own release. Either way the
    # holder no longer has all it was granted, and a request is held all or
    # nothing.
    report.repaired = _release_matching(
        half_released & expired, ReleaseReason.EXPIRED, size, deadline, dry_run, "partly_released"
    ) + _release_matching(
        half_released & ~expired, ReleaseReason.RELEASED, size, deadline, dry_run, "partly_released"
    )
    # Permits still counted against capacity though nobody holds them.
    report.stray_permits = _release_permits_matching(
        _stray_permits(alias), "stray_permits", size, deadline, dry_run
    )
    report.orphan_permits = _release_permits_matching(
        _orphan_permits(alias), "orphan_permits", size, deadline, dry_run
    )
    report.fencing_counters = _raise_fencing_counters(dry_run)
    report.expired = _release_matching(expired, ReleaseReason.EXPIRED, size, deadline, dry_run)
    report.stale = _release_matching(
        Q(created_at__lte=_ago(app_settings.STALENESS_LIMIT)),
        ReleaseReason.STALE,
        size,
        deadline,
        dry_run,
    )
    report.owner_dead = _release_dead_owners(
        liveness.load_checkers() if checkers is None else list(checkers), size, deadline, dry_run
    )
    # Last: the repairs above changed permits, and kept the counters exact.
    report.counter_drift = len(counter.verify(correct=not dry_run, batch_size=size))
    if report.total or report.repairs or report.counter_drift:
        logger.info("%s", report)
    return report


def _release_matching(
    condition: Q,
    reason: str,
    size: int,
    deadline: float | None,
    dry_run: bool,
    repair: str | None = None,
) -> int:
    """Release every ACQUIRED request matching ``condition``, batch by batch;
    ``repair`` names the kind of repair this is, if it is one."""
    from django_semaphore.models import PermitRequest
    from django_semaphore.states import State

    alias = routing.current_alias()
    held = PermitRequest.objects.using(alias).filter(state=State.ACQUIRED).filter(condition)
    if dry_run:
        return held.count()

    def batch() -> tuple[int, int]:
        # SKIP LOCKED: rows another sweeper is releasing right now are its job.
        ids = list(
            held.select_for_update(skip_locked=True)
            .order_by("pk")
            .values_list("pk", flat=True)[:size]
        )
        released = release_requests(alias, ids, reason)
        if repair is not None:
            _announce_repair(alias, repair, ids, released)
        return len(ids), released

    total = 0
    for found, released in _batches(batch, deadline, f"releasing {reason} requests"):
        total += released
        # Not "found < size": SKIP LOCKED makes a batch short while another
        # sweeper holds rows, and more may wait behind them.
        if not found:
            break
    return total


# --- repairs of what the engine did not write ----------------------------------------


def _partly_released() -> Q:
    """ACQUIRED requests some (or all) of whose permits are not ACQUIRED."""
    from django_semaphore.models import Permit
    from django_semaphore.states import State

    return Q(Exists(Permit.objects.filter(request=OuterRef("pk"), state=State.RELEASED))) | ~Q(
        Exists(Permit.objects.filter(request=OuterRef("pk"), state=State.ACQUIRED))
    )


def _stray_permits(alias: str) -> QuerySet[Permit]:
    from django_semaphore.models import Permit
    from django_semaphore.states import State

    return Permit.objects.using(alias).filter(state=State.ACQUIRED, request__state=State.RELEASED)


def _orphan_permits(alias: str) -> QuerySet[Permit]:
    """Possible only with foreign key checks off (raw SQL, a partial restore)."""
    from django_semaphore.models import Permit, PermitRequest
    from django_semaphore.states import State

    return Permit.objects.using(alias).filter(
        ~Exists(PermitRequest.objects.using(alias).filter(pk=OuterRef("request_id"))),
        state=State.ACQUIRED,
    )


def _lowered_counters(alias: str) -> QuerySet[Semaphore]:
    """Semaphores whose fencing counter is below a token already issued: the
    next grant would re-issue it (the unique index refuses it, until the
    clean-up deletes the permit that had it)."""
    from django_semaphore.models import Permit, Semaphore

    # MAX over the unique (semaphore, fencing_token) index: one index probe each.
    highest = (
        Permit.objects.using(alias)
        .filter(semaphore=OuterRef("pk"))
        .order_by()
        .values("semaphore")
        .annotate(highest=Max("fencing_token"))
        .values("highest")
    )
    return (
        Semaphore.objects.using(alias)
        .annotate(highest=Subquery(highest))
        .filter(fencing_counter__lt=F("highest"))
    )


def inconsistencies(alias: str) -> dict[str, int]:
    """How many rows of each kind in :data:`REPAIRS` the orphan sweep would
    repair on ``alias`` now; changes nothing (``check --database`` runs it)."""
    from django_semaphore.models import PermitRequest
    from django_semaphore.states import State

    return {
        "partly_released": PermitRequest.objects.using(alias)
        .filter(_partly_released(), state=State.ACQUIRED)
        .count(),
        "stray_permits": _stray_permits(alias).count(),
        "orphan_permits": _orphan_permits(alias).count(),
        "fencing_counters": _lowered_counters(alias).count(),
    }


def _release_permits_matching(
    permits: QuerySet[Permit], repair: str, size: int, deadline: float | None, dry_run: bool
) -> int:
    """Release these ACQUIRED permits (whose requests are not held), batch by batch."""
    if dry_run:
        return permits.count()
    alias = permits.db
    total = 0
    while True:
        # Read without a lock: release_permits() changes only rows still
        # ACQUIRED, so a second sweeper releasing the same ones is harmless.
        ids = list(permits.order_by("pk").values_list("pk", flat=True)[:size])
        if not ids:
            return total

        def batch(ids: list[int] = ids) -> int:
            released = release_permits(alias, ids)
            _announce_repair(alias, repair, ids, released)
            return released

        done = sum(_batches(batch, None, f"repairing {repair}", once=True))
        total += done
        if not done or len(ids) < size or _past(deadline):
            return total


def _raise_fencing_counters(dry_run: bool) -> int:
    """Raise each fencing counter that is below a token already issued to the
    highest one, so no token is issued twice."""
    from django_semaphore.models import Permit, Semaphore

    alias = routing.current_alias()
    lowered = _lowered_counters(alias)
    if dry_run:
        return lowered.count()
    ids = list(lowered.values_list("pk", flat=True))
    if not ids:
        return 0

    def batch() -> int:
        # Locked in name order, as acquire locks them; the highest token is
        # read again once no grant can add one.
        locked = list(
            Semaphore.objects.using(alias)
            .select_for_update()
            .filter(pk__in=ids)
            .order_by("name")
            .values_list("pk", "fencing_counter")
        )
        highest = dict(
            Permit.objects.using(alias)
            .filter(semaphore_id__in=ids)
            .order_by()
            .values("semaphore_id")
            .annotate(highest=Max("fencing_token"))
            .values_list("semaphore_id", "highest")
        )
        raised = [pk for pk, counter in locked if counter < highest.get(pk, 0)]
        with engine_writes():
            for pk in raised:
                Semaphore.objects.using(alias).filter(pk=pk).update(fencing_counter=highest[pk])
        _announce_repair(alias, "fencing_counters", raised, len(raised))
        return len(raised)

    return sum(_batches(batch, None, "repairing fencing counters", once=True))


def _announce_repair(alias: str, kind: str, ids: list[int], count: int) -> None:
    """Log at WARNING and send ``data_repaired``, once the repair commits."""
    from django_semaphore.models import PermitRequest

    if not count:
        return

    def announce() -> None:
        logger.warning(
            "Repaired %d %s on database %r (rows %s): the engine did not write this "
            "state (a manual edit, a restore, a crash).",
            count,
            REPAIRS[kind],
            alias,
            ", ".join(map(str, ids[:20])) + (", ..." if len(ids) > 20 else ""),
        )
        signals.data_repaired.send_robust(
            sender=PermitRequest, kind=kind, ids=ids, count=count, using=alias
        )

    transaction.on_commit(announce, using=alias)


def _release_dead_owners(
    checkers: list[liveness.LivenessChecker], size: int, deadline: float | None, dry_run: bool
) -> int:
    from django_semaphore.models import PermitRequest
    from django_semaphore.states import ReleaseReason, State

    if not checkers:
        return 0
    alias = routing.current_alias()
    held = PermitRequest.objects.using(alias).filter(state=State.ACQUIRED).exclude(owner="")
    total, last_pk = 0, 0
    while True:
        page = list(held.filter(pk__gt=last_pk).order_by("pk").values_list("pk", "owner")[:size])
        if not page:
            return total
        last_pk = page[-1][0]
        # Asked with no transaction open and no row locked: a checker may wait
        # on the network (the Celery checker waits for worker replies).
        dead = liveness.dead_owners({owner for _, owner in page}, checkers)
        judged = {pk: owner for pk, owner in page if owner in dead}
        if judged and dry_run:
            total += len(judged)
        elif judged:

            def batch(judged: dict[int, str] = judged) -> int:
                # Re-read under the row lock, after the checkers answered: a
                # run that adopted the permit meanwhile (a task's retry or
                # redelivery rewrites the owner) was not the one judged dead.
                rows = (
                    held.select_for_update(skip_locked=True)
                    .filter(pk__in=judged)
                    .values_list("pk", "owner")
                )
                unchanged = [pk for pk, owner in rows if judged[pk] == owner]
                return release_requests(alias, unchanged, ReleaseReason.OWNER_DEAD)

            total += sum(_batches(batch, None, "releasing requests of dead owners", once=True))
        if len(page) < size or _past(deadline):
            return total


# --- clean-ups -----------------------------------------------------------------


@_on_every_alias
def clean_released(
    *,
    batch_size: int | None = None,
    time_budget: float | None = DEFAULT_TIME_BUDGET,
    dry_run: bool = False,
    progress: Callable[[CleanupReport], None] | None = None,
) -> CleanupReport:
    """Delete requests released longer ago than ``RELEASED_RETENTION``, with
    their permits, ``batch_size`` requests per short transaction, until none
    are left or ``time_budget`` seconds are spent.

    Args:
        batch_size: requests per batch (default ``CLEANUP_BATCH_SIZE``).
        time_budget: seconds after which no new batch starts (``None``: no limit).
        dry_run: count what would be deleted, delete nothing.
        progress: called with the running report after each batch.

    Raises:
        InvalidRequest: as for :func:`release_orphans`.
    """
    from django_semaphore.models import Permit, PermitRequest
    from django_semaphore.states import State

    size, deadline = _limits(batch_size, time_budget)
    alias = routing.current_alias()
    old = PermitRequest.objects.using(alias).filter(
        state=State.RELEASED, released_at__lte=_ago(app_settings.RELEASED_RETENTION)
    )
    report = CleanupReport("released requests", dry_run=dry_run)
    if dry_run:
        report.deleted = old.count()
        report.permits = Permit.objects.using(alias).filter(request__in=old).count()
        return report

    def delete_permits(ids: list[int]) -> int:
        return _raw_delete(Permit.objects.using(alias).filter(request_id__in=ids))

    return _delete_in_batches(
        old.order_by("released_at"),
        report,
        size,
        deadline,
        progress,
        before=delete_permits,
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
    from django_semaphore.models import CapacityChange

    size, deadline = _limits(batch_size, time_budget)
    alias = routing.current_alias()
    old = CapacityChange.objects.using(alias).filter(
        changed_at__lte=_ago(app_settings.HISTORY_RETENTION)
    )
    report = CleanupReport("capacity history", dry_run=dry_run)
    if dry_run:
        report.deleted = old.count()
        return report
    return _delete_in_batches(old.order_by("changed_at"), report, size, deadline, progress)


@_on_every_alias
def clean_idle_members(
    *,
    batch_size: int | None = None,
    time_budget: float | None = DEFAULT_TIME_BUDGET,
    dry_run: bool = False,
    progress: Callable[[CleanupReport], None] | None = None,
) -> CleanupReport:
    """Delete family members (semaphores created on first use) that hold
    nothing, have no live fair waiter nor parked task and were not granted for
    ``MEMBER_IDLE_LIMIT``, with their released permits, dead tickets and
    capacity history, in batches; arguments as for :func:`clean_released`.

    Declared semaphores, family defaults and members whose capacity was
    changed on their own are never deleted. A member acquired again later
    is created again (its fencing tokens still increase, see ``families``).
    """
    from django_semaphore.models import CapacityChange, ParkedDemand, Permit, Semaphore, Ticket
    from django_semaphore.states import State

    size, deadline = _limits(batch_size, time_budget)
    alias = routing.current_alias()
    now = DatabaseNow()
    # The row lock of each batch re-reads these conditions on the latest
    # committed row (InnoDB's locking read; PostgreSQL re-checks a row
    # changed meanwhile), so a member granted since it was listed is kept.
    idle = (
        Semaphore.objects.using(alias)
        .exclude(family="")
        .filter(own_capacity=False, in_use=0, updated_at__lte=_ago(app_settings.MEMBER_IDLE_LIMIT))
        .filter(Q(queued_until__isnull=True) | Q(queued_until__lte=now))
        .filter(~Exists(Permit.objects.filter(semaphore=OuterRef("pk"), state=State.ACQUIRED)))
        # A parked task waits for it: deleting it would drop the task's demand.
        .filter(~Exists(ParkedDemand.objects.filter(semaphore=OuterRef("pk"))))
    )
    report = CleanupReport("idle family members", dry_run=dry_run)
    if dry_run:
        report.deleted = idle.count()
        return report

    def delete_dependents(ids: list[int]) -> int:
        # What CASCADE would delete, without Django's collector reading it:
        # released permits only (nothing is held), and dead tickets.
        for model in (Ticket, CapacityChange):
            _raw_delete(model.objects.using(alias).filter(semaphore_id__in=ids))
        return _raw_delete(Permit.objects.using(alias).filter(semaphore_id__in=ids))

    return _delete_in_batches(
        idle.order_by("family", "updated_at"),
        report,
        size,
        deadline,
        progress,
        before=delete_dependents,
    )


@_on_every_alias
def clean_tickets(
    *, batch_size: int | None = None, time_budget: float | None = None, dry_run: bool = False
) -> CleanupReport:
    """Delete fair-mode tickets past their deadline, in batches.

    They block nobody already (a ticket stops counting at its ``expires_at``):
    their waiters were granted, gave up or died. This only keeps the table
    small; run with the orphan sweep.
    """
    from django_semaphore.models import Ticket

    size, deadline = _limits(batch_size, time_budget)
    dead = Ticket.objects.using(routing.current_alias()).filter(expires_at__lte=DatabaseNow())
    report = CleanupReport("dead tickets", dry_run=dry_run)
    if dry_run:
        report.deleted = dead.count()
        return report
    return _delete_in_batches(dead.order_by("expires_at"), report, size, deadline, None)


def _delete_in_batches(
    old: QuerySet[Model],
    report: CleanupReport,
    size: int,
    deadline: float | None,
    progress: Callable[[CleanupReport], None] | None,
    before: Callable[[list[int]], int] | None = None,
) -> CleanupReport:
    def batch() -> tuple[int, int, int]:
        """(rows found, rows deleted, dependent rows deleted). Counted into
        the report only once committed: a deadlock rolls a batch back and
        retries it."""
        # Locks only this batch's rows (by the index on the age column, under
        # READ COMMITTED: no gap locks); SKIP LOCKED lets a second clean-up
        # take the next rows instead of waiting for these.
        ids = list(old.select_for_update(skip_locked=True).values_list("pk", flat=True)[:size])
        if not ids:
            return 0, 0, 0
        dependents = before(ids) if before is not None else 0
        deleted = _raw_delete(old.model._default_manager.using(old.db).filter(pk__in=ids))
        return len(ids), deleted, dependents

    report.finished = False
    for found, deleted, dependents in _batches(batch, deadline, f"cleaning {report.what}"):
        report.deleted += deleted
        report.permits += dependents
        if found:
            report.batches += 1
            if progress is not None:
                progress(report)
        if not found:  # a short batch may only mean another clean-up holds rows
            report.finished = True
            break
    if report.deleted:
        logger.info("%s", report)
    return report


def _raw_delete(queryset: QuerySet[Model]) -> int:
    # One DELETE ... WHERE id IN (...), without Django's collector fetching
    # every row first: the permits of these requests are deleted just before.
    return queryset._raw_delete(queryset.db)


# --- force release by key ------------------------------------------------------


def force_release(keys: Iterable[str], reason: str | None = None) -> dict[str, ReleaseOutcome]:
    """Release the requests with these keys on an operator's behalf.

    Args:
        keys: ``external_id`` values.
        reason: a ``ReleaseReason`` value (default ``admin``).

    Returns:
        key -> ``RELEASED`` (this call ended it), ``ALREADY_RELEASED`` or ``NOT_FOUND``.

    Raises:
        InvalidRequest: a key that no request could have, ``keys`` given as
            one str, or a ``reason`` that is not a ``ReleaseReason``; nothing
            is released.
    """
    from django_semaphore.states import ReleaseReason

    keys = list(dict.fromkeys(validate_keys(keys)))
    if reason is not None and reason not in ReleaseReason.values:
        raise InvalidRequest(
            f"reason must be one of {', '.join(ReleaseReason.values)}, not {reason!r}."
        )
    outcomes = dict.fromkeys(keys, ReleaseOutcome.NOT_FOUND)
    for alias in routing.aliases():
        # Keys are unique per alias: a key found on one is looked for no further.
        missing = [key for key in keys if outcomes[key] is ReleaseOutcome.NOT_FOUND]
        if missing:
            outcomes |= _force_release_on(alias, missing, reason)
    return outcomes


def _force_release_on(alias: str, keys: list[str], reason: str | None) -> dict[str, ReleaseOutcome]:
    from django_semaphore.models import PermitRequest
    from django_semaphore.states import ReleaseReason, State

    rows = {
        key: (pk, state)
        for key, pk, state in PermitRequest.objects.using(alias)
        .filter(external_id__in=keys)
        .values_list("external_id", "pk", "state")
    }
    outcomes: dict[str, ReleaseOutcome] = {}
    for key in keys:
        if key not in rows:
            outcomes[key] = ReleaseOutcome.NOT_FOUND
            continue
        pk, state = rows[key]
        released = state == State.ACQUIRED and release_requests(
            alias, [pk], reason or ReleaseReason.ADMIN
        )
        outcomes[key] = ReleaseOutcome.RELEASED if released else ReleaseOutcome.ALREADY_RELEASED
    return outcomes


# --- helpers -------------------------------------------------------------------


def _ago(delta: timedelta) -> ExpressionWrapper[CombinedExpression]:
    """``now - delta`` computed by the database, in SQL."""
    return ExpressionWrapper(
        DatabaseNow() - Value(delta, output_field=DurationField()), output_field=DateTimeField()
    )


def _limits(batch_size: int | None, time_budget: float | None) -> tuple[int, float | None]:
    """A run's rows per batch and the moment it starts no new batch, checked
    before anything is read or written.

    Raises:
        InvalidRequest: a batch size or time budget out of range.
    """
    size = validate_batch_size(batch_size) or app_settings.CLEANUP_BATCH_SIZE
    budget = validate_time_budget(time_budget)
    return size, None if budget is None else time.monotonic() + budget


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
    wait = app_settings.LOCK_WAIT_TIMEOUT
    with (
        backends.bounded_lock_wait(connection, wait),
        transaction.atomic(using=connection.alias),
    ):
        backends.start_bounded_transaction(connection, wait)
        return work()
