"""Every wait for room, with no transaction open.

The engine never sleeps: each of its attempts is one transaction that grants
or refuses at once. Whatever waits for room between two attempts is here:

- **An acquire with a timeout** (``wait_for_room``) attempts again until it
  is granted or its deadline passes (below).
- **A refused parking task** stands by in its worker (``standby``).

Every sleep is taken with no transaction open and no row locked.

**One poller per process and semaphore.** This process's waiters on a
semaphore form its queue (``_Waiters``), first come first served: ticketed
waiters first, in their tickets' order (their tickets hold the others back
anyway), then the others in the order they came. A waiter wants the
semaphores its last refusal named; it holds back the waiters behind it only
on those, so one short on its own tenant's cap never keeps a neighbour from
a shared semaphore that has room. A waiter whose turn it is (nobody ahead of
it wants what it wants) is its semaphores' poller; the others sleep until
their turn. A newcomer with a timeout that finds this process's waiters
wanting its semaphores queues behind them instead of passing them.

**Woken at once.** A release in this process (``released``: ``release()``,
``permit()``'s exit, a task's or a view's end) wakes the poller of each
semaphore it freed at once: no database statement, and none at all when this
process has no waiter there. On PostgreSQL the release also sends a
``NOTIFY`` after its commit when this process saw waiting on those
semaphores lately, and each process with waiters there ``LISTEN``\\s on one
daemon connection (``_Listener``), so a release anywhere wakes them.
Probes remain the fallback (MariaDB has no notify).

**The pace of probes** is learned from the holds this process observed
(``granted`` then ``released``, as a parking task's are through
``standby.held``).
A ticketed poller probes the counters (one plain read, no lock: what is
free, the grants made, and what the tickets ahead of it ask for) every
``PROBES_PER_HOLD``-th of a hold, within ``PROBE_BOUNDS``, and attempts when
the grant would say yes: room for it beside those tickets. Further back it
waits as many holds as the capacity takes to release what it and those
ahead need. A waiter without a ticket probes once a hold. While the
counters show no grant for two holds the pace doubles, up to ``POLL_CAP``;
an attempt comes at least every ``NEXT_IN_LINE_ATTEMPT`` or pace (a reclaim
of expired permits needs one).

**No starvation without fair mode.** A waiter that did not ask for fair mode
may be passed by newcomers (the client that just released asks again at
once). Once others were granted while it waited ``STARVING_HOLDS`` holds
(within ``STARVING_BOUNDS``) it takes a ticket at its next attempt, as a
fair waiter does, and newcomers queue behind it (Go's ``sync.Mutex``
starvation mode does the same): not-fair mode bounds a wait, fair mode
orders every waiter from its first refusal. A semaphore that merely stays
full (nobody granted) never makes a waiter take one.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore.engine.fairness import Place
from django_semaphore.engine.statements.counters import Counters, counters
from django_semaphore.exceptions import AcquireTimeout, SemaphoreExhausted
from django_semaphore.models import PermitRequest
from django_semaphore.standby import held, learned_holds

logger = logging.getLogger("django_semaphore")

# Seconds. A ticketed poller probes PROBES_PER_HOLD times a hold it learned,
# within PROBE_BOUNDS (every PROBE_EVERY while it knows none; one without a
# ticket once a hold, or every UNTICKETED_PROBE), slows down (doubling up to
# POLL_CAP) once two holds passed with no grant, and attempts at least every
# NEXT_IN_LINE_ATTEMPT or pace; each interval takes a jitter of x0.5-1.
PROBE_EVERY = 0.02
PROBES_PER_HOLD = 4
PROBE_BOUNDS = (0.002, 0.25)
NEXT_IN_LINE_ATTEMPT = 1.0
UNTICKETED_PROBE = 0.5  # a waiter without a ticket that knows no hold
NOTIFY_SPREAD = 0.01  # a not-fair poller that heard a release probes within this
POLL_CAP = 2.0
# A waiter without a ticket takes one after STARVING_HOLDS holds, within
# STARVING_BOUNDS (the upper bound while this process knows no hold).
STARVING_HOLDS = 20
STARVING_BOUNDS = (0.05, 0.5)
# A release sends NOTIFY (PostgreSQL) when this process saw a wait on one of
# its semaphores within so many seconds: elsewhere it is sent to nobody.
NOTIFY_AFTER_WAIT = 10.0
CHANNEL = "django_semaphore_room"
# The grants of this process whose release it may see (``granted``): at most
# so many, the oldest forgotten first (a key released elsewhere never comes back).
GRANTS_KEPT = 10_000
# Seconds a listener waits for a notification before it checks that it is
# still wanted, after a failed connection before it tries again, and with no
# waiter before it closes its connection (waiters come and go between holds).
LISTEN_CHECK, LISTEN_RETRY, LISTEN_IDLE = 1.0, 2.0, 2.0


# --- an acquire's wait ---------------------------------------------------------------


def wait_for_room(
    connection: BaseDatabaseWrapper,
    attempt: Callable[[], PermitRequest],
    place: Place,
    wait: float,
    deadline: float,
    refused: SemaphoreExhausted,
) -> PermitRequest:
    """Retry ``attempt`` until granted or ``deadline``, as this process's
    poller of its semaphores when it is its turn (see the module's
    docstring); every sleep is taken with no transaction open and no row
    locked.

    Args:
        connection: the alias's connection ``attempt`` runs on.
        attempt: one grant transaction; raises ``SemaphoreExhausted`` when
            there is no room.
        place: the call's standing in its semaphores' queues.
        wait: the call's timeout, seconds (for the error's message).
        deadline: ``time.monotonic()`` past which it gives up.
        refused: the refusal of the attempt made before waiting (or of none,
            when it queued behind this process's waiters at once).

    Returns:
        What the granting ``attempt`` returned.

    Raises:
        AcquireTimeout: ``deadline`` passed with no room.
    """
    alias = connection.alias
    _saw_wait(alias, place.demand.names)
    with WAITERS.queued(alias, place, refused.names) as waiter:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not WAITERS.wait_turn(waiter, remaining):
                raise AcquireTimeout(refused.names, f"{refused} (waited {wait:g}s)")
            woken = waiter.woken.is_set() and not waiter.probe_now
            if not woken:
                # The last attempt may come at the deadline, never after it.
                pause(waiter, connection, deadline)
            waiter.woken.clear()
            if _starving(waiter):
                place.fair = True  # takes a ticket at this attempt: see the module's docstring
            try:
                return attempt()
            except SemaphoreExhausted as exc:
                refused = exc
                waiter.passed |= woken or waiter.expected_room
                WAITERS.refused(waiter, exc.names)


def queued_here(alias: str, names: Iterable[str]) -> bool:
    """Whether waiters of this process without a ticket want one of
    ``names``: a newcomer with a timeout queues behind them instead of
    passing them. Where one has a ticket the newcomer attempts: tickets keep
    the order (it takes its own on a fair semaphore, or is refused)."""
    return WAITERS.wanted(alias, names)


def pause(waiter: _Waiter, connection: BaseDatabaseWrapper, deadline: float) -> None:
    """Wait between two attempts of a poller: until it is woken, its probe
    finds room for it and no ticket ahead of it, or its interval passed; see
    the module's docstring.

    Args:
        waiter: the poller, with its standing as its last attempt left it.
        connection: the connection it probes on.
        deadline: ``time.monotonic()``; the pause never runs past it.
    """
    place = waiter.place
    hold = _learned_hold(place.demand.names)
    now = time.monotonic()
    if waiter.expected_room:
        # Refused where its probe saw room (a newcomer took it first): a
        # round of holds before the next probe, or it would attempt at once
        # again and again.
        interval = min(hold or PROBE_EVERY, POLL_CAP) * random.uniform(0.5, 1.0)
        if waiter.woken.wait(max(min(interval, deadline - now), 0)) and not WAITERS.notified(
            waiter
        ):
            return
    low, high = PROBE_BOUNDS
    base = min(max(hold / PROBES_PER_HOLD, low), high) if hold else PROBE_EVERY
    if not place.ticketed:
        # Newcomers may pass it: probing fast would mostly see room taken.
        base = min(hold, POLL_CAP) if hold else UNTICKETED_PROBE
    # The pace is kept from one pause to the next: a semaphore that stays
    # full (nothing released, its counters unchanged) is probed less and less.
    every = max(waiter.every or base, base)
    window = 2 * hold if hold else NEXT_IN_LINE_ATTEMPT
    until = min(deadline, now + max(NEXT_IN_LINE_ATTEMPT, every) * random.uniform(0.5, 1.0))
    waiter.expected_room = False
    # Each capacity's worth of permits queued ahead of it (as its attempt or
    # its probe last saw them) takes a round of holds at least.
    interval = max(every, min((hold or PROBE_EVERY) * place.ahead, POLL_CAP))
    try:
        while (now := time.monotonic()) < until:
            if waiter.woken.wait(min(interval * random.uniform(0.5, 1.0), until - now)):
                every = base
                if not WAITERS.notified(waiter):
                    return
                if not place.ticketed:
                    # Every process's poller heard it: spread their probes,
                    # the first to see the room takes it.
                    time.sleep(random.uniform(0, min(NOTIFY_SPREAD, until - now)))
            found = _probe(connection, place)
            if found is None or _fits(place, found):
                waiter.expected_room = True
                return
            grants = sum(c.grants for c in found.values())
            if grants != waiter.grants:  # others are granted: keep alert
                waiter.passed |= waiter.grants is not None
                waiter.grants, waiter.changed, every = grants, now, base
            elif now > waiter.changed + window:
                every = min(2 * every, POLL_CAP)
            place.ahead = _rounds(place, found)
            interval = max(every, min((hold or PROBE_EVERY) * _holds_away(place, found), POLL_CAP))
    finally:
        waiter.every = every


def _probe(connection: BaseDatabaseWrapper, place: Place) -> dict[int, Counters] | None:
    """Its semaphores' counters and the tickets ahead of it there, by one
    plain read (no lock, no transaction); None when it failed (the attempt
    tells why) or no attempt has read the semaphores yet."""
    if not place.semaphores:
        return None
    try:
        return counters(connection, [id for id, _, _ in place.semaphores], place.key)
    except DatabaseError:
        return None


def _fits(place: Place, found: dict[int, Counters]) -> bool:
    """Whether an attempt would be granted as ``found`` says: room on each
    of its semaphores beside what the tickets ahead of it ask for there."""
    return all(
        id not in found or found[id].ahead + place.demand.counts[name] <= found[id].free
        for id, name, _ in place.semaphores
    )


def _holds_away(place: Place, found: dict[int, Counters]) -> float:
    """Holds until enough permits were released for it and the tickets
    ahead of it, on the semaphore where that takes longest: each hold
    releases a capacity's worth."""
    return max(
        (found[id].ahead + place.demand.counts[name] - found[id].free) / max(capacity, 1)
        if id in found
        else 0
        for id, name, capacity in place.semaphores
    )


def _rounds(place: Place, found: dict[int, Counters]) -> int:
    """Capacities' worth of permits that must be granted before it: 0 when
    it is next in line."""
    return max(
        (found[id].ahead + place.demand.counts[name] - 1) // max(capacity, 1) if id in found else 0
        for id, name, capacity in place.semaphores
    )


def _starving(waiter: _Waiter) -> bool:
    """Whether a waiter without a ticket was passed by others for longer
    than ``STARVING_HOLDS`` holds (within ``STARVING_BOUNDS``)."""
    place = waiter.place
    if place.fair or not waiter.passed:
        return False
    hold = _learned_hold(place.demand.names)
    low, high = STARVING_BOUNDS
    after = min(max(STARVING_HOLDS * hold, low), high) if hold else high
    return time.monotonic() - waiter.since >= after


def _learned_hold(names: Iterable[str]) -> float | None:
    holds = learned_holds(dict.fromkeys(names, 1))
    return max(holds) if holds else None


# --- what this process holds, and its releases ---------------------------------------


# key -> (alias, names, time.monotonic() of the grant), oldest first.
_grants: OrderedDict[str, tuple[str, list[str], float]] = OrderedDict()
# (alias, name) -> time.monotonic() of this process's last wait there.
_waits: dict[tuple[str, str], float] = {}
_grants_lock = threading.Lock()


def granted(alias: str, key: str, names: list[str]) -> None:
    """Note a grant of this process: its release (``released``) learns how
    long it was held and which semaphores to wake."""
    with _grants_lock:
        if key not in _grants:
            _grants[key] = (alias, names, time.monotonic())
            if len(_grants) > GRANTS_KEPT:
                _grants.popitem(last=False)


def released(connection: BaseDatabaseWrapper, key: str) -> None:
    """After ``key``'s release committed: learn its hold, wake this
    process's pollers of its semaphores, and on PostgreSQL notify the other
    processes when waiting was seen there lately. No statement when this
    process granted it not, or saw nobody wait on it."""
    with _grants_lock:
        grant = _grants.pop(key, None)
    if grant is None:
        return
    alias, names, since = grant
    held(dict.fromkeys(names, 1), time.monotonic() - since)
    WAITERS.wake(alias, names)
    if _notifies(connection) and _waited_lately(alias, names):
        _notify(connection, names)


def _saw_wait(alias: str, names: Iterable[str]) -> None:
    now = time.monotonic()
    with _grants_lock:
        for name in names:
            _waits[(alias, name)] = now


def _waited_lately(alias: str, names: Iterable[str]) -> bool:
    since = time.monotonic() - NOTIFY_AFTER_WAIT
    with _grants_lock:
        return any(_waits.get((alias, name), since) > since for name in names)


def _notifies(connection: BaseDatabaseWrapper) -> bool:
    """Whether the alias can notify listeners: PostgreSQL through psycopg 3."""
    driver = getattr(connection, "Database", None)
    return connection.vendor == "postgresql" and getattr(driver, "__name__", "") == "psycopg"


def _notify(connection: BaseDatabaseWrapper, names: list[str]) -> None:
    """``NOTIFY`` the freed semaphores' names, best effort (the listeners'
    probes are the fallback); outside any transaction of the release."""
    payload = "\n".join(names)
    if len(payload.encode()) >= 7900:  # NOTIFY's payload limit is 8000 bytes
        payload = ""  # wakes every poller of the alias
    with suppress(DatabaseError), connection.cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, payload])


