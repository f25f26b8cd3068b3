"""Fair mode's statements on the ticket table, inside the grant's
transaction (``engine/fairness.py`` says when they run)."""

from __future__ import annotations

from datetime import datetime

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from django_semaphore.engine.statements import SQL, built, placeholders
from django_semaphore.models import Ticket


class TicketStatements(SQL):
    """The ticket statements, for one connection."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        super().__init__(connection)
        q = self.q
        table = q(Ticket._meta.db_table)
        # Per semaphore: the live tickets of other keys that lacked room there
        # (only those hold back), older than this key's own ticket there (all
        # of them when it has none), and what they ask.
        self.older_sql = (
            f"SELECT t.{q('semaphore_id')}, COUNT(*), SUM(t.{q('count')}) FROM {table} t"
            f" WHERE t.{q('semaphore_id')} IN ({{ids}}) AND t.{q('lacked')} = %s"
            f" AND t.{q('expires_at')} > %s AND t.{q('external_id')} <> %s"
            f" AND NOT EXISTS (SELECT 1 FROM {table} m"
            f" WHERE m.{q('semaphore_id')} = t.{q('semaphore_id')}"
            f" AND m.{q('external_id')} = %s AND m.{q('id')} < t.{q('id')})"
            f" GROUP BY t.{q('semaphore_id')}"
        )
        self.delete_sql = (
            f"DELETE FROM {table} WHERE {q('external_id')} = %s"
            f" AND {q('semaphore_id')} IN ({{ids}})"
        )

    def older(
        self,
        cursor: CursorWrapper,
        semaphore_ids: list[int],
        key: str,
        now: datetime,
        lock_wait: float,
    ) -> dict[int, tuple[int, int]]:
        """Semaphore id -> (tickets, permits they ask for) ahead of ``key``
        and holding it back; semaphores without any are left out."""
        cursor.execute(
            self.bounded(self.older_sql.format(ids=placeholders(len(semaphore_ids))), lock_wait),
            [*semaphore_ids, True, self.connection.ops.adapt_datetimefield_value(now), key, key],
        )
        return {int(id): (int(n), int(units)) for id, n, units in cursor.fetchall()}

    def delete(
        self, cursor: CursorWrapper, semaphore_ids: list[int], key: str, lock_wait: float
    ) -> None:
        """Delete ``key``'s tickets on these semaphores."""
        cursor.execute(
            self.bounded(self.delete_sql.format(ids=placeholders(len(semaphore_ids))), lock_wait),
            [key, *semaphore_ids],
        )


def ticket_statements(connection: BaseDatabaseWrapper) -> TicketStatements:
    """This connection's ticket statements."""
    return built(TicketStatements, connection)
