"""Every wait for room, with no transaction open.

Each attempt of the engine is one transaction that grants or refuses (at
once, but for the one wait below). Whatever waits for room between two
attempts is here:

- **An acquire with a timeout** (``wait_for_room``) attempts again until it
  is granted or its deadline passes (below).
- **A refused parking task** stands by in its worker (``standby``): the
  same wait, for at most ``STANDBY_WAIT``, then it parks.

Every sleep here is taken with no transaction open and no row locked. The
one wait inside an attempt is the database's: on MariaDB and PostgreSQL the
first waiter in the line on one name waits there for a release, at most
50 ms, the next in line queued behind it in the database
(``engine/statements/grant_routine.py``).

**One poller per process and semaphore.** Every waiter waits in line: its
refused attempt took its tickets (``engine/fairness.py``), which keep its
place among every process's waiters. This process's waiters on a
semaphore form its queue (``waiters``), in their tickets' order; the one
whose turn it is polls, the others sleep until their turn.

**Woken at once.** A release in this process (``released``: ``release()``,
``permit()``'s exit, a task's or a view's end) wakes the poller of each
semaphore it freed at once: no database statement, and none at all when this
process has no waiter there. On PostgreSQL the release also sends a
``NOTIFY`` after its commit when this process saw waiting on those
semaphores lately, and each process with waiters there ``LISTEN``\\s on one
daemon connection (``listening``; a direct one where the alias is behind a
transaction pooler), so a release anywhere wakes them. Probes remain the
fallback (MariaDB has no notify, and a pooled alias without a direct
connection no listener).

**The pace of probes** is learned from the holds this process observed
(``granted`` then ``released``, as a parking task's are through
``standby.learn_hold``). A poller probes its room (one plain read, no
lock: what is free, the grants made, and what the tickets ahead of it ask
for) every ``PROBES_PER_HOLD``-th of a hold, within ``PROBE_BOUNDS`` (once
a hold while it listens for notifications), and attempts when the grant
would say yes: room for it beside those tickets. Further back it waits as
many holds as the capacity takes to release what it and those ahead need.
While the counters show no grant for two holds the pace doubles, up to ``POLL_CAP``;
an attempt comes at least every ``NEXT_IN_LINE_ATTEMPT`` or pace (a reclaim
of expired permits needs one).

**Tickets renewed.** A ticket lives by a lease (``TICKET_LEASE``): every
``RENEWALS_PER_LEASE``-th of it the first of this process's waiters on an
alias to come by (a poller between probes, a sleeper woken for it) renews
the tickets of all of them (``fairness.renew``). A crashed process renews
nothing, and its waiters' room is back when their leases run out.

**Rate limits.** A rate limit (a windowed semaphore) gains room when a
slot's window ends, not at a release: a poller whose probe finds it lacks
room on one sleeps until its next slot ends, then attempts.
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import replace

from django.db import Error
from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore import process
from django_semaphore.conf import app_settings
from django_semaphore.engine.fairness import Ask, Refusal, Standing, leave, renew
from django_semaphore.engine.line import rounds
from django_semaphore.engine.probes import Room, probe
from django_semaphore.exceptions import AcquireTimeout, SemaphoreExhausted
from django_semaphore.models import PermitRequest
from django_semaphore.waiting.listening import LISTENER, listen_alias, notify
from django_semaphore.waiting.standby import learn_hold, learned_holds
from django_semaphore.waiting.waiters import WAITERS, Waiter

# Seconds. A poller probes PROBES_PER_HOLD times a hold it learned, within
# PROBE_BOUNDS (every PROBE_EVERY while it knows none), slows down (doubling
# up to POLL_CAP) once two holds passed with no grant, and attempts at least
# every NEXT_IN_LINE_ATTEMPT or pace; each interval takes a jitter of x0.5-1.
PROBE_EVERY = 0.02
PROBES_PER_HOLD = 4
PROBE_BOUNDS = (0.002, 0.25)
NEXT_IN_LINE_ATTEMPT = 1.0
POLL_CAP = 2.0
# The tickets of this process's waiters are renewed together so many times
# a TICKET_LEASE (the waiters' loops come by every second or two).
RENEWALS_PER_LEASE = 3
# A release sends NOTIFY (PostgreSQL) when this process saw a wait on one of
# its semaphores within so many seconds: elsewhere it is sent to nobody.
NOTIFY_AFTER_WAIT = 10.0
# The grants of this process whose release it may see (``granted``): at most
# so many, the oldest forgotten first (a key released elsewhere never comes back).
GRANTS_KEPT = 10_000


# --- an acquire's wait ---------------------------------------------------------------

# One grant transaction for a call standing where it stands.
Attempt = Callable[[Ask, Standing], PermitRequest | Refusal]


def wait_for_room(
    connection: BaseDatabaseWrapper,
    attempt: Attempt,
    ask: Ask,
    standing: Standing,
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
        attempt: one grant transaction; a ``Refusal`` when there is no room.
        ask: the call.
        standing: where its attempt before waiting left it in its
            semaphores' lines (its tickets are deleted if it gives up).
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
    _saw_wait(alias, ask.demand.names)
    with WAITERS.queued(alias, ask, standing, refused.names) as waiter:
        try:
            LISTENER.wanted(alias)
            while True:
                _renew_tickets(connection)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AcquireTimeout(
                        refused.names, f"{refused} (waited {wait:g}s)", refused.retry_after
                    )
                if not WAITERS.wait_turn(waiter, min(remaining, _renewal_every())):
                    continue
                if not waiter.woken.is_set() or waiter.probe_now:
                    # The last attempt may come at the deadline, never after it.
                    pause(waiter, connection, deadline)
                waiter.woken.clear()
                outcome = attempt(waiter.ask, waiter.standing)
                if not isinstance(outcome, Refusal):
                    return outcome
                refused, waiter.standing = outcome.error, outcome.standing
                WAITERS.refused(waiter, refused.names)
        except BaseException:
            leave(alias, waiter.ask, waiter.standing)
            raise


def pause(waiter: Waiter, connection: BaseDatabaseWrapper, deadline: float) -> None:
    """Wait between two attempts of a poller: until it is woken, its probe
    finds room for it beside the tickets ahead of it, or its interval
    passed; see the module's docstring.

    Args:
        waiter: the poller, with its standing as its last attempt left it.
        connection: the connection it probes on.
        deadline: ``time.monotonic()``; the pause never runs past it.
    """
    hold = max(learned_holds(waiter.ask.demand.names), default=None)
    now = time.monotonic()
    if waiter.expected_room:
        # Refused where its probe saw room (a newcomer took it first): a
        # round of holds before the next probe, or it would attempt at once
        # again and again.
        interval = min(hold or PROBE_EVERY, POLL_CAP) * random.uniform(0.5, 1.0)
        woken = waiter.woken.wait(max(min(interval, deadline - now), 0))
        if woken and not WAITERS.notified(waiter):
            return
    low, high = PROBE_BOUNDS
    base = min(max(hold / PROBES_PER_HOLD, low), high) if hold else PROBE_EVERY
    if hold and LISTENER.listening(waiter.alias):
        # A release anywhere notifies: probes are only the fallback.
        base = max(base, min(hold, POLL_CAP))
    # The pace is kept from one pause to the next: a semaphore that stays
    # full (nothing released, its counters unchanged) is probed less and less.
    every = max(waiter.every or base, base)
    slower_after = 2 * hold if hold else NEXT_IN_LINE_ATTEMPT  # with no grant seen
    until = min(deadline, now + max(NEXT_IN_LINE_ATTEMPT, every) * random.uniform(0.5, 1.0))
    waiter.expected_room = False
    # Each capacity's worth of permits queued ahead of it (as its attempt or
    # its probe last saw them) takes a round of holds at least.
    interval = max(every, min((hold or PROBE_EVERY) * waiter.standing.rounds, POLL_CAP))
    try:
        while (now := time.monotonic()) < until:
            if waiter.woken.wait(min(interval * random.uniform(0.5, 1.0), until - now)):
                every = base
                if not WAITERS.notified(waiter):
                    return
            _renew_tickets(connection)
            probed = _probe(connection, waiter)
            if not (lacking := [room for count, _, room in probed if not room.fits(count)]):
                waiter.expected_room = True
                return
            # A rate limit it lacks room on frees a slot when its window
            # ends, not at a release: attempt then.
            slot = max(
                (r.next_slot_in for r in lacking if r.next_slot_in is not None), default=None
            )
            if slot is not None:
                slot = min(slot, deadline - time.monotonic(), _renewal_every())
                waiter.woken.wait(max(slot, 0))
                waiter.expected_room = True
                return
            grants = sum(room.grants for _, _, room in probed)
            if grants != waiter.grants:  # others are granted: keep alert
                waiter.grants, waiter.changed, every = grants, now, base
            elif now > waiter.changed + slower_after:
                every = min(2 * every, POLL_CAP)
            waiter.standing = replace(waiter.standing, rounds=_rounds(probed))
            interval = max(every, min((hold or PROBE_EVERY) * _holds_away(probed), POLL_CAP))
    finally:
        waiter.every = every


def _renewal_every() -> float:
    return app_settings.TICKET_LEASE.total_seconds() / RENEWALS_PER_LEASE


def _renew_tickets(connection: BaseDatabaseWrapper) -> None:
    """Renew the tickets of this process's waiters on the connection's
    alias, together, when a renewal is due (``RENEWALS_PER_LEASE``). Where
    some were found gone (lapsed, then swept), every one of them takes its
    tickets again at its next refusal (keeping its place where it has one)."""
    due = WAITERS.renewals_due(connection.alias, _renewal_every())
    if not due:
        return
    names = {waiter.ask.key: waiter.ask.demand.names for waiter in due}
    lacked = {id for waiter in due for id in waiter.standing.lacked}
    with suppress(Error):  # tried again at the next renewal
        if renew(connection.alias, names, lacked) < sum(map(len, names.values())):
            for waiter in due:
                waiter.standing = replace(waiter.standing, lacked=frozenset())


# One of a waiter's semaphores as its probe found it: the permits it asks
# there, the capacity its last attempt saw, and the room.
Probed = tuple[int, int, Room]


def _probe(connection: BaseDatabaseWrapper, waiter: Waiter) -> list[Probed]:
    """Its semaphores' room and the tickets ahead of it there, by one
    plain read (no lock, no transaction); none when it failed (the attempt
    tells why) or no attempt has read the semaphores yet."""
    semaphores = waiter.standing.semaphores
    if not semaphores:
        return []
    try:
        found = probe(connection, [id for id, _, _ in semaphores], waiter.ask.key)
    except Error:
        return []
    counts = waiter.ask.demand.counts
    return [(counts[name], capacity, found[id]) for id, name, capacity in semaphores if id in found]


def _holds_away(probed: list[Probed]) -> float:
    """Holds until enough permits were released for it and the tickets
    ahead of it, on the semaphore where that takes longest: each hold
    releases a capacity's worth."""
    return max((count - room.free) / max(capacity, 1) for count, capacity, room in probed)


