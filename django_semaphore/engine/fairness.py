"""The line: a durable first-come, first-served queue of every waiter --
acquires that wait, and parked tasks (``engine/wakeups``).

**Tickets.** An acquire that must wait (a ``timeout``) leaves a ``Ticket``
per semaphore in the same
transaction whose attempt found no room, while it holds those rows' locks. So
on each semaphore ticket ids are in the order of its grant transactions: a
ticket with a lower id was committed before any grant that could see a higher
one. Auto-increment ids, not the clock: ids are unique and never tie, and no
clock decides an order (two clients' clocks, or the database's clock read
before a lock wait, could). All of a waiter's tickets are taken in one
transaction, under all of its rows' locks, so two waiters are in the same
order on every semaphore they share: nobody waits for anybody in a circle.

**Holding back, tenants, no starvation.** A ticket holds back younger
waiters only where its waiter lacked room (``Ticket.lacked``: on the
semaphores where the ticketing attempt lacked room, and on each one where a
later attempt came to lack it); elsewhere it only keeps its waiter's place.
An attempt is granted when it fits beside what the older tickets that lacked
room ask for on each of its semaphores: their room is kept for them, and a
younger waiter is served first only from room beyond theirs (it need not
wait for them to notice). Where it does not fit, it lacks room there too,
and holds back younger ones in turn. So tenant A's waiters at A's own cap, that
found room on the shared ``exports``, never keep tenant B from ``exports``.
A ticket that lacked room keeps holding back until its waiter is granted or
leaves, so its semaphores cannot take turns at denying it
(``docs/fairness.md`` states the bound).

A waiter's ticket lives by a lease (``TICKET_LEASE``), which its
waiter renews while it waits (``renew``), and stops blocking at
``expires_at`` whatever became of the waiter: granted (its ticket is
deleted in the grant transaction), gone (it deletes it on the way out), or
crashed (its lease runs out). A parked task's tickets live by its parked
row instead (``engine/wakeups``): until its expiry, and no renewal shortens
that.

**Cost when unused.** A ticket that lacked room also writes
``Semaphore.queued_until``, the latest expiry queued there (pushed by the
renewals too). The grant's
locking read returns it: while it is in the past no ticket that holds back
can be live, so no statement is added. While it
is in the future every acquire on that semaphore respects the queue: a
caller that fails fast may not barge past those who wait.

**Waiting.** This module only says, under the row locks, whether a call is
granted and where it stands; the waits between its attempts (one poller
per line in each process, its polling interval) are in ``waiting``. On
MariaDB and PostgreSQL a line of one name is served by the grant routine
(``statements/grant_routine.py``), which applies the same rule, and whose first
waiter waits there for a release, briefly, before it is refused.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.db.models import Q
from django.db.models.functions import Greatest

from django_semaphore import backends
from django_semaphore.conf import app_settings
from django_semaphore.engine import line
from django_semaphore.engine.statements.one_trip import Refused
from django_semaphore.engine.statements.rows import LockedSemaphore
from django_semaphore.engine.statements.tickets import ticket_statements
from django_semaphore.exceptions import SemaphoreExhausted
from django_semaphore.guards import engine_writes
from django_semaphore.models import Semaphore, Ticket
from django_semaphore.validation import Demand

_sequence = itertools.count(1)


@dataclass(frozen=True)
class Ask:
    """One acquire call, as the engine is asked it."""

    key: str
    owner: str
    demand: Demand
    deadline: float | None  # monotonic; None: fails fast, never takes a ticket
    priority: int = 0  # where its tickets rank (``line.ranked``)
    share: str = ""  # its share key: its tickets take its key's turn (``line.turn``)


@dataclass(frozen=True)
class Standing:
    """Where a call stands in its semaphores' lines, as its last attempt left
    it: the engine returns it with a refusal and is handed it back with the
    next attempt. A refusal is answered once its transaction committed, so
    the tickets it reports are taken."""

    ticketed: bool = False  # an attempt took tickets
    # Ids of the semaphores where its tickets lacked room (and hold back others).
    lacked: frozenset[int] = frozenset()
    # Capacities' worth of grants that must come before its own: 0, next in line.
    rounds: int = 0
    # This process's order of waiters in a line: where its tickets rank
    # (``Ticket.ranked_at``, as a timestamp; 0 where tickets are not ranked),
    # then ``seq``. A ticket's ``seq`` is taken in its transaction, under the
    # in-process pre-lock, so in a line of ticketed waiters (one demand) it
    # follows their tickets' order.
    rank: float = 0.0
    seq: int = 0
    # (id, name, capacity) of each semaphore, as the last attempt locked them.
    semaphores: tuple[tuple[int, str, int], ...] = ()


@dataclass(frozen=True)
class Refusal:
    """No room: why (what a caller that does not wait raises), and where the
    call stands in its semaphores' lines now."""

    error: SemaphoreExhausted
    standing: Standing


