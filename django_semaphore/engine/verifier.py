"""The verifier of the counters: the exact in-use counter, a rate limit's
slots, and (a repair) the fencing counters.

What a semaphore holds -- ``in_use_counter`` less the releases counted on
its ``ReleaseCounter`` and not yet folded in (``Semaphore.in_use``) -- is
changed in the same transaction as every permit state change, so it never
differs from the sum of the ACQUIRED permits' counts. A difference is
therefore a bug (or rows changed behind the engine's back): the verifier
recomputes the sum under the row locks, corrects the counters and reports
it loudly -- logged at ERROR, the ``counter_drift``
signal, and the metrics counter fed by it. The orphan sweep runs it;
``manage.py semaphore_status --verify`` runs it on demand.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Aggregate, Max, Sum
from django.db.models.functions import Coalesce

from django_semaphore import backends, routing, signals
from django_semaphore.backends import DatabaseNow
from django_semaphore.conf import app_settings
from django_semaphore.engine.statements import statements
from django_semaphore.engine.statements.rows import held as permits_held
from django_semaphore.guards import engine_writes
from django_semaphore.managers import not_closed
from django_semaphore.models import Permit, ReleaseCounter, Semaphore
from django_semaphore.retry import run_with_retries
from django_semaphore.states import State
from django_semaphore.validation import validate_batch_size, validate_keys

logger = logging.getLogger("django_semaphore")


def verify(
    names: Iterable[str] | None = None, *, correct: bool = True, batch_size: int | None = None
) -> list[signals.Drift]:
    """Compare every counter (or those of ``names``) on the app's alias with
    the permits it counts; correct and report each difference.

    ``correct=False`` only reports (the system check, a dry run). Locks at
    most ``batch_size`` semaphore rows at a time, in name order.

    Raises:
        InvalidRequest: ``names`` given as one str or holding a name no
            semaphore could have, or a ``batch_size`` below 1.
    """
    size = validate_batch_size(batch_size) or app_settings.CLEANUP_BATCH_SIZE
    alias = routing.current_alias()
    connection = connections[alias]
    semaphores = Semaphore.objects.using(alias).order_by("name")
    if names is not None:
        semaphores = semaphores.filter(name__in=validate_keys(names, "semaphore name"))
    ids = list(semaphores.values_list("id", flat=True))
    drifts: list[signals.Drift] = []
    for start in range(0, len(ids), size):
        batch = functools.partial(_verify_batch, connection, ids[start : start + size], correct)
        drifts += run_with_retries(connection, batch)
    for drift in drifts:
        _report(alias, drift, corrected=correct)
    return drifts


def _verify_batch(
    connection: BaseDatabaseWrapper, semaphore_ids: Sequence[int], correct: bool
) -> list[signals.Drift]:
    alias = connection.alias
    with backends.bounded_transaction(connection, app_settings.LOCK_WAIT_TIMEOUT):
        # The semaphores (no grant now), then their release counters (no
        # release now), each in its lock order.
        locked = Semaphore.objects.using(alias).filter(id__in=semaphore_ids).locked()
        recorded = list(locked.values_list("id", "name", "in_use_counter", "released_folded"))
        counters = ReleaseCounter.objects.using(alias).filter(semaphore_id__in=semaphore_ids)
        released = dict(counters.locked().values_list("semaphore_id", "released"))
        held = _per_semaphore(alias, semaphore_ids, Sum("count"), state=State.ACQUIRED)
        drifts: dict[int, signals.Drift] = {}
        for id, name, counted, folded in recorded:
            in_use = permits_held(counted, folded, released.get(id, 0))
            if in_use != int(held.get(id) or 0):
                drifts[id] = signals.Drift(name, in_use, int(held.get(id) or 0))
        if correct and drifts:
            if missing := [id for id in drifts if id not in released]:
                # A semaphore inserted behind the engine's back, without one.
                counters.bulk_create([ReleaseCounter(semaphore_id=id) for id in missing])
            with connection.cursor() as cursor:
                statements(connection).set_counted(
                    cursor,
                    {id: (drift.actual, released.get(id, 0)) for id, drift in drifts.items()},
                )
        slot_drifts = _verify_slots(alias, semaphore_ids, correct)
    return [*drifts.values(), *slot_drifts]


def _verify_slots(alias: str, semaphore_ids: Sequence[int], correct: bool) -> list[signals.Drift]:
    """In the caller's transaction, the rows locked: each rate limit's
    ``slots_open`` against the slots it counts (those of its permits that
    end after ``slots_closed_until``: a range of the slots index, never the
    history), corrected where they differ. Correcting, it also closes the
    slots that ended, as a grant does: a rate limit nobody acquires keeps
    its last close recent, which the clean-up of released requests waits
    for (``sweep.clean_released``)."""
    semaphores = Semaphore.objects.using(alias)
    now = semaphores.values_list(DatabaseNow(), flat=True)[:1].get()
    rows = (
        semaphores.rate_limits()
        .filter(id__in=semaphore_ids)
        .annotate(
            counted=Coalesce(not_closed(Permit), 0),
            ended=Coalesce(not_closed(Permit, slot_ends__lte=now), 0),
        )
        .values_list("id", "name", "slots_open", "counted", "ended")
    )
    drifts = []
    for id, name, recorded, actual, ended in rows:
        if recorded != actual:
            drifts.append(signals.Drift(name, recorded, actual, counter="slots"))
        if correct and (recorded != actual or ended):
            # Some slot ended after the last close: ``now`` is past it.
            closed = {"slots_closed_until": now} if ended else {}
            with engine_writes():
                semaphores.filter(pk=id).update(slots_open=actual - ended, **closed)
    return drifts


def _report(alias: str, drift: signals.Drift, *, corrected: bool) -> None:
    logger.error(
        "In-use counter drift on %r (%s): %s%s. This is a bug, or the permit rows "
        "were changed outside django-semaphore; please report it.",
        drift.semaphore,
        alias,
        drift,
        " (corrected)" if corrected else "",
    )
    signals.counter_drift.send_robust(
        sender=Semaphore, drift=drift, corrected=corrected, using=alias
    )


def raise_fencing_counters(alias: str, semaphore_ids: list[int]) -> list[int]:
    """In the caller's transaction: raise each of these fencing counters
    that is below a token already issued to the highest one, so no token is
    issued twice (a repair: only rows written behind the engine's back can
    be so); returns the ids of those raised."""
    # Locked in the one lock order; the highest token is read again once no
    # grant can add one.
    semaphores = Semaphore.objects.using(alias)
    locked = list(
        semaphores.filter(pk__in=semaphore_ids).locked().values_list("pk", "fencing_counter")
    )
    highest = _per_semaphore(alias, semaphore_ids, Max("fencing_token"))
    raised = [pk for pk, counter in locked if counter < highest.get(pk, 0)]
    with engine_writes():
        for pk in raised:
            semaphores.filter(pk=pk).update(fencing_counter=highest[pk])
    return raised


def _per_semaphore(
    alias: str, semaphore_ids: Sequence[int], aggregate: Aggregate, **filters: Any
) -> dict[int, Any]:
    """``aggregate`` over the permits of these semaphores (those matching
    ``filters``), by semaphore id (in one grouped query)."""
    permits = Permit.objects.using(alias).filter(semaphore_id__in=semaphore_ids, **filters)
    grouped = permits.order_by().values("semaphore_id").annotate(value=aggregate)
    return dict(grouped.values_list("semaphore_id", "value"))
