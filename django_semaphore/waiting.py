"""Every wait for room, with no transaction open.

The engine never sleeps: each of its attempts is one transaction that grants
or refuses at once. Whatever waits for room between two attempts is here:

- **An acquire with a timeout** (``wait_for_room``) attempts again until it
  is granted or its deadline passes, pausing between attempts (``pause``):
  a capped exponential backoff with full jitter without a ticket, or a
  ticketed fair waiter's polling by its place in the queue (below).
- **A refused parking task** stands by in its worker (``stand_by``) before it
  parks, probing the counters at a pace learned from the holds this process
  saw (``held``; per family for a family's members); see "Stand by first"
  in ``parking``.

Every sleep is taken with no transaction open and no row locked.

**One poller per line.** Waiters of one process on the same demand form a
line (``_Line``): only its first waiter polls the database, the others sleep
on a condition until it is their turn. So a process issues one attempt per
poll interval per demand, however many threads wait. The interval adapts to
the waiter's place. Next in line (the permits asked for by the tickets ahead
of it, plus its own, fit in the capacity: the next releases are for it), it
probes every ``PROBE_EVERY`` with one cheap read of what is in use (no lock,
no transaction) and attempts as soon as there is room for it, or after
``NEXT_IN_LINE_ATTEMPT`` at the latest (a reclaim of expired permits needs an
attempt); refused only by older tickets whose waiters lack room elsewhere
(it has room already), it polls as one a round of holds back. Further back,
it attempts again after ``PROBE_EVERY`` more per capacity's worth of tickets
ahead of it (each takes at least one round of holds), at most ``POLL_CAP``.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore import routing
from django_semaphore.engine.fairness import Place
from django_semaphore.engine.families import family_of
from django_semaphore.engine.statements import room_for
from django_semaphore.exceptions import AcquireTimeout, LiveDuplicate, SemaphoreExhausted
from django_semaphore.models import ParkedDemand, ParkedTask, PermitRequest, Semaphore

# Waiting for room: capped exponential backoff with full jitter, so waiters
# spread out instead of stampeding the row the moment a permit is released.
BACKOFF_BASE = 0.05
BACKOFF_CAP = 2.0
BACKOFF_DOUBLINGS = 10  # BACKOFF_BASE * 2**10 > BACKOFF_CAP
# Seconds, before a jitter of x0.5-1 (see the module's docstring).
PROBE_EVERY = 0.02
NEXT_IN_LINE_ATTEMPT = 1.0
POLL_CAP = 2.0

# Seconds; see "Stand by first" in ``parking``. A standby waits at most
# STANDBY_WAIT, probing every tenth of the hold, within STANDBY_PROBE, or
# every STANDBY_PROBE[1] while this process has seen no hold.
SHORT_HOLD = 1.0
STANDBY_WAIT = 2 * SHORT_HOLD
STANDBY_PROBE = (0.001, 0.02)

# What this process saw its parked tasks hold each semaphore for (``held``):
# the last hold, seconds, by family pattern for a family's member (members
# of one family are held alike, and a family may have thousands), else by name.
_holds: dict[str, float] = {}
# The semaphores a task of this process stands by on (thread and gevent
# pools run many tasks in one process): one each, the others park.
_standing: Counter[str] = Counter()
_standing_lock = threading.Lock()


# --- an acquire's wait ---------------------------------------------------------------


def wait_for_room(
    connection: BaseDatabaseWrapper,
    attempt: Callable[[], PermitRequest],
    place: Place,
    wait: float,
    deadline: float,
    refused: SemaphoreExhausted,
) -> PermitRequest:
    """Retry ``attempt`` until granted or ``deadline``. Only the first waiter
    of this process's line polls (see the module's docstring); every sleep
    is taken with no transaction open and no row locked.

    Args:
        connection: the alias's connection ``attempt`` runs on.
        attempt: one grant transaction; raises ``SemaphoreExhausted`` when
            there is no room.
        place: the call's standing in its semaphores' queues.
        wait: the call's timeout, seconds (for the error's message).
        deadline: ``time.monotonic()`` past which it gives up.
        refused: the refusal of the attempt made before waiting.

    Returns:
        What the granting ``attempt`` returned.

    Raises:
        AcquireTimeout: ``deadline`` passed with no room.
    """
    with waiting_line(place) as turn:
        for polls in itertools.count(1):
            queued_behind = not turn.is_first()
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not turn.wait(remaining):
                raise AcquireTimeout(refused.names, f"{refused} (waited {wait:g}s)")
            if not queued_behind:
                # The last attempt may come at the deadline, never after it.
                pause(place, connection, _backoff(polls), deadline)
            try:
                return attempt()
            except SemaphoreExhausted as exc:
                refused = exc
    raise AssertionError("unreachable")  # pragma: no cover


def _backoff(attempt: int) -> float:
    # The exponent is capped: past the cap it changes nothing, and a long
    # wait's thousandth poll would overflow a float.
    return random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2 ** min(attempt, BACKOFF_DOUBLINGS)))


def pause(place: Place, connection: BaseDatabaseWrapper, backoff: float, deadline: float) -> None:
    """Wait between two attempts of this line's first waiter; see the
    module's docstring.

    Args:
        place: the waiter's standing, as its last attempt left it.
        connection: the connection a next-in-line waiter probes on.
        backoff: the interval of a waiter without a ticket, seconds.
        deadline: ``time.monotonic()``; the pause never runs past it.
    """
    now = time.monotonic()
    if not place.ticketed:
        time.sleep(max(min(backoff, deadline - now), 0))
        return
    if place.ahead or not place.short:
        # Each capacity's worth ahead takes at least one round of holds. A
        # waiter refused only by older tickets (their waiters lack room
        # elsewhere) has room already: probing it would attempt at once, again
        # and again, so it waits as one a round of holds back.
        rounds = max(place.ahead, 1)
        interval = min(PROBE_EVERY * (1 + rounds), POLL_CAP) * random.uniform(0.5, 1.0)
        time.sleep(max(min(interval, deadline - now), 0))
        return
    until = min(deadline, now + NEXT_IN_LINE_ATTEMPT * random.uniform(0.5, 1.0))
    while (now := time.monotonic()) < until:
        time.sleep(min(PROBE_EVERY * random.uniform(0.5, 1.0), until - now))
        if _room_for(connection, place):
            return


def _room_for(connection: BaseDatabaseWrapper, place: Place) -> bool:
    """Whether every semaphore of ``place`` has room for it now."""
    return room_for(
        connection,
        [(id, place.demand.counts[name], capacity) for id, name, capacity in place.semaphores],
    )


# --- this process's waiters: one poller per line ------------------------------------


class _Line:
    """This process's waiters on one demand; the one with the lowest ``seq``
    polls, the others wait for their turn."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.places: list[Place] = []

    def head(self) -> Place:
        return min(self.places, key=lambda place: place.seq)