def admit(
    connection: BaseDatabaseWrapper,
    cursor: CursorWrapper,
    locked: Sequence[LockedSemaphore],
    now: datetime,
    lock_wait: float,
    ask: Ask,
    standing: Standing,
) -> tuple[list[str], Standing]:
    """Under the row locks: the names that keep this call waiting (empty:
    grant it), and where it stands now. When it has to wait, takes this
    call's tickets, or marks those where it newly lacks room."""
    tickets = ticket_statements(connection)
    live = [s.id for s in locked if _after(connection, s.queued_until, now)]
    # Semaphore id -> (tickets, permits they ask for): the live tickets that
    # lacked room, of other keys, older than this key's own there (all of
    # them when it has none). What they ask for stays theirs.
    ahead = tickets.older(cursor, live, ask.key, now, lock_wait) if live else {}
    reserved = {id: permits for id, (_, permits) in ahead.items()}
    counts = ask.demand.counts
    short = {s.id for s in line.lacking_room(locked, counts, reserved)}
    standing = replace(
        standing,
        rounds=max(line.rounds(counts[s.name], s.capacity, reserved.get(s.id, 0)) for s in locked),
        semaphores=tuple((s.id, s.name, s.capacity) for s in locked),
    )
    if not short:
        if line.deletes_tickets(standing.ticketed, bool(live)):
            tickets.delete(cursor, [s.id for s in locked], ask.key, lock_wait)
        if over := line.ended_queues(live, ahead, standing.ticketed):
            tickets.end_queues(cursor, over, now)
        return [], standing
    takes = line.takes_tickets(standing.ticketed, short, standing.lacked)
    life = ticket_life(ask) if takes else None
    ranked_at = None
    if life is not None:
        # On all of its semaphores, marked where it lacks room; a key's
        # tickets are kept, with their place (a retry with the same key from
        # another process, the first one crashed or still waiting, only
        # pushes their expiry).
        expires_at = now + timedelta(seconds=life)
        asks = {s.id: counts[s.name] for s in locked}
        ranked_at = tickets.take(
            cursor, ask.key, ask.owner, asks, now, expires_at, short, lock_wait,
            ask.priority, ask.share,
        )  # fmt: skip
    standing = _placed(standing, short, ticketed=life is not None, rank=_rank(ranked_at))
    return sorted(s.name for s in locked if s.id in short), standing


def ticket_life(ask: Ask) -> float | None:
    """Seconds a ticket this call takes lives: a ``TICKET_LEASE`` (its
    waiter renews it while it waits), at most until its deadline; ``None``:
    it fails fast and takes none."""
    if ask.deadline is None:
        return None
    lease = app_settings.TICKET_LEASE.total_seconds()
    return min(max(ask.deadline - time.monotonic(), 0), lease)


def renew(alias: str, keys: Collection[str], lacked: Collection[int]) -> int:
    """Push the tickets of these keys (waiters still waiting) to a
    ``TICKET_LEASE`` from now, never shortening one (a parked task's lives
    by its row), and keep the queues of the semaphores where they lacked
    room live as long; returns the tickets found. A lapsed ticket is
    renewed with its place: its waiter was slow, not gone.

    The tickets first: a grant that ends a queue between the two writes
    sees them lapsed, and the queue is live again after it."""
    until = backends.DatabaseNow() + app_settings.TICKET_LEASE
    renewed = Ticket.objects.using(alias).filter(external_id__in=keys)
    found = renewed.update(expires_at=Greatest("expires_at", until))
    queues = Semaphore.objects.using(alias).filter(Q(queued_until__lt=until) | Q(queued_until=None))
    with engine_writes():
        # A row at a time: a write never holds one row's lock waiting for
        # another's, which a grant may hold waiting for it.
        for id in sorted(lacked):
            queues.filter(id=id).update(queued_until=until)
    return found


def refused_in_one_trip(
    connection: BaseDatabaseWrapper, ask: Ask, standing: Standing, refused: Refused
) -> Refusal:
    """The one-trip grant's refusal, with the call's standing as ``admit``
    would have left it."""
    standing = replace(standing, rounds=refused.rounds, semaphores=refused.lacking)
    short = {id for id, _, _ in refused.lacking}
    error = SemaphoreExhausted(sorted(name for _, name, _ in refused.lacking))
    # The routine ranks a ticket it takes from its clock (no share key).
    step = app_settings.PRIORITY_STEP
    ranked_at = None if refused.at is None else line.ranked(refused.at, ask.priority, step)
    return Refusal(error, _placed(standing, short, refused.ticket_taken, _rank(ranked_at)))


def _rank(ranked_at: datetime | None) -> float:
    """``Standing.rank`` of tickets ranked ``ranked_at``: 0 where they are not."""
    return 0.0 if ranked_at is None else ranked_at.timestamp()


def _placed(standing: Standing, short: set[int], ticketed: bool, rank: float) -> Standing:
    """The standing of a refused call, which took (or marked) its tickets
    where it lacks room (``short``) if ``ticketed``, ranked ``rank`` if
    they are new."""
    if ticketed:
        if standing.ticketed:
            return replace(standing, lacked=standing.lacked | short)
        return replace(
            standing, ticketed=True, lacked=standing.lacked | short, rank=rank, seq=next(_sequence)
        )
    if standing.seq == 0:
        return replace(standing, seq=next(_sequence))
    return standing


def leave(alias: str, ask: Ask, standing: Standing) -> None:
    """Delete a call's tickets after it gave up; best effort (their lease
    runs out anyway)."""
    if not standing.ticketed:
        return
    with suppress(DatabaseError):
        Ticket.objects.using(alias).filter(
            semaphore__name__in=ask.demand.names, external_id=ask.key
        ).delete()


def _after(connection: BaseDatabaseWrapper, queued_until: Any, now: datetime) -> bool:
    """Whether ``queued_until``, as a raw cursor read it, is past ``now``."""
    return queued_until is not None and backends.datetime_from_db(connection, queued_until) > now
