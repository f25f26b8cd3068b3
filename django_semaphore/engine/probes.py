"""Probes: a waiter's plain read of its semaphores' room -- what is free,
what was granted, what waits ahead -- with no lock and no transaction,
for deciding when to attempt (the attempt decides)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore import backends
from django_semaphore.engine.line import fits, room
from django_semaphore.engine.statements import built, placeholders
from django_semaphore.engine.statements.probes import ProbeStatements
from django_semaphore.engine.statements.rows import held
from django_semaphore.limits import Limit


@dataclass
class Room:
    """A semaphore's room, as a probe found it."""

    capacity: int
    in_use: int  # the permits held; on a rate limit, granted in the window
    grants: int  # the fencing counter: grants made so far
    ahead: int  # permits asked for by the live tickets that hold the key back
    # On a rate limit: seconds until its next slot ends (None: none is open,
    # or a concurrency limit, which its holders' releases free).
    next_slot_in: float | None = None

    @property
    def free(self) -> int:
        """What is free for the key: neither held nor asked for by the tickets ahead."""
        return room(self.in_use, self.capacity, self.ahead)

    def fits(self, count: int) -> bool:
        """Whether ``count`` permits fit here beside the tickets ahead."""
        return fits(self.in_use, count, self.capacity, self.ahead)


def probe(
    connection: BaseDatabaseWrapper, semaphore_ids: Sequence[int], key: str = ""
) -> dict[int, Room]:
    """These semaphores' room, by one plain read (no lock, no
    transaction): for waiters deciding when to attempt. ``key``: the waiter
    whose tickets' place says which tickets are ahead (every live one when
    it has none)."""
    sql = built(ProbeStatements, connection)
    with connection.cursor() as cursor:
        cursor.execute(
            sql.probe_sql[backends.tickets_ranked(connection)].format(
                ids=placeholders(len(semaphore_ids))
            ),
            [True, key, key, *semaphore_ids],
        )
        rows = cursor.fetchall()
    found = {}
    for id, capacity, grants, counted, folded, released, ahead, *slots in rows:
        window, open_, ended, next_ends, now = slots
        permits = held(int(counted), int(folded), int(released))
        used = max(Limit(int(capacity), window).in_use(permits, int(open_), int(ended or 0)), 0)
        next_slot_in = None
        if next_ends is not None:
            at, now = (backends.datetime_from_db(connection, t) for t in (next_ends, now))
            next_slot_in = max((at - now).total_seconds(), 0.0)
        found[int(id)] = Room(int(capacity), used, int(grants), int(ahead or 0), next_slot_in)
    return found
