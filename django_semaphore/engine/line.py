"""The line's rule, stated once in Python: a request fits where the
permits held, its count and what the tickets ahead of it that lacked room
ask for (``kept``: their room is kept for them) stay within the capacity.

A ticket's place in line is ``(ranked_at, id)``: when its waiter came --
for a waiter with a share key, its key's turn (``turn``) -- moved earlier
by its priority's head start (``ranked``), then the ticket's id (the order
of the grant transactions that took them). One order on every semaphore:
all of a waiter's tickets have one ``ranked_at``, and take their ids in one
transaction under all of its rows' locks.

The general grant (``grant``, ``fairness.admit``), parking's wake-up
(``wakeups``), the probes and the waiter that reads them (``waiting``) and
``why_waiting`` (``blockers``) ask it here, so that they never disagree; the
SQL routines state the same rule in their one template
(``statements/grant_routine.py``). Pure functions of plain values: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Set
from datetime import datetime, timedelta
from typing import Protocol, TypeVar


def ranked(now: datetime, priority: int, step: timedelta) -> datetime:
    """Where a waiter that comes ``now`` stands in line: ``step`` earlier
    per point of priority (``PRIORITY_STEP``). A head start, not a class:
    a waiter is passed only by those that came within their priorities'
    difference of steps after it, so none waits forever."""
    return now - priority * step


def turn(
    now: datetime,
    turns: tuple[datetime, datetime | None] | None,
    count: int,
    weight: float,
    step: timedelta,
) -> datetime:
    """Where a waiter of a share key takes its turn on a semaphore (start-time
    fair queuing), given the earliest turn waiting there and its own key's
    latest (``turns``; ``None`` when no share key waits there): beside that
    earliest one (``now`` when none waits), or ``step`` per permit it asks,
    divided by its key's ``weight``, after its key's latest -- whichever is
    later. A key that starts waiting is served beside the one at the head
    of the line; one with a backlog spreads it out, so that the keys
    waiting are served in turn, each as often as its weight."""
    if turns is None:
        return now
    first, last = turns
    return first if last is None else max(first, last + step * count / weight)


def room(held: int, capacity: int, kept: int = 0) -> int:
    """What is free for a waiter: neither held nor kept for older waiters
    (negative when more is held than the capacity, as after a lowering)."""
    return capacity - held - kept


def fits(held: int, count: int, capacity: int, kept: int = 0) -> bool:
    """Whether ``count`` permits fit beside those held and those kept."""
    return count <= room(held, capacity, kept)


def rounds(count: int, capacity: int, kept: int = 0) -> int:
    """Capacities' worth of grants that must come before this one's: 0 when
    it is next in line."""
    return (kept + count - 1) // max(capacity, 1)


class Row(Protocol):
    """A semaphore as a caller read it."""

    @property
    def id(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    @property
    def in_use(self) -> int: ...


R = TypeVar("R", bound=Row)


def lacking_room(
    rows: Iterable[R], counts: Mapping[str, int], kept: Mapping[int, int] | None = None
) -> list[R]:
    """The semaphores where ``counts`` (by name) do not fit beside what is
    held and what is kept there (by semaphore id)."""
    kept = kept or {}
    return [s for s in rows if not fits(s.in_use, counts[s.name], s.capacity, kept.get(s.id, 0))]


def takes_tickets(ticketed: bool, short: Set[int], lacked: Set[int]) -> bool:
    """Whether a refused call that waits takes its tickets (or marks where
    they lack room): unless its tickets lack room on every semaphore it is
    short of already."""
    return not (ticketed and short <= lacked)


def deletes_tickets(ticketed: bool, queue_live: bool) -> bool:
    """Whether a granted call deletes its key's tickets (its own, a retry's
    or its parked task's), which must stop holding back others: when it took
    them, or when a queue is live where they may be."""
    return ticketed or queue_live


def ended_queues(live: Iterable[int], held_back: Collection[int], ticketed: bool) -> list[int]:
    """The queues a granted call that took no ticket ends: those live where
    no older ticket is left (``held_back``: where some is; they were granted
    or gave up), so that the next grants take one trip again instead of
    reading an empty queue."""
    return [] if ticketed else [id for id in live if id not in held_back]
