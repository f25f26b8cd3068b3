"""Who may wait: a task sent under ``holds_permit``'s send-time policies
(``on_conflict``, ``max_waiting``, ``debounce``) by a class that decides
them -- Celery's ``PermitTask``, a Django task's ``permit_task_class`` --
is parked as it is sent, and woken at once where it fits.

One transaction under its semaphores' row locks decides and writes: the
task's tickets and its ``ParkedTask`` row, woken (its tickets keep the
room for its run, so the next send finds none) or waiting in line; a
Django task's result is written in it too. A Celery task's message is
published once that committed, as a woken task's is (``wake.publish``).
Where the caller holds a transaction open, the decision is made aside
and commits at once; the caller's transaction confirms the row (``aside``).
So two sends at once never both pass, and a crash between the decision
and the publish loses nothing: the beat sweep publishes a woken row whose
run never started (``PARKED_REPUBLISH_AFTER``), and a copy that arrives
after the task ran is dropped by its key.

The policies, where the task does not fit:

- ``discard``: it is not sent; the caller is told who holds or waits there.
- ``replace``: the tasks of the same name waiting on the same semaphores
  (not yet woken) are dropped, and it waits in their stead.
- ``max_waiting``: it waits, unless that many already wait parked on one
  of its semaphores (``LineFull``).

``debounce``: the first send of a burst waits parked, room or not, for
that long (``not_before``; a Celery task's wake-up is published for
then, a Django task's result runs then), and every send of the same task
while it still waits collapses into it: nothing is written, and the
caller is told its id.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Count
from django.utils import timezone

from django_semaphore import backends, routing
from django_semaphore.backends import DatabaseNow
from django_semaphore.conf import app_settings
from django_semaphore.engine import families, wakeups
from django_semaphore.exceptions import SemaphoreExhausted, SemaphoreNotFound
from django_semaphore.models import ParkedTask, PermitRequest, Semaphore, Ticket
from django_semaphore.models.parked import SENDING
from django_semaphore.owners import TaskOwner
from django_semaphore.parking import aside, deferred, refuse_a_full_line, wake
from django_semaphore.parking.rows import Row, drop_parked, write
from django_semaphore.retry import run_with_retries
from django_semaphore.states import State

DISCARD = "discard"
REPLACE = "replace"
ON_CONFLICT = (DISCARD, REPLACE)

# The tasks a discarded one is told of, at most.
EXISTING_TOLD = 10
# Decisions a send makes at most when it finds no room and nobody to name there.
DECISIONS = 10


@dataclass(frozen=True)
class Policy:
    """What a send decides (``holds_permit``'s options of the same names)."""

    on_conflict: str | None = None
    max_waiting: int | None = None
    debounce: float | None = None  # seconds

    @property
    def delay(self) -> timedelta | None:
        """``debounce`` as a ``timedelta``."""
        return None if self.debounce is None else timedelta(seconds=self.debounce)


@dataclass(frozen=True)
class Admission:
    """What a send came to. ``existing``: it was discarded, and these tasks
    hold or wait where it found no room (their task ids: holders first,
    then the line in order); empty: it was sent, or ``waits`` parked.
    ``replaced``: the task ids of the waiting tasks it replaced."""

    existing: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    waits: bool = False


class _Discarded(Exception):
    """Rolls the send's transaction back, telling which tasks it found where."""

    def __init__(self, existing: list[str], names: list[str]) -> None:
        self.existing, self.names = existing, names


def enqueue(
    row_of: Callable[[], Row],
    demand: Mapping[str, int],
    policy: Policy,
    *,
    also: str | None = None,
) -> Admission:
    """Decide, under the demand's row locks, whether the task is sent now,
    waits parked, or is discarded; publish it once that committed (when the
    caller's transaction commits, if it has one: an outbox, whose decision
    is made aside so that its locks are as short as a grant's: ``aside``).

    ``row_of`` makes the task's row inside the decision's transaction: a
    Django task's backend writes its result there, rolled back with it when
    the send is discarded; ``also`` is the alias of that write, when it is
    not the semaphores'.

    Raises:
        SemaphoreExhausted: discarded, and no task holds or waits where it
            found no room (a rate limit's window is full, a view holds).
        LineFull: ``max_waiting`` tasks already wait on one of its semaphores.
        SemaphoreNotFound: a semaphore of the demand does not exist.
        SemaphoreError: the database failed (nothing was written or sent).
    """
    alias = routing.alias_for_names(list(demand))
    connection = connections[alias]
    held_open = aside.needed(connection)
    decide = _decide_aside if held_open else _decide
    for _ in range(DECISIONS):
        try:
            lined, parked, replaced = decide(connection, row_of, dict(demand), policy, also)
        except _Discarded as discarded:
            if discarded.existing:
                return Admission(existing=discarded.existing)
            # Nobody to name: a rate limit, a view -- or a holder that
            # released between the decision's reads (a release does not
            # wait for the row lock): decide again.
            names = discarded.names
            continue
        break
    else:
        raise SemaphoreExhausted(names, f"Discarded: no room on {', '.join(names)}.")
    if parked.woken_at is not None:
        transaction.on_commit(functools.partial(wake.publish, alias, [parked.pk]), using=alias)
    elif policy.debounce is not None and not parked.backend:
        # A Django task's result runs when its debounce ends (deferred.park).
        wake.wake_later(alias, set(lined.ids.values()), policy.debounce)
    else:
        if held_open:
            # Wake-ups passed it over while its sender's transaction was open.
            ids = set(lined.ids.values())
            transaction.on_commit(functools.partial(wake.wake, alias, ids), using=alias)
        if lined.rate_limits:
            wake.schedule_slots(alias, lined.rate_limits)
    return Admission(replaced=replaced, waits=parked.woken_at is None)


def _decide(
    connection: BaseDatabaseWrapper,
    row_of: Callable[[], Row],
    demand: dict[str, int],
    policy: Policy,
    also: str | None,
    sending: bool = False,
) -> tuple[wakeups.Lined, ParkedTask, list[str]]:
    """The decision's transaction (``_admit``), retried as its database
    says; with ``also``'s writes in one transaction of that alias around
    it. A family's member is created on first use, as a grant creates it: in
    a transaction of its own, then the send decides again."""
    admit = functools.partial(_admit, connection, row_of, demand, policy, sending)
    both = _atomic_beside(also, connection.alias)
    try:
        with both:
            return run_with_retries(connection, admit)
    except SemaphoreNotFound as missing:
        families.create_members(connection, missing.names, app_settings.LOCK_WAIT_TIMEOUT)
    with both:
        return run_with_retries(connection, admit)


def _decide_aside(
    connection: BaseDatabaseWrapper,
    row_of: Callable[[], Row],
    demand: dict[str, int],
    policy: Policy,
    also: str | None,
) -> tuple[wakeups.Lined, ParkedTask, list[str]]:
    """The decision made aside (``aside``: the caller holds a transaction
    open on the semaphores' alias), committed at once with the task's row
    ``SENDING``; in a savepoint of the caller's transaction, the task's own
    writes (``row_of``: a Django task's result) and the row's confirmation,
    which commit or roll back with the caller's."""
    alias = connection.alias
    with transaction.atomic(using=alias), _atomic_beside(also, alias):
        row = row_of()
        alone = functools.partial(_decide_alone, alias, row, demand, policy)
        lined, parked, replaced = aside.decide(alone)
        sending = ParkedTask.objects.using(alias).filter(pk=parked.pk, not_before=SENDING)
        if not sending.update(not_before=_not_before(policy)):
            # Swept as abandoned, its sender stalled that long: decide again.
            raise _Discarded([], sorted(demand))
        if row.backend and parked.woken_at is None:
            deferred.park(row.task_id, policy.delay)
    aside.watch(alias, parked.pk)
    return lined, parked, replaced


def _decide_alone(
    alias: str, row: Row, demand: dict[str, int], policy: Policy
) -> tuple[wakeups.Lined, ParkedTask, list[str]]:
    """The decision on this thread's own connection, committed at once."""
    return _decide(connections[alias], lambda: row, demand, policy, None, sending=True)


def _atomic_beside(also: str | None, alias: str) -> Any:
    """A transaction of ``also``'s around the decision, where that is
    another alias than the semaphores'."""
    return transaction.atomic(using=also) if also not in (None, alias) else nullcontext()


def _not_before(policy: Policy) -> Any:
    """When a debounced send's delay ends (by the database's clock); ``None``."""
    return None if policy.delay is None else DatabaseNow() + policy.delay


def _admit(
    connection: BaseDatabaseWrapper,
    row_of: Callable[[], Row],
    demand: dict[str, int],
    policy: Policy,
    sending: bool,
) -> tuple[wakeups.Lined, ParkedTask, list[str]]:
    """The decision's transaction: where the task's tickets were taken, its
    row (``SENDING``, made aside, until its sender's transaction confirms
    it), and the task ids it replaced."""
    alias = connection.alias
    with backends.bounded_transaction(connection, app_settings.LOCK_WAIT_TIMEOUT):
        row = row_of()
        alike = {}
        if policy.on_conflict == REPLACE or policy.debounce is not None:
            alike = _waiting_alike(alias, row.task_name, demand)
        if policy.debounce is not None and alike:
            raise _Discarded(list(alike.values()), sorted(demand))
        replaced = _drop(alias, alike) if policy.on_conflict == REPLACE else []
        not_before = _not_before(policy)
        woken = not_before is None
        line_up = functools.partial(
            wakeups.line_up, connection, row.key, demand, row.expires_at, woken=woken,
            priority=row.priority, share=row.share,
        )  # fmt: skip
        lined = line_up()
        if lined.short:
            dropped, freed = aside.drop_abandoned(alias, lined.short)
            if dropped:
                # Rolled-back sends kept that room: line up again without them.
                transaction.on_commit(functools.partial(wake.wake, alias, freed), using=alias)
                lined = line_up()
        if lined.short:
            if policy.on_conflict == DISCARD:
                names = sorted(name for name, id in lined.ids.items() if id in lined.short)
                raise _Discarded(_existing(alias, lined.short), names)
            if policy.max_waiting is not None:
                refuse_a_full_line(alias, row, lined, policy.max_waiting)
        woken = woken and not lined.short
        try:
            woken_at = timezone.now() if woken else None
            not_before = SENDING if sending else not_before
            parked = write(alias, row, woken_at=woken_at, not_before=not_before)
        except IntegrityError:
            # This task id was sent before: that one is the existing task.
            raise _Discarded([row.task_id], sorted(demand)) from None
        if row.backend and not woken and not sending:
            deferred.park(row.task_id, policy.delay)
    return lined, parked, replaced


def _waiting_alike(alias: str, task_name: str, demand: Mapping[str, int]) -> dict[str, str]:
    """The tasks named ``task_name`` waiting (not woken) on each of these
    semaphores, locked first: key -> task id, oldest first. Not those of
    other senders' open transactions (``SENDING``): they may roll back."""
    locked = Semaphore.objects.using(alias).filter(name__in=demand).locked()
    ids = list(locked.values_list("id", flat=True))
    keys = (
        Ticket.objects.using(alias)
        .filter(semaphore_id__in=ids)
        .filter(parked__task_name=task_name, parked__woken_at__isnull=True)
        .exclude(parked__not_before=SENDING)
        .values("external_id")
        .annotate(n=Count("id"))
        .filter(n=len(ids))
        .values_list("external_id", flat=True)
    )
    parked = ParkedTask.objects.using(alias).filter(key__in=list(keys)).order_by("id")
    return dict(parked.values_list("key", "task_id"))


def _drop(alias: str, waiting: dict[str, str]) -> list[str]:
    """Drop these waiting tasks (key -> task id) and their tickets; their task ids."""
    drop_parked(alias, waiting)
    return list(waiting.values())


def _existing(alias: str, semaphore_ids: set[int]) -> list[str]:
    """The tasks that hold or wait on these semaphores, by task id: the
    holders that are task runs (their owner says so), oldest first, then the
    parked tasks in line order."""
    held = (
        PermitRequest.objects.using(alias)
        .filter(state=State.ACQUIRED, permits__semaphore_id__in=semaphore_ids)
        .filter(permits__state=State.ACQUIRED)
        .order_by("id")
        .values_list("owner", flat=True)
    )
    runs = [owner.task_id for owner in map(TaskOwner.parse, held[:EXISTING_TOLD]) if owner]
    waiting = (
        Ticket.objects.using(alias)
        .filter(semaphore_id__in=semaphore_ids, parked__id__isnull=False)
        .order_by("id")
        .values_list("parked__task_id", flat=True)
    )
    return list(dict.fromkeys([*runs, *waiting[:EXISTING_TOLD]]))[:EXISTING_TOLD]
