"""A refused parking task's stand-by, and the holds this process learned.

A task that finds no room stands by in its worker (``stand_by``) before it
parks, probing the room at a pace learned from the holds this process
saw (``learn_hold``; per family for a family's members); see "Stand by first" in
``parking``. The pollers of ``waiting`` pace their probes by the same holds
(``learned_holds``). Every sleep is taken with no transaction open and no
row locked.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

from django_semaphore import process, routing
from django_semaphore.conf import family_of
from django_semaphore.exceptions import AcquireTimeout
from django_semaphore.models import ParkedTask, Ticket

# Seconds; see "Stand by first" in ``parking``. A standby waits at most
# STANDBY_WAIT.
SHORT_HOLD = 1.0
STANDBY_WAIT = 2 * SHORT_HOLD

# What this process saw its holders hold each semaphore for (``learn_hold``): the
# last hold, seconds, by family pattern for a family's member (members of one
# family are held alike, and a family may have thousands), else by name.
_holds: dict[str, float] = {}


# A task's claim of its permit, waiting up to so many seconds: the key it took.
Claim = Callable[[float], str]


class Standbys(process.State):
    """The semaphores a task of this process stands by on (thread and gevent
    pools run many tasks in one process): one each, the others park."""

    def reset(self) -> None:
        self.lock = threading.Lock()
        self.names: Counter[str] = Counter()


STANDBYS = Standbys()


def learn_hold(names: Iterable[str], seconds: float) -> None:
    """Note how long a holder in this process held its permits (a parking
    task's run, or a grant until its ``release``): whether, and how often,
    the next refused ones probe (``stand_by``, ``pause``)."""
    for name in names:
        _holds[_hold_key(name)] = seconds


def _hold_key(name: str) -> str:
    """What a hold of ``name`` is learned under: its family's pattern, so a
    new member costs no stand-by once the family is known held long."""
    family = family_of(name)
    return name if family is None else family.pattern


def learned_holds(names: Iterable[str]) -> list[float]:
    """The holds this process learned for these semaphores (see ``learn_hold``)."""
    keys = {_hold_key(name) for name in names}
    return [_holds[key] for key in keys if key in _holds]


def stand_by(task_id: str, demand: Mapping[str, int], claim: Claim) -> str | None:
    """A task that found no room: wait in this worker for room, as a
    call with a timeout waits (``waiting``'s poller, in the semaphores'
    one line, where parked tasks stand too), and return the key
    ``claim(timeout)`` took. None when it is to park (at once, or
    after ``STANDBY_WAIT``; a woken task keeps its place).

    It stands by unless this process knows its semaphores to be held long,
    or, for a task not woken, a waiter is held back on one of them (it
    lacked room there): that one came first, and while it waits in its
    worker or parked, this one parks, leaving the worker's processes to
    the tasks that have room (another tenant's, on a shared semaphore).

    Raises what ``claim`` raises for anything but a want of room
    (``LiveDuplicate`` included).
    """
    holds = learned_holds(demand)
    if holds and max(holds) >= SHORT_HOLD:
        return None
    alias = routing.alias_for_names(list(demand))
    parked = ParkedTask.objects.using(alias).filter(task_id=task_id).values_list("woken_at")
    match parked.first():
        case None:  # not parked
            # Held back where this demand asks: one waiting for another
            # tenant's cap elsewhere is no reason to park (engine/wakeups).
            ahead = Ticket.objects.using(alias).holding_back()
            if ahead.filter(semaphore__name__in=list(demand)).exists():
                return None
        case (None,):  # parked, not woken: a copy of its message
            return None
    with _one_standby(demand) as standing:
        if not standing:
            return None
        try:
            return claim(STANDBY_WAIT)
        except AcquireTimeout:
            pass
    if not holds:
        # No release came its way: held long, as far as this process knows
        # until one of its own runs ends (``learn_hold``).
        learn_hold(demand, STANDBY_WAIT)
    return None


@contextmanager
def _one_standby(demand: Mapping[str, int]) -> Iterator[bool]:
    """Whether this task may stand by: no other task of this process stands
    by on one of its semaphores (one poller per process and semaphore)."""
    with STANDBYS.lock:
        free = not any(STANDBYS.names[name] for name in demand)
        if free:
            STANDBYS.names.update(demand.keys())
    try:
        yield free
    finally:
        if free:
            with STANDBYS.lock:
                STANDBYS.names.subtract(demand.keys())
