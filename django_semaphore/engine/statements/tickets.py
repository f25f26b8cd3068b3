"""The line's statements on the ticket table, inside the grant's
transaction (``engine/fairness.py`` says when they run)."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from django_semaphore import backends
from django_semaphore.conf import app_settings
from django_semaphore.engine import line
from django_semaphore.engine.statements import SQL, built, placeholders
from django_semaphore.models import Ticket

# A ticket never outlives this, whatever the timeout or the parked task's
# expiry (datetime arithmetic).
MAX_TICKET_LIFE = timedelta(days=365)

# A retried key keeps its ticket (its id, so its place): the insert only
# pushes its expiry and marks where it lacks room now. "{new}" names the
# value the insert proposed, as each database's upsert spells it.
_UPSERTS = {
    "mysql": (
        " ON DUPLICATE KEY UPDATE {expires} = GREATEST({expires}, {new_expires}),"
        " {lacked} = {lacked} OR {new_lacked}",
        "VALUES({})",
    ),
    "postgresql": (
        " ON CONFLICT ({semaphore}, {key}) DO UPDATE"
        " SET {expires} = GREATEST({table}.{expires}, {new_expires}),"
        " {lacked} = {table}.{lacked} OR {new_lacked}",
        "EXCLUDED.{}",
    ),
    "sqlite": (
        " ON CONFLICT ({semaphore}, {key}) DO UPDATE"
        " SET {expires} = MAX({expires}, {new_expires}), {lacked} = {lacked} OR {new_lacked}",
        "excluded.{}",
    ),
}


class TicketStatements(SQL):
    """The ticket statements, for one connection."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        super().__init__(connection)
        q = self.q
        table = q(Ticket._meta.db_table)
        # By whether the tickets are ranked (``backends.tickets_ranked``):
        # until their migration, by id alone.
        holding_back_sql = {ranked: self.holding_back("%s", ranked) for ranked in (True, False)}
        self.older_sql = {
            ranked: f"SELECT t.{q('semaphore_id')}, COUNT(*) AS n, SUM(t.{q('count')}) AS permits"
            f" FROM {table} t WHERE t.{q('semaphore_id')} IN ({{ids}})"
            f" AND {holding_back_sql[ranked]} GROUP BY t.{q('semaphore_id')}"
            for ranked in (True, False)
        }
        upsert, new = _UPSERTS[connection.vendor]
        # Retried, a key keeps its place: neither its priority, share key
        # nor where it ranks is written again.
        columns = ["semaphore_id", "external_id", "owner", "count", "created_at", "expires_at"]
        columns.append("lacked")
        columns_sql = {
            ranked: ", ".join(map(q, [*columns, *(backends.RANKS if ranked else ())]))
            for ranked in (True, False)
        }
        self.insert_sql = {
            ranked: f"INSERT INTO {table} ({columns_sql[ranked]}) VALUES {{rows}}"
            + upsert.format(
                table=table,
                semaphore=q("semaphore_id"),
                key=q("external_id"),
                expires=q("expires_at"),
                lacked=q("lacked"),
                new_expires=new.format(q("expires_at")),
                new_lacked=new.format(q("lacked")),
            )
            for ranked in (True, False)
        }
        # The latest deadline queued where a ticket lacks room: the grant's
        # locking read tells from it whether a queue is live.
        self.queued_until_sql = (
            f"UPDATE {self.semaphore} SET {q('queued_until')} = %s"
            f" WHERE {q('id')} IN ({{ids}})"
            f" AND ({q('queued_until')} IS NULL OR {q('queued_until')} < %s)"
        )
        self.delete_sql = (
            f"DELETE FROM {table} WHERE {q('external_id')} = %s"
            f" AND {q('semaphore_id')} IN ({{ids}})"
        )
        # A queue with no live ticket left that lacks room is over: the
        # one-trip grant may take its semaphore again.
        semaphore = self.semaphore
        self.queue_over_sql = (
            f"UPDATE {semaphore} SET {q('queued_until')} = NULL WHERE {q('id')} IN ({{ids}})"
            f" AND NOT EXISTS (SELECT 1 FROM {table} t"
            f" WHERE t.{q('semaphore_id')} = {semaphore}.{q('id')} AND t.{q('lacked')} = %s"
            f" AND t.{q('expires_at')} > %s)"
        )

    def holding_back(self, now: str, ranked: bool = True) -> str:
        """Whether the ticket ``t`` (of semaphore ``t.semaphore_id``) holds
        back the key given twice as parameters after ``TRUE``: live at
        ``now`` (SQL), it lacked room there, and it is ahead of that key's
        own ticket there -- by place, ``(ranked_at, id)`` (``engine/line.py``;
        by id alone where the tickets are not ``ranked`` yet) -- or that key
        has none. The one statement of the rule, for the grant, the routines
        and the probe."""
        q, table = self.q, self.q(Ticket._meta.db_table)
        at, id = q("ranked_at"), q("id")
        before_sql = f"m.{id} < t.{id}"
        if ranked:
            before_sql = f"m.{at} < t.{at} OR m.{at} = t.{at} AND {before_sql}"
        return (
            f"t.{q('lacked')} = %s AND t.{q('expires_at')} > {now} AND t.{q('external_id')} <> %s"
            f" AND NOT EXISTS (SELECT 1 FROM {table} m"
            f" WHERE m.{q('semaphore_id')} = t.{q('semaphore_id')} AND m.{q('external_id')} = %s"
            f" AND ({before_sql}))"
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
            self.bounded(
                self.older_sql[backends.tickets_ranked(self.connection)].format(
                    ids=placeholders(len(semaphore_ids))
                ),
                lock_wait,
            ),
            [*semaphore_ids, True, self.adapt(now), key, key],
        )
        return {int(id): (int(n), int(units)) for id, n, units in cursor.fetchall()}

    def take(
        self,
        cursor: CursorWrapper,
        key: str,
        owner: str,
        counts: dict[int, int],
        now: datetime,
        expires_at: datetime,
        short: set[int],
        lock_wait: float,
        priority: int = 0,
        share: str = "",
    ) -> datetime | None:
        """``key``'s tickets on the semaphores of ``counts`` (semaphore id ->
        permits), on rows this transaction holds locked: new ones, ranked by
        ``priority`` from ``now`` or, with a ``share`` key, from its turn
        (``line``), or kept with their place; marked where it lacks room
        (``short``), where the queue is then live until ``expires_at`` at
        least. Returns where new ones rank; ``None`` where tickets are not
        ranked yet (a deploy under way)."""
        created, expires = self.adapt(now), self.adapt(expires_at)
        ranked_at, ranks = None, []
        if ranked := backends.tickets_ranked(self.connection):
            turn = self.turn(counts, share, now) if share else None
            ranked_at = line.ranked(turn or now, priority, app_settings.PRIORITY_STEP)
            ranks = [priority, self.adapt(ranked_at), share, self.adapt(turn)]
        values = [
            [id, key, owner, count, created, expires, id in short, *ranks]
            for id, count in counts.items()
        ]
        rows = ", ".join([f"({placeholders(len(values[0]))})"] * len(values))
        cursor.execute(
            self.bounded(self.insert_sql[ranked].format(rows=rows), lock_wait),
            [value for row in values for value in row],
        )
        if short:
            self.queue_until(cursor, sorted(short), expires_at)
        return ranked_at

    def turn(self, counts: dict[int, int], share: str, now: datetime) -> datetime:
        """Where new tickets of ``share`` (permits by semaphore id) take
        their turn: the latest of their semaphores' (``line.turn``)."""
        turns = Ticket.objects.using(self.connection.alias).turns(counts, share, now)
        weight, step = app_settings.share_weight(share), app_settings.PRIORITY_STEP
        return max(line.turn(now, turns.get(id), n, weight, step) for id, n in counts.items())

    def queue_until(
        self, cursor: CursorWrapper, semaphore_ids: list[int], expires_at: datetime
    ) -> None:
        """The queues of these semaphores (rows this transaction holds
        locked: no lock wait to bound) live until ``expires_at`` at least."""
        expires = self.adapt(expires_at)
        cursor.execute(
            self.queued_until_sql.format(ids=placeholders(len(semaphore_ids))),
            [expires, *semaphore_ids, expires],
        )

    def delete(
        self, cursor: CursorWrapper, semaphore_ids: list[int], key: str, lock_wait: float
    ) -> None:
        """Delete ``key``'s tickets on these semaphores."""
        cursor.execute(
            self.bounded(self.delete_sql.format(ids=placeholders(len(semaphore_ids))), lock_wait),
            [key, *semaphore_ids],
        )

    def end_queues(self, cursor: CursorWrapper, semaphore_ids: list[int], now: datetime) -> None:
        """Mark the queues of these semaphores (rows this transaction holds
        locked: no ticket is taken there meanwhile) over where no live
        ticket lacks room any more."""
        cursor.execute(
            self.queue_over_sql.format(ids=placeholders(len(semaphore_ids))),
            [*semaphore_ids, True, self.adapt(now)],
        )


def ticket_statements(connection: BaseDatabaseWrapper) -> TicketStatements:
    """This connection's ticket statements."""
    return built(TicketStatements, connection)