def _rounds(probed: list[Probed]) -> int:
    """Capacities' worth of permits that must be granted before it: 0 when
    it is next in line."""
    return max(rounds(count, capacity, room.ahead) for count, capacity, room in probed)


# --- what this process holds, and its releases ---------------------------------------


class Seen(process.State):
    """This process's grants not released yet and where it saw waiting."""

    def reset(self) -> None:
        self.lock = threading.Lock()
        # (alias, key) -> (names, time.monotonic() of the grant), oldest first
        # (a key used on two shards has a grant on each).
        self.grants: OrderedDict[tuple[str, str], tuple[list[str], float]] = OrderedDict()
        # (alias, name) -> time.monotonic() of this process's last wait there.
        self.waits: dict[tuple[str, str], float] = {}


SEEN = Seen()


def granted(alias: str, key: str, names: list[str]) -> None:
    """Note a grant of this process: its release (``released``) learns how
    long it was held and which semaphores to wake."""
    with SEEN.lock:
        if (alias, key) not in SEEN.grants:
            SEEN.grants[(alias, key)] = (names, time.monotonic())
            if len(SEEN.grants) > GRANTS_KEPT:
                SEEN.grants.popitem(last=False)


def released(connection: BaseDatabaseWrapper, key: str) -> None:
    """After ``key``'s release committed: learn its hold, wake this
    process's pollers of its semaphores, and on PostgreSQL notify the other
    processes when waiting was seen there lately. No statement when this
    process granted it not, or saw nobody wait on it."""
    alias = connection.alias
    with SEEN.lock:
        grant = SEEN.grants.pop((alias, key), None)
    if grant is None:
        return
    names, since = grant
    learn_hold(names, time.monotonic() - since)
    WAITERS.room_made(alias, names)
    if _waited_lately(alias, names) and listen_alias(alias) is not None:
        notify(connection, names)


def _saw_wait(alias: str, names: Iterable[str]) -> None:
    now = time.monotonic()
    with SEEN.lock:
        for name in names:
            SEEN.waits[(alias, name)] = now


def _waited_lately(alias: str, names: Iterable[str]) -> bool:
    since = time.monotonic() - NOTIFY_AFTER_WAIT
    with SEEN.lock:
        return any(SEEN.waits.get((alias, name), since) > since for name in names)
