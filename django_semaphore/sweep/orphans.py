"""The orphan sweep: release the requests whose holders will not release
them (TTL expired, owner reported dead, held past ``STALENESS_LIMIT``), after
the repairs of what the engine did not write, then have ``verifier.verify``
check every in-use counter."""

from __future__ import annotations

import logging
import socket
from collections.abc import Collection, Iterable

from django.db.models import Q

from django_semaphore import liveness, parking, routing, signals
from django_semaphore.backends import DatabaseNow
from django_semaphore.conf import app_settings
from django_semaphore.engine import verifier
from django_semaphore.engine.releasing import release_requests
from django_semaphore.models import PermitRequest
from django_semaphore.states import ReleaseReason, State
from django_semaphore.sweep.batches import Limits, _batches, _limits, _on_every_alias, _past
from django_semaphore.sweep.repairs import (
    _announce_repair,
    _orphan_permits,
    _partly_released,
    _raise_fencing_counters,
    _repair_permits,
    _stray_permits,
)
from django_semaphore.sweep.reports import OrphanReport

logger = logging.getLogger("django_semaphore")


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
    then those whose owner is dead (``owner_dead``): a process of this
    machine gone from its process table, or the liveness checkers' verdict
    (only a DEAD answer with no ALIVE one releases).

    Args:
        batch_size: rows per transaction (default ``CLEANUP_BATCH_SIZE``).
        time_budget: seconds after which no new batch starts (default: none).
        dry_run: count what would be released, change nothing.
        checkers: liveness checkers to ask besides the process table
            (default: ``LIVENESS_CHECKERS``).

    Returns:
        The counts released, by reason, and the repairs.

    Raises:
        InvalidRequest: ``batch_size`` not an int of at least 1, or
            ``time_budget`` negative or not a number of seconds; nothing is
            changed.
    """
    limits = _limits(batch_size, time_budget, dry_run)
    report = OrphanReport(dry_run=dry_run)
    alias = routing.current_alias()
    half_released = _partly_released()
    expired = Q(expires_at__lte=DatabaseNow())
    stale = Q(created_at__lte=DatabaseNow() - app_settings.STALENESS_LIMIT)
    # The permits are free (or some of them), only the request still says
    # ACQUIRED: every release is one transaction, so only rows changed from
    # outside (a manual edit, a restore, a crash of a version before 0.1)
    # look like this. Its reason is lost; the TTL tells whether it was
    # expiring, otherwise it was its holder's own release. Either way the
    # holder no longer has all it was granted, and a request is held all or
    # nothing.
    report.repaired = sum(
        _release_matching(limits, half_released & ttl, reason, "partly_released")
        for ttl, reason in ((expired, ReleaseReason.EXPIRED), (~expired, ReleaseReason.RELEASED))
    )
    # Permits still counted against capacity though nobody holds them.
    report.stray_permits = _repair_permits(limits, _stray_permits(alias), "stray_permits")
    report.orphan_permits = _repair_permits(limits, _orphan_permits(alias), "orphan_permits")
    report.fencing_counters = _raise_fencing_counters(dry_run)
    report.expired = _release_matching(limits, expired, ReleaseReason.EXPIRED)
    report.stale = _release_matching(limits, stale, ReleaseReason.STALE)
    report.owner_dead = _release_dead_owners(
        limits, liveness.load_checkers() if checkers is None else list(checkers)
    )
    # Last: the repairs above changed permits, and kept the counters exact.
    report.counter_drift = len(verifier.verify(correct=not dry_run, batch_size=limits.size))
    if report.total or report.repairs or report.counter_drift:
        logger.info("%s", report)
    return report


def verify_counters(names: Iterable[str] | None = None) -> list[signals.Drift]:
    """Check every in-use counter (or those of ``names``) on every alias
    against the permits it counts, correcting and reporting each difference
    (``manage.py semaphore_status --verify``)."""
    return [
        drift for found in routing.on_each_alias(lambda: verifier.verify(names)) for drift in found
    ]


def _release_matching(limits: Limits, condition: Q, reason: str, repair: str = "") -> int:
    """Release every ACQUIRED request matching ``condition``, batch by batch;
    ``repair`` names the kind of repair this is, if it is one."""
    alias = routing.current_alias()
    held = PermitRequest.objects.using(alias).filter(state=State.ACQUIRED).filter(condition)
    if limits.dry_run:
        return held.count()

    def batch() -> tuple[int, int]:
        # SKIP LOCKED: rows another sweeper is releasing right now are its job.
        locked = held.select_for_update(skip_locked=True).order_by("pk")
        ids = list(locked.values_list("pk", flat=True)[: limits.size])
        released, freed = release_requests(alias, ids, reason)
        parking.room_made(alias, freed)
        if repair:
            _announce_repair(alias, repair, ids, released)
        return len(ids), released

    total = 0
    for found, released in _batches(batch, limits.deadline, f"releasing {reason} requests"):
        total += released
        # Not "found < size": SKIP LOCKED makes a batch short while another
        # sweeper holds rows, and more may wait behind them.
        if not found:
            break
    return total


def _release_dead_owners(limits: Limits, checkers: list[liveness.LivenessChecker]) -> int:
    alias = routing.current_alias()
    held = PermitRequest.objects.using(alias).filter(state=State.ACQUIRED).exclude(owner="")
    if not checkers:
        # Only the process table is asked: it judges this machine's owners only.
        held = held.filter(owner__contains=f"{socket.gethostname()} pid ")
    total, last_pk = 0, 0
    while True:
        page = list(
            held.filter(pk__gt=last_pk).order_by("pk").values_list("pk", "owner")[: limits.size]
        )
        if not page:
            return total
        last_pk = page[-1][0]
        # Asked with no transaction open and no row locked: a checker may wait
        # on the network (the Celery checker waits for worker replies).
        dead = liveness.dead_owners({owner for _, owner in page}, checkers)
        judged = {pk: owner for pk, owner in page if owner in dead}
        if judged and limits.dry_run:
            total += len(judged)
        elif judged:

            def batch(judged: dict[int, str] = judged) -> int:
                # Re-read under the row lock, after the checkers answered: a
                # run that adopted the permit meanwhile (a task's retry or
                # redelivery rewrites the owner) was not the one judged dead.
                locked = held.select_for_update(skip_locked=True).filter(pk__in=judged)
                rows = locked.values_list("pk", "owner")
                unchanged = [pk for pk, owner in rows if judged[pk] == owner]
                released, freed = release_requests(alias, unchanged, ReleaseReason.OWNER_DEAD)
                parking.room_made(alias, freed)
                return released

            total += sum(_batches(batch, None, "releasing requests of dead owners", once=True))
        if len(page) < limits.size or _past(limits.deadline):
            return total
