"""Parked tasks woken under the row locks: which of them fit in the room a
release (or a capacity raise) freed.

**Order, tenants.** A parked task that does not fit holds back younger
tasks only on the semaphores where it lacks room: there first in, first out
holds. Once it lacked room on a semaphore (``ParkedDemand.lacked``, set when
it parked or when a wake-up passed it over) it keeps holding back there
until it is woken, so a release elsewhere cannot snatch that room from it
again and again: no demand starves (the bound is in ``docs/parked.md``).
Where it has room it holds back nobody: tenant A's tasks waiting for A's own
cap never keep tenant B's from the shared ``exports``.

The wake-up's decision is the engine's, as a grant's is: it locks the
semaphore rows in the one lock order and keeps the room it hands out
(``woken_at``) until the woken task's run claims it. Publishing their
messages is the caller's (``parking/wake.py``), once this committed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Exists, F, Min, OuterRef, Q, QuerySet, Subquery, Sum
from django.utils import timezone

from django_semaphore import backends
from django_semaphore.backends import DatabaseNow
from django_semaphore.conf import app_settings
from django_semaphore.models import ParkedDemand, ParkedTask, Permit, Semaphore, Ticket

# Parked tasks read per semaphore and kind by one wake: more than any
# capacity frees at once in practice; the rest wait for the next release.
CANDIDATES_READ = 200


def _candidates(alias: str, freed: set[int]) -> list[int]:
    """The parked tasks that may fit in the room on these semaphores, by
    plain reads (no lock, no transaction; the wake-up decides under the
    lock). On each semaphore with room, by two indexed reads of at most
    its room each (every task takes at least one): the oldest tasks that
    lacked room there (they come first), and the oldest that lacked room
    nowhere else (younger ones that may pass the others). A task held back
    elsewhere is found by the wake-ups of the semaphores it lacks. Most
    releases of a busy semaphore find no room left, or nothing parked, and
    end the wake-up here. A park or a release committed after these reads
    runs a wake-up of its own."""
    semaphores = Semaphore.objects.using(alias).filter(id__in=freed)
    candidates: set[int] = set()
    for id, capacity, in_use in semaphores.values_list("id", "capacity", F("in_use")):
        if (room := capacity - in_use) > 0:
            waiting = _waiting(alias).filter(semaphore_id=id).order_by("task_id")
            for kind in (Q(lacked=True), Q(elsewhere=False)):
                oldest = waiting.filter(kind).values_list("task_id", flat=True)
                candidates.update(oldest[: min(room, CANDIDATES_READ)])
    return sorted(candidates)


def _waiting(alias: str) -> QuerySet[Any]:
    """The demands of parked tasks not woken and not past their expiry (the
    sweep drops those; they are never published)."""
    live = Q(task__expires_at__isnull=True) | Q(task__expires_at__gt=timezone.now())
    return ParkedDemand.objects.using(alias).filter(live, task__woken_at__isnull=True)


def next_slots(alias: str, semaphore_ids: set[int]) -> dict[int, float]:
    """Semaphore id -> seconds until the next slot ends, for the rate limits
    (windowed semaphores) among these that parked tasks wait on: they gain
    room then, and no release will say so. By plain reads, no lock."""
    slots = Permit.objects.using(alias).filter(
        semaphore=OuterRef("pk"), slot_ends__gt=DatabaseNow()
    )
    rows = (
        Semaphore.objects.using(alias)
        .filter(id__in=semaphore_ids, window__isnull=False)
        .filter(Exists(_waiting(alias).filter(semaphore=OuterRef("pk"))))
        .annotate(
            next_ends=Subquery(slots.order_by("slot_ends").values("slot_ends")[:1]),
            db_now=DatabaseNow(),
        )
        .values_list("id", "next_ends", "db_now")
    )
    return {
        id: max((ends - now).total_seconds(), 0.0) for id, ends, now in rows if ends is not None
    }


def wake_once(connection: BaseDatabaseWrapper, freed: set[int]) -> list[int]:
    """One wake-up's transaction: under the semaphores' row locks, mark the
    oldest parked tasks that fit in the room freed on these semaphores
    (``woken_at``, which keeps their room for them); returns their ids, for
    the caller to publish once this is committed."""
    alias = connection.alias
    demands = ParkedDemand.objects.using(alias)
    # Read before the transaction, to hold its lock for as short as can be
    # (grants wait on it); what another wake-up woke meanwhile is left out
    # under it.
    candidates = _candidates(alias, freed)
    if not candidates:
        return []
    with backends.bounded_transaction(connection, app_settings.LOCK_WAIT_TIMEOUT):
        wanted: dict[int, dict[int, int]] = defaultdict(dict)  # task -> semaphore -> count
        lacked: dict[int, set[int]] = defaultdict(set)  # task -> semaphores it lacked
        for task_id, semaphore_id, count, was_lacking in demands.filter(
            task_id__in=candidates
        ).values_list("task_id", "semaphore_id", "count", "lacked"):
            wanted[task_id][semaphore_id] = count
            if was_lacking:
                lacked[task_id].add(semaphore_id)
        involved = freed | {s for asks in wanted.values() for s in asks}
        # Locked as the grant locks them (name order): the room read here
        # stays true until this commits, and two wake-ups never spend it twice.
        locked = list(
            Semaphore.objects.using(alias)
            .filter(id__in=involved)
            .locked()
            .values_list("id", "capacity", F("in_use"), "queued_until")
        )
        taken = set(
            ParkedTask.objects.using(alias)
            .filter(id__in=candidates, woken_at__isnull=False)
            .values_list("id", flat=True)
        )
        candidates = [task_id for task_id in candidates if task_id not in taken]
        room = {id: capacity - in_use for id, capacity, in_use, _ in locked}
        reserved = (
            demands.filter(semaphore_id__in=involved, task__woken_at__isnull=False)
            .values("semaphore_id")
            .annotate(total=Sum("count"))
            .values_list("semaphore_id", "total")
        )
        for semaphore_id, total in reserved:
            room[semaphore_id] -= int(total)
        if any(queued_until is not None for *_, queued_until in locked):
            # Fair-mode waiters came first: a woken task would only be refused.
            tickets = (
                Ticket.objects.using(alias)
                .filter(semaphore_id__in=involved, lacked=True, expires_at__gt=DatabaseNow())
                .values("semaphore_id")
                .annotate(total=Sum("count"))
                .values_list("semaphore_id", "total")
            )
            for semaphore_id, total in tickets:
                room[semaphore_id] -= int(total)
        # The oldest parked task that lacked room on each semaphore, a
        # candidate or not: it holds back the younger ones there.
        heads = dict(
            _waiting(alias)
            .filter(semaphore_id__in=involved, lacked=True)
            .values("semaphore_id")
            .annotate(head=Min("task_id"))
            .values_list("semaphore_id", "head")
        )
        choice = _choose(candidates, wanted, room, heads, lacked)
        _mark_lacking(alias, choice.lacking)
        if choice.woken:
            ParkedTask.objects.using(alias).filter(id__in=choice.woken).update(
                woken_at=timezone.now()
            )
    return choice.woken


@dataclass
class Choice:
    """A wake-up's decision: the tasks to wake, and the semaphores each task
    passed over newly lacked room on (it holds back younger tasks there
    from now on)."""

    woken: list[int] = field(default_factory=list)
    lacking: dict[int, set[int]] = field(default_factory=dict)


def _choose(
    candidates: list[int],
    wanted: Mapping[int, Mapping[int, int]],
    room: dict[int, int],
    heads: Mapping[int, int],
    lacked: Mapping[int, set[int]],
) -> Choice:
    """The tasks to wake, oldest first: a task that does not fit holds back
    the younger ones only on the semaphores where it lacks room now or
    lacked it before (``heads`` are the oldest of those, candidates or
    not); elsewhere they may pass it."""
    choice = Choice()
    held_back: set[int] = set()  # semaphores a task passed over holds back
    for task_id in candidates:
        asks = wanted[task_id]
        behind = any(s in held_back or heads.get(s, task_id) < task_id for s in asks)
        short = {s for s, count in asks.items() if s not in room or room[s] < count}
        if behind or short:
            previously = lacked.get(task_id, set())
            held_back.update(short | previously)
            if short - previously:
                choice.lacking[task_id] = short - previously
            continue
        for s, count in asks.items():
            room[s] -= count
        choice.woken.append(task_id)
    return choice


def _mark_lacking(alias: str, lacking: Mapping[int, set[int]]) -> None:
    """Record where the tasks passed over lacked room (see ``mark_lacked``)."""
    for task_id, semaphore_ids in lacking.items():
        mark_lacked(alias, task_id, semaphore_ids)


def mark_lacked(alias: str, task_id: int, semaphore_ids: set[int]) -> None:
    """The parked task lacked room on these semaphores: it holds back younger
    tasks there from now on, and on its other semaphores it has lacked room
    elsewhere. Flags are only ever set: a task keeps its place once taken."""
    if not semaphore_ids:
        return
    demands = ParkedDemand.objects.using(alias).filter(task_id=task_id)
    demands.filter(semaphore_id__in=semaphore_ids).update(lacked=True)
    others = list(demands.filter(lacked=True).values_list("semaphore_id", flat=True))
    if len(others) > 1:
        demands.update(elsewhere=True)
    else:
        demands.exclude(semaphore_id__in=others).update(elsewhere=True)