_lines: dict[tuple[Any, ...], _Line] = {}
_lines_guard = threading.Lock()


class Turn:
    """A waiter's membership of its line."""

    def __init__(self, line: _Line, place: Place) -> None:
        self._line = line
        self._place = place

    def is_first(self) -> bool:
        """Whether this waiter is first in its line now (the one that polls)."""
        with self._line.condition:
            return self._line.head() is self._place

    def wait(self, timeout: float) -> bool:
        """Block until this waiter is first in its line; ``False`` if
        ``timeout`` ran out first."""
        with self._line.condition:
            return self._line.condition.wait_for(
                lambda: self._line.head() is self._place, timeout=max(timeout, 0)
            )


@contextmanager
def waiting_line(place: Place) -> Iterator[Turn]:
    """Join this process's line for ``place.demand`` while waiting for room.

    Ticketed and unticketed waiters never share a line: an unticketed first
    waiter would poll behind its line's tickets while they wait their turn.
    """
    key = (place.ticketed, *sorted(place.demand.counts.items()))
    with _lines_guard:
        line = _lines.setdefault(key, _Line())
        with line.condition:
            line.places.append(place)
    try:
        yield Turn(line, place)
    finally:
        with _lines_guard, line.condition:
            line.places.remove(place)
            if not line.places:
                del _lines[key]
            # The next waiter polls at once: room may be left after this one.
            line.condition.notify_all()


