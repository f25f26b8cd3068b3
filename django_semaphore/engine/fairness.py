"""Fair mode: a durable first-come, first-served queue, and one poller per
semaphore in each process.

**Tickets.** An acquire that must wait on a fair semaphore (``Semaphore.fair``,
or ``acquire(..., fair=True)``) leaves a ``Ticket`` per semaphore in the same
transaction whose attempt found no room, while it holds those rows' locks. So
on each semaphore ticket ids are in the order of its grant transactions: a
ticket with a lower id was committed before any grant that could see a higher
one. An attempt is then granted only when no older live ticket waits on any of
its semaphores. Auto-increment ids, not the clock: ids are unique and never
tie, and no clock decides an order (two clients' clocks, or the database's
clock read before a lock wait, could).

A ticket stops blocking at ``expires_at``, its waiter's deadline, whatever
became of the waiter: granted (its ticket is deleted in the grant
transaction), gone (it deletes it on the way out), or crashed (it expires).

**Cost when unused.** Taking a ticket also writes ``Semaphore.queued_until``,
the latest deadline queued there. The grant's locking read returns it: while
it is in the past no ticket can be live, so no statement is added. While it
is in the future every acquire on that semaphore, fair or not, respects the
queue: a caller that did not ask for fairness may not barge past those who
did.

**One poller per line.** Waiters of one process on the same demand form a
line (``_Line``): only its first waiter polls the database, the others sleep
on a condition until it is their turn. So a process issues one attempt per
poll interval per demand, however many threads wait. The interval adapts to
the waiter's place. Next in line (the permits asked for by the tickets ahead
of it, plus its own, fit in the capacity: the next releases are for it), it
probes every ``PROBE_EVERY`` with one cheap read of what is in use (no lock,
no transaction) and attempts as soon as there is room for it, or after
``NEXT_IN_LINE_ATTEMPT`` at the latest (a reclaim of expired permits needs an
attempt). Further back, it attempts again after ``PROBE_EVERY`` more per
capacity's worth of tickets ahead of it (each takes at least one round of
holds), at most ``POLL_CAP``.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.db.models import Q

from django_semaphore import backends
from django_semaphore.engine.statements import LockedSemaphore, placeholders, room_for
from django_semaphore.models import Semaphore, Ticket
from django_semaphore.validation import Demand

# Seconds, before a jitter of x0.5-1 (see the module's docstring).
PROBE_EVERY = 0.02
NEXT_IN_LINE_ATTEMPT = 1.0
POLL_CAP = 2.0
# A ticket never outlives this, whatever the timeout (datetime arithmetic).
MAX_TICKET_LIFE = timedelta(days=365)

_sequence = itertools.count(1)


@dataclass
class Place:
    """One acquire call's standing in the queues of its semaphores."""

    key: str
    owner: str
    demand: Demand
    fair: bool  # the call asked for fair mode
    deadline: float | None  # monotonic; None: fails fast, never takes a ticket
    ticketed: bool = False  # a committed attempt took tickets
    ahead: int = 0  # capacities' worth of older tickets seen; 0: next in line
    # This process's order of waiters in a line. A ticket's is assigned when
    # its transaction commits, still under the in-process pre-lock, so in a
    # line of ticketed waiters (one demand) it follows their tickets' order.
    seq: int = 0
    # (id, name, capacity) of each semaphore, as the last attempt locked them.
    semaphores: list[tuple[int, str, int]] = field(default_factory=list)

    def admit(
        self,
        connection: BaseDatabaseWrapper,
        cursor: CursorWrapper,
        locked: Sequence[LockedSemaphore],
        now: datetime,
        lacking: list[str],
        lock_wait: float,
    ) -> list[str]:
        """Under the row locks: the names that keep this call waiting (empty:
        grant it). Takes this call's tickets when it has to wait."""
        live = [s for s in locked if _after(connection, s.queued_until, now)]
        ahead = _older_tickets(connection, cursor, live, self.key, now, lock_wait) if live else {}
        # How many permit grants must come before this waiter's, in units of
        # its semaphores' capacity: 0 when it is next in line.
        self.ahead = max(
            (ahead.get(s.id, (0, 0))[1] + self.demand.counts[s.name] - 1) // max(s.capacity, 1)
            for s in locked
        )
        self.semaphores = [(s.id, s.name, s.capacity) for s in locked]
        blocked = sorted(set(lacking) | {s.name for s in live if s.id in ahead})
        if not blocked:
            # This key's tickets, this call's or an earlier call's with the
            # same key (a retry): granted, they must stop blocking others.
            if self.ticketed or (live and self._queues(locked)):
                _delete_tickets(connection, cursor, [s.id for s in locked], self.key, lock_wait)
            return []
        if not self.ticketed and self.deadline is not None and self._queues(locked):
            self._take_tickets(connection, locked, now, self.deadline, lock_wait)
        elif self.seq == 0:
            self.seq = next(_sequence)
        return blocked

    def _queues(self, locked: Sequence[LockedSemaphore]) -> bool:
        """Whether this call takes a ticket when it has to wait."""
        return self.fair or any(s.fair for s in locked)

    def _take_tickets(
        self,
        connection: BaseDatabaseWrapper,
        locked: Sequence[LockedSemaphore],
        now: datetime,
        deadline: float,
        lock_wait: float,
    ) -> None:
        life = timedelta(seconds=max(deadline - time.monotonic(), 0))
        expires_at = now + min(life, MAX_TICKET_LIFE)
        _insert_tickets(connection, locked, self, now, expires_at, lock_wait)
        # Known once committed: a rolled-back attempt took nothing.
        transaction.on_commit(self._ticket_committed, using=connection.alias)

    def _ticket_committed(self) -> None:
        self.ticketed = True
        self.seq = next(_sequence)

    def pause(self, connection: BaseDatabaseWrapper, backoff: float, deadline: float) -> None:
        """Wait between two attempts of this line's first waiter; see the
        module's docstring. ``backoff``: the interval of a waiter without
        a ticket."""
        now = time.monotonic()
        if not self.ticketed:
            time.sleep(max(min(backoff, deadline - now), 0))
            return
        if self.ahead:
            # Each capacity's worth ahead takes at least one round of holds.
            interval = min(PROBE_EVERY * (1 + self.ahead), POLL_CAP) * random.uniform(0.5, 1.0)
            time.sleep(max(min(interval, deadline - now), 0))
            return
        until = min(deadline, now + NEXT_IN_LINE_ATTEMPT * random.uniform(0.5, 1.0))
        while (now := time.monotonic()) < until:
            time.sleep(min(PROBE_EVERY * random.uniform(0.5, 1.0), until - now))
            if _room_for(connection, self):
                return

    def leave(self, alias: str) -> None:
        """Delete this call's tickets after it gave up; best effort (they
        expire at its deadline anyway)."""
        if not self.ticketed:
            return

        with suppress(DatabaseError):
            Ticket.objects.using(alias).filter(
                semaphore__name__in=self.demand.names, external_id=self.key
            ).delete()
        self.ticketed = False


