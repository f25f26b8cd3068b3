"""The SQL of the waiters' probe (``engine/probes.py``): what is free, what
was granted and what waits ahead, by one plain read (no lock, no
transaction)."""

from __future__ import annotations

from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore.backends import StatementNow
from django_semaphore.engine.statements import SQL
from django_semaphore.engine.statements.tickets import ticket_statements
from django_semaphore.models import Ticket


class ProbeStatements(SQL):
    """The probe's read, for one connection."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        super().__init__(connection)
        q = self.q
        now, _ = self.compiler.compile(StatementNow())
        tickets = q(Ticket._meta.db_table)
        # What each semaphore's releases added up to (a plain read: no
        # release waits for it), what its row counts, and while its queue is
        # live the permits that the tickets holding a key back ask for (as
        # the grant's ``TicketStatements.older`` counts them).
        holding_back_sql = {
            ranked: ticket_statements(connection).holding_back(now, ranked)
            for ranked in (True, False)
        }
        self.probe_sql = {
            ranked: (
                f"SELECT s.{q('id')}, s.{q('capacity')}, s.{q('fencing_counter')},"
                f" s.{q('in_use_counter')}, s.{q('released_folded')}, c.{q('released')},"
                f" CASE WHEN s.{q('queued_until')} > {now} THEN"
                f" (SELECT SUM(t.{q('count')}) FROM {tickets} t"
                f" WHERE t.{q('semaphore_id')} = s.{q('id')}"
                f" AND {holding_back_sql[ranked]}) END,"
                # A rate limit's slots: those open, those that ended and are not
                # closed yet, and when the next one ends.
                f" s.{q('window')}, s.{q('slots_open')},"
                # Each an index range of (semaphore, slot_ends): PostgreSQL makes
                # none of a bound that an OR on the outer row's column guards,
                # and reads every slot the semaphore ever had.
                f" CASE WHEN s.{q('window')} IS NULL THEN NULL"
                f" WHEN s.{q('slots_closed_until')} IS NULL THEN"
                f" (SELECT SUM(p.{q('count')}) FROM {self.permit} p"
                f" WHERE p.{q('semaphore_id')} = s.{q('id')} AND p.{q('slot_ends')} <= {now})"
                f" ELSE (SELECT SUM(p.{q('count')}) FROM {self.permit} p"
                f" WHERE p.{q('semaphore_id')} = s.{q('id')} AND p.{q('slot_ends')} <= {now}"
                f" AND p.{q('slot_ends')} > s.{q('slots_closed_until')}) END,"
                f" CASE WHEN s.{q('window')} IS NOT NULL THEN"
                f" (SELECT MIN(p.{q('slot_ends')}) FROM {self.permit} p"
                f" WHERE p.{q('semaphore_id')} = s.{q('id')} AND p.{q('slot_ends')} > {now}) END,"
                f" {now} FROM {self.semaphore} s"
                f" JOIN {self.counter} c ON c.{q('semaphore_id')} = s.{q('id')}"
                f" WHERE s.{q('id')} IN ({{ids}})"
            )
            for ranked in (True, False)
        }
