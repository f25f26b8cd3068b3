"""The waiters' read of the counters: what is free and what was granted, by
one plain read (no lock, no transaction), for deciding when to attempt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore.engine.statements import SQL, built, placeholders


class CounterStatements(SQL):
    """The counters' read, for one connection."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        super().__init__(connection)
        q = self.q
        # What each semaphore's releases added up to (a plain read: no
        # release waits for it), and what its row counts.
        self.counters_sql = (
            f"SELECT s.{q('id')}, s.{q('capacity')}, s.{q('fencing_counter')},"
            f" s.{q('in_use_counter')}, s.{q('released_folded')},"
            f" c.{q('released')} FROM {self.semaphore} s"
            f" JOIN {self.counter} c ON c.{q('semaphore_id')} = s.{q('id')}"
            f" WHERE s.{q('id')} IN ({{ids}})"
        )


def room_for(connection: BaseDatabaseWrapper, wanted: Sequence[tuple[int, int, int]]) -> bool:
    """Whether every (semaphore id, count, capacity) fits now, by one plain
    read of the counters: no lock, no transaction, for waiters deciding
    when to attempt (the attempt decides; a read that failed answers yes,
    and the attempt, with its retries, tells what went wrong)."""
    try:
        now = counters(connection, [id for id, _, _ in wanted])
    except DatabaseError:
        return True
    return all(
        id not in now or now[id].in_use + count <= capacity for id, count, capacity in wanted
    )


@dataclass
class Counters:
    """A semaphore's counters, as a plain read found them."""

    capacity: int
    in_use: int  # the permits held
    grants: int  # the fencing counter: grants made so far

    @property
    def free(self) -> int:
        return self.capacity - self.in_use


def counters(connection: BaseDatabaseWrapper, semaphore_ids: Sequence[int]) -> dict[int, Counters]:
    """These semaphores' counters, by one plain read (no lock, no
    transaction): for waiters deciding when to attempt."""
    sql = built(CounterStatements, connection)
    with connection.cursor() as cursor:
        cursor.execute(sql.counters_sql.format(ids=placeholders(len(semaphore_ids))), semaphore_ids)
        return {
            int(id): Counters(
                int(capacity),
                max(int(counted) + int(folded) - int(released), 0),
                int(grants),
            )
            for id, capacity, grants, counted, folded, released in cursor.fetchall()
        }