# --- this process's waiters: one poller per semaphore --------------------------------


@dataclass(eq=False)
class _Waiter:
    """One acquire call of this process waiting for room."""

    alias: str
    place: Place
    came: int  # this process's arrival order
    wants: set[str]  # the names its last refusal named
    since: float = field(default_factory=time.monotonic)
    # Set to attempt at once: a release made room, or its poller left; with
    # ``probe_now``, to probe at once: a release in another process (NOTIFY).
    woken: threading.Event = field(default_factory=threading.Event)
    probe_now: bool = False
    # Its last attempt came because a probe saw room for it (and the tickets
    # ahead of it): refused all the same, it does not probe again at once.
    expected_room: bool = False
    # Others were granted while it waited, or took room it saw (or was woken
    # for): one never passed (nothing granted) has no reason to take a ticket.
    passed: bool = False
    every: float | None = None  # its probes' interval, kept between pauses
    grants: int | None = None  # the grants its last probe counted
    changed: float = field(default_factory=time.monotonic)  # when that last changed

    def order(self) -> tuple[int, int]:
        """Its place in the queues: ticketed first, in their tickets' order
        (``Place.seq`` is taken when a ticket commits), then by arrival."""
        return (0, self.place.seq) if self.place.ticketed else (1, self.came)


class _Waiters:
    """This process's queues: (alias, semaphore name) -> its waiters."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every waiter: in a forked child, the parent's are not its own."""
        self.changed = threading.Condition()
        self.queues: dict[tuple[str, str], list[_Waiter]] = {}
        self._came = itertools.count(1)

    @contextmanager
    def queued(self, alias: str, place: Place, wants: Iterable[str]) -> Iterator[_Waiter]:
        """``place``'s waiter in the queue of each of its semaphores."""
        with self.changed:
            waiter = _Waiter(alias, place, next(self._came), set(wants))
            for name in place.demand.names:
                self.queues.setdefault((alias, name), []).append(waiter)
            self.changed.notify_all()
        LISTENER.wanted(alias)
        granted_here = False
        try:
            yield waiter
            granted_here = True
        finally:
            self._leave(waiter, granted_here)

    def _leave(self, waiter: _Waiter, granted_here: bool) -> None:
        with self.changed:
            for name in waiter.place.demand.names:
                queue = self.queues[(waiter.alias, name)]
                queue.remove(waiter)
                if not queue:
                    del self.queues[(waiter.alias, name)]
            if not granted_here:
                # It may have been a poller: its successors attempt at once.
                self._wake_pollers(waiter.alias, waiter.place.demand.names)
            self.changed.notify_all()

    def has_turn(self, waiter: _Waiter) -> bool:
        """Whether nobody ahead of ``waiter`` wants what it wants (the lock held)."""
        mine = waiter.order()
        return not any(
            other is not waiter and name in other.wants and other.order() < mine
            for name in waiter.wants
            for other in self.queues.get((waiter.alias, name), ())
        )

    def wait_turn(self, waiter: _Waiter, timeout: float) -> bool:
        """Block until it is ``waiter``'s turn; ``False`` if ``timeout`` ran out first."""
        with self.changed:
            return self.changed.wait_for(lambda: self.has_turn(waiter), timeout=timeout)

    def refused(self, waiter: _Waiter, names: Iterable[str]) -> None:
        """Its attempt was refused for want of ``names``: whom it holds back now."""
        with self.changed:
            waiter.wants = set(names) & set(waiter.place.demand.names) or waiter.wants
            self.changed.notify_all()

    def wanted(self, alias: str, names: Iterable[str]) -> bool:
        """Whether waiters want one of ``names``, none of them ticketed."""
        with self.changed:
            wanting = [
                waiter
                for name in names
                for waiter in self.queues.get((alias, name), ())
                if name in waiter.wants
            ]
        return bool(wanting) and not any(waiter.place.ticketed for waiter in wanting)

    def waiting_on(self, alias: str) -> bool:
        """Whether this process waits on ``alias`` (the lock held)."""
        return any(key[0] == alias for key in self.queues)

    def wake(self, alias: str, names: Iterable[str] | None, *, here: bool = True) -> None:
        """A release made room on ``names`` (None: on any of the alias): in
        this process (``here``: its poller attempts at once), or in another
        (a notification: its poller probes, unless it has tickets a
        capacity's worth ahead -- every process hears it, and those would
        only add a herd of reads; one without a ticket after a random part
        of its pace, so that they do not all attempt together)."""
        with self.changed:
            self._wake_pollers(alias, names, here=here)

    def notified(self, waiter: _Waiter) -> bool:
        """Whether ``waiter`` was woken by a notification only (then it is
        not any more: it probes)."""
        with self.changed:
            if not waiter.probe_now:
                return False
            waiter.probe_now = False
            waiter.woken.clear()
            return True

    def _wake_pollers(self, alias: str, names: Iterable[str] | None, *, here: bool = True) -> None:
        """Wake the first waiter wanting each of ``names``, when it is its turn."""
        if names is None:
            names = [name for key_alias, name in self.queues if key_alias == alias]
        for name in names:
            wanting = [w for w in self.queues.get((alias, name), ()) if name in w.wants]
            if not wanting:
                continue
            first = min(wanting, key=_Waiter.order)
            if not self.has_turn(first):
                continue
            if here:
                first.probe_now = False
                first.woken.set()
            elif not first.place.ahead and not first.woken.is_set():
                first.probe_now = True
                first.woken.set()


