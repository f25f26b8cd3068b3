"""The waiters' read of the counters: what is free, what was granted and
what waits ahead, by one plain read (no lock, no transaction), for deciding
when to attempt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from django.db import Error
from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore import backends
from django_semaphore.backends import StatementNow
from django_semaphore.engine.statements import SQL, built, placeholders
from django_semaphore.models import Ticket


class CounterStatements(SQL):
    """The counters' read, for one connection."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        super().__init__(connection)
        q = self.q
        now, _ = self.compiler.compile(StatementNow())
        tickets = q(Ticket._meta.db_table)
        permit = self.permit
        # What each semaphore's releases added up to (a plain read: no
        # release waits for it), what its row counts, and while its queue is
        # live the permits that the tickets holding a key back ask for (as
        # the grant's ``TicketStatements.older`` counts them).
        self.counters_sql = (
            f"SELECT s.{q('id')}, s.{q('capacity')}, s.{q('fencing_counter')},"
            f" s.{q('in_use_counter')}, s.{q('released_folded')}, c.{q('released')},"
            f" CASE WHEN s.{q('queued_until')} > {now} THEN"
            f" (SELECT SUM(t.{q('count')}) FROM {tickets} t"
            f" WHERE t.{q('semaphore_id')} = s.{q('id')} AND t.{q('lacked')} = %s"
            f" AND t.{q('expires_at')} > {now} AND t.{q('external_id')} <> %s"
            f" AND NOT EXISTS (SELECT 1 FROM {tickets} m"
            f" WHERE m.{q('semaphore_id')} = t.{q('semaphore_id')}"
            f" AND m.{q('external_id')} = %s AND m.{q('id')} < t.{q('id')}))"
            f" END,"
            # A rate limit's slots: those open, those that ended and are not
            # closed yet, and when the next one ends.
            f" s.{q('window')}, s.{q('slots_open')},"
            # Each an index range of (semaphore, slot_ends): PostgreSQL makes
            # none of a bound that an OR on the outer row's column guards,
            # and reads every slot the semaphore ever had.
            f" CASE WHEN s.{q('window')} IS NULL THEN NULL"
            f" WHEN s.{q('slots_closed_until')} IS NULL THEN"
            f" (SELECT SUM(p.{q('count')}) FROM {permit} p"
            f" WHERE p.{q('semaphore_id')} = s.{q('id')} AND p.{q('slot_ends')} <= {now})"
            f" ELSE (SELECT SUM(p.{q('count')}) FROM {permit} p"
            f" WHERE p.{q('semaphore_id')} = s.{q('id')} AND p.{q('slot_ends')} <= {now}"
            f" AND p.{q('slot_ends')} > s.{q('slots_closed_until')}) END,"
            f" CASE WHEN s.{q('window')} IS NOT NULL THEN"
            f" (SELECT MIN(p.{q('slot_ends')}) FROM {permit} p"
            f" WHERE p.{q('semaphore_id')} = s.{q('id')} AND p.{q('slot_ends')} > {now}) END,"
            f" {now} FROM {self.semaphore} s"
            f" JOIN {self.counter} c ON c.{q('semaphore_id')} = s.{q('id')}"
            f" WHERE s.{q('id')} IN ({{ids}})"
        )


def room_for(connection: BaseDatabaseWrapper, wanted: Sequence[tuple[int, int, int]]) -> bool:
    """Whether every (semaphore id, count, capacity) fits now, beside what
    fair waiters ask for there, by one plain read of the counters: no lock,
    no transaction, for waiters deciding when to attempt (the attempt
    decides; a read that failed answers yes, and the attempt, with its
    retries, tells what went wrong)."""
    try:
        now = counters(connection, [id for id, _, _ in wanted])
    except Error:
        return True
    return all(
        id not in now or now[id].in_use + now[id].ahead + count <= capacity
        for id, count, capacity in wanted
    )


@dataclass
class Counters:
    """A semaphore's counters, as a plain read found them."""

    capacity: int
    in_use: int  # the permits held; on a rate limit, granted in the window
    grants: int  # the fencing counter: grants made so far
    ahead: int  # permits asked for by the live tickets that hold the key back
    # On a rate limit: seconds until its next slot ends (None: none is open,
    # or a concurrency limit, which its holders' releases free).
    next_slot_in: float | None = None

    @property
    def free(self) -> int:
        return self.capacity - self.in_use


def counters(
    connection: BaseDatabaseWrapper, semaphore_ids: Sequence[int], key: str = ""
) -> dict[int, Counters]:
    """These semaphores' counters, by one plain read (no lock, no
    transaction): for waiters deciding when to attempt. ``key``: the waiter
    whose tickets' place says which tickets are ahead (every live one when
    it has none)."""
    sql = built(CounterStatements, connection)
    with connection.cursor() as cursor:
        cursor.execute(
            sql.counters_sql.format(ids=placeholders(len(semaphore_ids))),
            [True, key, key, *semaphore_ids],
        )
        rows = cursor.fetchall()
    found = {}
    for id, capacity, grants, counted, folded, released, ahead, *slots in rows:
        in_use = max(int(counted) + int(folded) - int(released), 0)
        window, open_, ended, next_ends, now = slots
        next_slot_in = None
        if window is not None:
            in_use = max(int(open_) - int(ended or 0), 0)
            if next_ends is not None:
                at, now = (backends.datetime_from_db(connection, t) for t in (next_ends, now))
                next_slot_in = max((at - now).total_seconds(), 0.0)
        found[int(id)] = Counters(int(capacity), in_use, int(grants), int(ahead or 0), next_slot_in)
    return found
