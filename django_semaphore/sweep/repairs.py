"""Repairs of what the engine did not write (a manual edit, a restore, a
crash, raw SQL): held requests with released permits, held permits of
released requests or of no request, fencing counters below a token already
issued. The orphan sweep runs them; ``check --database`` counts them
(:func:`inconsistencies`)."""

from __future__ import annotations

import logging

from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet, Subquery

from django_semaphore import parking, routing, signals
from django_semaphore.engine import verifier
from django_semaphore.engine.releasing import release_permits
from django_semaphore.models import Permit, PermitRequest, Semaphore
from django_semaphore.states import State
from django_semaphore.sweep.batches import Limits, _batches, _past

logger = logging.getLogger("django_semaphore")

# The kinds of repair, as sent in ``data_repaired`` and logged.
REPAIRS = {
    "partly_released": "held requests with released permits, completed",
    "stray_permits": "held permits of released requests, released",
    "orphan_permits": "held permits with no request, released",
    "fencing_counters": "fencing counters below a token already issued, raised",
}


def _partly_released() -> Q:
    """ACQUIRED requests some (or all) of whose permits are not ACQUIRED."""
    return Q(Exists(Permit.objects.filter(request=OuterRef("pk"), state=State.RELEASED))) | ~Q(
        Exists(Permit.objects.filter(request=OuterRef("pk"), state=State.ACQUIRED))
    )


def _stray_permits(alias: str) -> QuerySet[Permit]:
    return Permit.objects.using(alias).filter(state=State.ACQUIRED, request__state=State.RELEASED)


def _orphan_permits(alias: str) -> QuerySet[Permit]:
    """Possible only with foreign key checks off (raw SQL, a partial restore)."""
    return Permit.objects.using(alias).filter(
        ~Exists(PermitRequest.objects.using(alias).filter(pk=OuterRef("request_id"))),
        state=State.ACQUIRED,
    )


def _lowered_counters(alias: str) -> QuerySet[Semaphore]:
    """Semaphores whose fencing counter is below a token already issued: the
    next grant would re-issue it (the unique index refuses it, until the
    clean-up deletes the permit that had it)."""
    # The highest token by the unique (semaphore, fencing_token) index: one probe each.
    tokens = Permit.objects.filter(semaphore=OuterRef("pk")).order_by("-fencing_token")
    highest = Subquery(tokens.values("fencing_token")[:1])
    return Semaphore.objects.using(alias).filter(fencing_counter__lt=highest)


def inconsistencies(alias: str) -> dict[str, int]:
    """How many rows of each kind in :data:`REPAIRS` the orphan sweep would
    repair on ``alias`` now; changes nothing (``check --database`` runs it)."""
    return {
        "partly_released": PermitRequest.objects.using(alias)
        .filter(_partly_released(), state=State.ACQUIRED)
        .count(),
        "stray_permits": _stray_permits(alias).count(),
        "orphan_permits": _orphan_permits(alias).count(),
        "fencing_counters": _lowered_counters(alias).count(),
    }


def _repair_permits(limits: Limits, permits: QuerySet[Permit], repair: str) -> int:
    """Release these ACQUIRED permits (whose requests are not held), batch by batch."""
    if limits.dry_run:
        return permits.count()
    alias = permits.db
    total = 0
    while True:
        # Read without a lock: release_permits() changes only rows still
        # ACQUIRED, so a second sweeper releasing the same ones is harmless.
        ids = list(permits.order_by("pk").values_list("pk", flat=True)[: limits.size])
        if not ids:
            return total

        def batch(ids: list[int] = ids) -> int:
            released, freed = release_permits(alias, ids)
            parking.room_made(alias, freed)
            _announce_repair(alias, repair, ids, released)
            return released

        done = sum(_batches(batch, None, f"repairing {repair}", once=True))
        total += done
        if not done or len(ids) < limits.size or _past(limits.deadline):
            return total


def _raise_fencing_counters(dry_run: bool) -> int:
    """Raise each fencing counter that is below a token already issued to the
    highest one, so no token is issued twice."""
    alias = routing.current_alias()
    lowered = _lowered_counters(alias)
    if dry_run:
        return lowered.count()
    ids = list(lowered.values_list("pk", flat=True))
    if not ids:
        return 0

    def batch() -> int:
        raised = verifier.raise_fencing_counters(alias, ids)
        _announce_repair(alias, "fencing_counters", raised, len(raised))
        return len(raised)

    return sum(_batches(batch, None, "repairing fencing counters", once=True))


def _announce_repair(alias: str, kind: str, ids: list[int], count: int) -> None:
    """Log at WARNING and send ``data_repaired``, once the repair commits."""
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