# --- a parking task's stand by ------------------------------------------------------


def held(demand: Mapping[str, int], seconds: float) -> None:
    """Note how long a parking task's run in this process held its permits:
    whether, and how often, the next refused ones probe (``stand_by``)."""
    for name in demand:
        _holds[_hold_key(name)] = seconds


def _hold_key(name: str) -> str:
    """What a hold of ``name`` is learned under: its family's pattern, so a
    new member costs no stand-by once the family is known held long."""
    family = family_of(name)
    return name if family is None else family.pattern


def _learned_holds(demand: Mapping[str, int]) -> list[float]:
    keys = {_hold_key(name) for name in demand}
    return [_holds[key] for key in keys if key in _holds]


def stand_by(task_id: str, demand: Mapping[str, int], claim: Callable[[], str]) -> str | None:
    """A task that found no room: wait in this worker for a release to make
    some, and return the key ``claim`` then took. None when it is to park
    (at once, or after ``STANDBY_WAIT``; a woken task keeps its place).

    It stands by unless this process knows its semaphores to be held long,
    or, for a task not woken, parked tasks are held back on them (they
    lacked room there): those came first.

    Raises what ``claim`` raises for anything but a want of room
    (``LiveDuplicate`` included).
    """
    holds = _learned_holds(demand)
    if holds and max(holds) >= SHORT_HOLD:
        return None
    alias = routing.alias_for_names(list(demand))
    wanted = [
        (id, demand[name], capacity)
        for id, name, capacity in Semaphore.objects.using(alias)
        .filter(name__in=list(demand))
        .values_list("id", "name", "capacity")
    ]
    parked = ParkedTask.objects.using(alias).filter(task_id=task_id).values_list("woken_at")
    match parked.first():
        case None:  # not parked
            # Only tasks held back there come first: one waiting for another
            # tenant's cap is no reason to park (engine/wakeups).
            queued = ParkedDemand.objects.using(alias).filter(
                semaphore_id__in=[id for id, _, _ in wanted],
                lacked=True,
                task__woken_at__isnull=True,
            )
            if queued.exists():
                return None
        case (None,):  # parked, not woken: a copy of its message
            return None
    with _one_standby(demand) as standing:
        if not standing:
            return None
        low, high = STANDBY_PROBE
        interval = min(max(min(holds) / 10, low), high) if holds else high
        deadline = time.monotonic() + STANDBY_WAIT
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(interval, left))
            if not room_for(connections[alias], wanted):
                continue
            try:
                return claim()
            except LiveDuplicate:
                raise
            except SemaphoreExhausted:
                # Taken first, or kept for fair waiters: probe less often.
                interval = min(2 * interval, high)
    if not holds:
        # No release came its way: held long, as far as this process knows
        # until one of its own runs ends (``held``).
        held(demand, STANDBY_WAIT)
    return None


@contextmanager
def _one_standby(demand: Mapping[str, int]) -> Iterator[bool]:
    """Whether this task may stand by: no other task of this process stands
    by on one of its semaphores (one poller per process and semaphore)."""
    with _standing_lock:
        free = not any(_standing[name] for name in demand)
        if free:
            _standing.update(demand.keys())
    try:
        yield free
    finally:
        if free:
            with _standing_lock:
                _standing.subtract(demand.keys())