WAITERS = _Waiters()


# --- PostgreSQL: a release elsewhere wakes this process's pollers --------------------


class _Listener:
    """One daemon thread per PostgreSQL alias that this process waits on: it
    ``LISTEN``\\s on its own connection while this process has waiters there,
    wakes their pollers on each notification, and closes its connection (and
    sleeps) while it has none."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No thread: in a forked child, the parent's did not survive the fork."""
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self._listening: set[str] = set()
        self._stopping = False

    def stop(self) -> None:
        """End every listener of this process, each closing its connection
        (a test run's teardown drops the database only once nobody is
        connected); a later waiter starts one again."""
        with WAITERS.changed:
            self._stopping = True
            WAITERS.changed.notify_all()
        with self._lock:
            threads, self._threads = list(self._threads.values()), {}
        for thread in threads:
            thread.join(LISTEN_CHECK + LISTEN_RETRY + 1)
        with WAITERS.changed:
            self._stopping = False

    def listening(self, alias: str) -> bool:
        """Whether this process listens on ``alias`` now."""
        return alias in self._listening

    def wanted(self, alias: str) -> None:
        """Make sure a listener runs for ``alias``, if it can notify."""
        if not _notifies(connections[alias]):
            return
        with self._lock:
            thread = self._threads.get(alias)
            if thread is None or not thread.is_alive():
                thread = threading.Thread(
                    target=self._run, args=(alias,), name=f"semaphore-listener-{alias}", daemon=True
                )
                self._threads[alias] = thread
                thread.start()

    def _run(self, alias: str) -> None:
        try:
            while self._wanted(alias):
                self._listen_or_retry(alias)
        finally:
            self._listening.discard(alias)
            connections[alias].close()  # this thread's own connection

    def _wanted(self, alias: str) -> bool:
        """Until this process waits on ``alias`` (closing the connection after
        ``LISTEN_IDLE`` without a waiter): False when stopped."""
        with WAITERS.changed:
            waiting = lambda: WAITERS.waiting_on(alias) or self._stopping  # noqa: E731
            if not WAITERS.changed.wait_for(waiting, timeout=LISTEN_IDLE):
                self._listening.discard(alias)
                connections[alias].close()
                WAITERS.changed.wait_for(waiting)
            return not self._stopping

    def _listen_or_retry(self, alias: str) -> None:
        try:
            self._listen(alias)
        except Exception as exc:  # a lost connection: the probes carry on meanwhile
            logger.info("Listening for releases on %r failed, will retry: %s", alias, exc)
            self._listening.discard(alias)
            with suppress(Exception):
                connections[alias].close()
            time.sleep(LISTEN_RETRY)

    def _listen(self, alias: str) -> None:
        """Listen while this process waits on ``alias``; wake on each notification."""
        connection = connections[alias]
        if connection.connection is None or not connection.is_usable():
            connection.close()
            connection.ensure_connection()
            connection.connection.execute(f"LISTEN {CHANNEL}")
            self._listening.add(alias)
        while True:
            for notice in connection.connection.notifies(timeout=LISTEN_CHECK):
                names = notice.payload.split("\n") if notice.payload else None
                WAITERS.wake(alias, names, here=False)
            with WAITERS.changed:
                if self._stopping or not WAITERS.waiting_on(alias):
                    return


LISTENER = _Listener()


def _forget_after_fork() -> None:
    """A forked child (a Celery prefork pool process) starts with no waiter,
    no listener and no grant of its own."""
    WAITERS.reset()
    LISTENER.reset()
    global _grants_lock
    _grants_lock = threading.Lock()
    _grants.clear()
    _waits.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