# --- the statements, inside the grant transaction ------------------------------


def _older_tickets(
    connection: BaseDatabaseWrapper,
    cursor: CursorWrapper,
    semaphores: Sequence[LockedSemaphore],
    key: str,
    now: datetime,
    lock_wait: float,
) -> dict[int, tuple[int, int]]:
    """Semaphore id -> (tickets, permits they ask for): the live tickets of
    other keys older than this key's own ticket there (all of them when it
    has none). Semaphores without any are left out."""
    q = connection.ops.quote_name
    table = q(Ticket._meta.db_table)
    ids = [s.id for s in semaphores]
    sql = (
        f"SELECT t.{q('semaphore_id')}, COUNT(*), SUM(t.{q('count')}) FROM {table} t"
        f" WHERE t.{q('semaphore_id')} IN ({placeholders(len(ids))})"
        f" AND t.{q('expires_at')} > %s AND t.{q('external_id')} <> %s"
        f" AND NOT EXISTS (SELECT 1 FROM {table} m"
        f" WHERE m.{q('semaphore_id')} = t.{q('semaphore_id')}"
        f" AND m.{q('external_id')} = %s AND m.{q('id')} < t.{q('id')})"
        f" GROUP BY t.{q('semaphore_id')}"
    )
    cursor.execute(
        backends.bound_statement(connection, sql, lock_wait),
        [*ids, connection.ops.adapt_datetimefield_value(now), key, key],
    )
    return {int(id): (int(n), int(units)) for id, n, units in cursor.fetchall()}


def _insert_tickets(
    connection: BaseDatabaseWrapper,
    locked: Sequence[LockedSemaphore],
    place: Place,
    now: datetime,
    expires_at: datetime,
    lock_wait: float,
) -> None:
    """Once per waiter: through the ORM, whose statements carry no per-statement
    bound, so MariaDB's session is bounded around them (elsewhere the whole
    grant transaction already is)."""
    alias = connection.alias
    ids = [s.id for s in locked]
    bound = (
        backends.bounded_lock_wait(connection, lock_wait)
        if backends.bounds_each_statement(connection)
        else nullcontext()
    )
    with bound:
        # A retry with the same key (another process, the first one crashed
        # or still waiting) keeps the ticket's place; it only pushes its expiry.
        Ticket.objects.using(alias).bulk_create(
            [
                Ticket(
                    semaphore_id=s.id,
                    external_id=place.key,
                    owner=place.owner,
                    count=place.demand.counts[s.name],
                    created_at=now,
                    expires_at=expires_at,
                )
                for s in locked
            ],
            ignore_conflicts=True,
        )
        Ticket.objects.using(alias).filter(
            semaphore_id__in=ids, external_id=place.key, expires_at__lt=expires_at
        ).update(expires_at=expires_at)
        # Under the row lock: the grant's locking read learns that a queue is live.
        Semaphore.objects.using(alias).filter(pk__in=ids).filter(
            Q(queued_until__isnull=True) | Q(queued_until__lt=expires_at)
        ).update(queued_until=expires_at)


def _delete_tickets(
    connection: BaseDatabaseWrapper,
    cursor: CursorWrapper,
    semaphore_ids: list[int],
    key: str,
    lock_wait: float,
) -> None:
    q = connection.ops.quote_name
    table = q(Ticket._meta.db_table)
    cursor.execute(
        backends.bound_statement(
            connection,
            f"DELETE FROM {table} WHERE {q('external_id')} = %s"
            f" AND {q('semaphore_id')} IN ({placeholders(len(semaphore_ids))})",
            lock_wait,
        ),
        [key, *semaphore_ids],
    )


def _room_for(connection: BaseDatabaseWrapper, place: Place) -> bool:
    """Whether every semaphore of ``place`` has room for it now."""
    return room_for(
        connection,
        [(id, place.demand.counts[name], capacity) for id, name, capacity in place.semaphores],
    )


def _after(connection: BaseDatabaseWrapper, queued_until: Any, now: datetime) -> bool:
    """Whether ``queued_until``, as a raw cursor read it, is past ``now``."""
    return queued_until is not None and backends.datetime_from_db(connection, queued_until) > now


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
