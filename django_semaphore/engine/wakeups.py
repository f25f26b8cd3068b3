"""Parked tasks woken under the row locks: which of them fit in the room a
release (or a capacity raise) freed, first in, first out per semaphore.

The wake-up's decision is the engine's, as a grant's is: it locks the
semaphore rows in the one lock order and keeps the room it hands out
(``woken_at``) until the woken task's run claims it. Publishing their
messages is the caller's (``wake.py``), once this commits.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from django.db import transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Min, Q, QuerySet, Sum
from django.utils import timezone

from django_semaphore import backends
from django_semaphore.backends import DatabaseNow
from django_semaphore.conf import app_settings
from django_semaphore.models import ParkedDemand, ParkedTask, Semaphore, Ticket

# Parked tasks read per semaphore by one wake: more than any capacity frees
# at once in practice; the rest wait for the next release.
WAKE_WINDOW = 200


def _window(alias: str, freed: set[int]) -> list[int]:
    """The oldest tasks parked on these semaphores that could fit, by plain
    reads (no lock, no transaction; the wake-up decides under the lock): on
    each semaphore, no more tasks than its room, which each takes at least
    one of. Most releases of a busy semaphore find no room left, or nothing
    parked, and end the wake-up here. A park or a release committed after
    these reads runs a wake-up of its own."""
    semaphores = Semaphore.objects.using(alias).filter(id__in=freed)
    window: set[int] = set()
    for id, capacity, in_use in semaphores.values_list("id", "capacity", "in_use"):
        if (room := capacity - in_use) > 0:
            waiting = _waiting(alias).filter(semaphore_id=id).order_by("task_id")
            window.update(waiting.values_list("task_id", flat=True)[: min(room, WAKE_WINDOW)])
    return sorted(window)


def _waiting(alias: str) -> QuerySet[Any]:
    """The demands of parked tasks not woken and not past their expiry (the
    sweep drops those; they are never published)."""
    live = Q(task__expires_at__isnull=True) | Q(task__expires_at__gt=timezone.now())
    return ParkedDemand.objects.using(alias).filter(live, task__woken_at__isnull=True)


def wake_once(
    connection: BaseDatabaseWrapper, freed: set[int], publish: Callable[[str, list[int]], object]
) -> int:
    """One wake-up's transaction: under the semaphores' row locks, mark the
    oldest parked tasks that fit in the room freed on these semaphores
    (``woken_at``, which keeps their room for them), and have ``publish``
    send their messages once that commits; returns how many it woke."""
    alias = connection.alias
    demands = ParkedDemand.objects.using(alias)
    # Read before the transaction, to hold its lock for as short as can be
    # (grants wait on it); what another wake-up woke meanwhile is left out
    # under it.
    window = _window(alias, freed)
    if not window:
        return 0
    with backends.bounded_transaction(connection, app_settings.LOCK_WAIT_TIMEOUT):
        wanted: dict[int, dict[int, int]] = defaultdict(dict)  # task -> semaphore -> count
        for task_id, semaphore_id, count in demands.filter(task_id__in=window).values_list(
            "task_id", "semaphore_id", "count"
        ):
            wanted[task_id][semaphore_id] = count
        involved = freed | {s for asks in wanted.values() for s in asks}
        # Locked as the grant locks them (name order): the room read here
        # stays true until this commits, and two wake-ups never spend it twice.
        locked = list(
            Semaphore.objects.using(alias)
            .filter(id__in=involved)
            .locked()
            .values_list("id", "capacity", "in_use", "queued_until")
        )
        taken = set(
            ParkedTask.objects.using(alias)
            .filter(id__in=window, woken_at__isnull=False)
            .values_list("id", flat=True)
        )
        window = [task_id for task_id in window if task_id not in taken]
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
                .filter(semaphore_id__in=involved, expires_at__gt=DatabaseNow())
                .values("semaphore_id")
                .annotate(total=Sum("count"))
                .values_list("semaphore_id", "total")
            )
            for semaphore_id, total in tickets:
                room[semaphore_id] -= int(total)
        # Older parked tasks on the other semaphores of a multi-semaphore
        # demand, outside the window: they come first there.
        heads = dict(
            _waiting(alias)
            .filter(semaphore_id__in=involved - freed)
            .values("semaphore_id")
            .annotate(head=Min("task_id"))
            .values_list("semaphore_id", "head")
        )
        woken = _choose(window, wanted, room, heads)
        if woken:
            ParkedTask.objects.using(alias).filter(id__in=woken).update(woken_at=timezone.now())
            transaction.on_commit(lambda: publish(alias, woken), using=alias)
    return len(woken)


def _choose(
    window: list[int],
    wanted: Mapping[int, Mapping[int, int]],
    room: dict[int, int],
    heads: Mapping[int, int],
) -> list[int]:
    """The tasks to wake, first in, first out per semaphore: once a task
    does not fit, no younger task passes it on its semaphores."""
    woken: list[int] = []
    blocked: set[int] = set()
    for task_id in window:
        asks = wanted[task_id]
        behind = any(s in blocked or s not in room or heads.get(s, task_id) < task_id for s in asks)
        if behind or any(room[s] < count for s, count in asks.items()):
            blocked.update(asks)
            continue
        for s, count in asks.items():
            room[s] -= count
        woken.append(task_id)
    return woken
