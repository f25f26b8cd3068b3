"""Release's statements: the request, its permits and the release counters of
their semaphores, changed together.

A release adds what it frees to each semaphore's ``ReleaseCounter``, never
to the semaphore's row: grants hold that row locked from their locking read
to their commit, and a release queued behind them would keep its permits
counted in use after its holder was done (docs/decisions.md, "Room returned
on time"). Release counters are locked in semaphore id order on every path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from django_semaphore import backends
from django_semaphore.engine.statements import SQL, built, placeholders, routine, with_arguments
from django_semaphore.models import ParkedTask, ReleaseCounter, Ticket

# The release by key as a procedure that also reads what it ended, once
# the release committed (routines.py renders it, a migration installs it).
ROUTINE = routine("django_semaphore_release")
# PostgreSQL's procedure answers in arrays, a row of the read across them.
# Named apart from the columns its statements name.
POSTGRES_READ = {
    "out_keys": "text[]",
    "out_requests": "bigint[]",
    "out_granted": "timestamptz[]",
    "out_released": "timestamptz[]",
    "out_semaphore_ids": "bigint[]",
    "out_semaphores": "text[]",
    "out_counts": "integer[]",
    "out_parked": "boolean[]",
}


class ReadBack(StrEnum):
    """What the release by key reads of what it ended, once it committed
    (its procedure's ``p_read``: ``reads_back_sql`` spells these values)."""

    NEVER = "never"  # nobody listens
    # Only while tasks are parked (not woken): the door wakes them where
    # they wait (``parking.room_made``).
    PARKED = "parked"
    ALWAYS = "always"  # permit_released's or hold_ended's receivers


@dataclass
class ReleasedPermit:
    """A permit the release by key ended, as read after it committed."""

    request_id: int
    granted_at: Any  # as the driver returns them (``holds`` converts them)
    released_at: Any
    semaphore_id: int
    semaphore: str
    count: int
    parked_waiting: bool  # parked tasks (not woken) wait on its semaphore


class ReleaseStatements(SQL):
    """Release's statements, for one connection."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        super().__init__(connection)
        q, now = self.q, self.now
        semaphore, request, permit = self.semaphore, self.request, self.permit
        # Permits chosen by a column ("request_id" or "id") in a transaction:
        # their semaphores' release counters, locked in semaphore id order,
        # what they hold read under the locks, then the updates.
        chosen_sql = f" WHERE {{column}} IN ({{ids}}) AND {q('state')} = %s"
        self.held_on_sql = f"SELECT DISTINCT {q('semaphore_id')} FROM {permit}{chosen_sql}"
        self.locks_by_id: dict[int, str] = {}
        self.held_counts_sql = (
            f"SELECT {q('semaphore_id')}, SUM({q('count')}) FROM {permit}{chosen_sql}"
            f" GROUP BY {q('semaphore_id')}"
        )
        self.release_permits_sql = f"UPDATE {permit} SET {q('state')} = %s{chosen_sql}"
        self.release_requests_sql = (
            f"UPDATE {request} SET {q('state')} = %s, {q('released_at')} = {now},"
            f" {q('updated_at')} = {now}, {q('release_reason')} = %s"
            f" WHERE {q('id')} IN ({{ids}}) AND {q('state')} = %s"
        )
        self.add_released_sql = (
            f"UPDATE {self.counter} SET {q('released')} = {q('released')} + CASE {{cases}} END"
            f" WHERE {q('semaphore_id')} IN ({{ids}})"
        )
        self.add_case_sql = f"WHEN {q('semaphore_id')} = %s THEN %s"
        self.by_key_sql = self._by_key_sql()
        # Whether the release procedure reads what it ended (``p_read``, a
        # ``ReadBack``). Asked once the release committed: a task parked
        # before is seen, one parking after finds the room itself
        # (``parking.park``).
        table = q(ParkedTask._meta.db_table)
        self.reads_back_sql = (
            "(p_read = 'always' OR p_read = 'parked'"
            f" AND EXISTS (SELECT 1 FROM {table} WHERE {q('woken_at')} IS NULL))"
        )
        # What the requests released with a reason held, and for how long:
        # read only while something listens to hold_ended (engine/holds.py).
        self.holds_sql = (
            f"SELECT p.{q('request_id')}, s.{q('name')}, p.{q('count')},"
            f" r.{q('created_at')}, r.{q('released_at')}"
            f" FROM {permit} p"
            f" JOIN {request} r ON r.{q('id')} = p.{q('request_id')}"
            f" JOIN {semaphore} s ON s.{q('id')} = p.{q('semaphore_id')}"
            f" WHERE p.{q('request_id')} IN ({{ids}})"
            f" AND r.{q('release_reason')} = %s AND r.{q('released_at')} IS NOT NULL"
        )
        # After the one-statement release committed, and only while something
        # listens: what it released (the key's request and permits, when
        # they were granted and released, the semaphores' names) and
        # whether parked tasks wait (not woken) on each of those semaphores.
        self.released_on_key_sql = (
            f"SELECT r.{q('external_id')}, r.{q('id')}, r.{q('created_at')},"
            f" r.{q('released_at')}, p.{q('semaphore_id')}, s.{q('name')}, p.{q('count')},"
            f" EXISTS (SELECT 1 FROM {q(Ticket._meta.db_table)} w"
            f" JOIN {q(ParkedTask._meta.db_table)} t ON t.{q('key')} = w.{q('external_id')}"
            f" WHERE w.{q('semaphore_id')} = p.{q('semaphore_id')}"
            f" AND t.{q('woken_at')} IS NULL)"
            f" FROM {request} r JOIN {permit} p ON p.{q('request_id')} = r.{q('id')}"
            f" JOIN {semaphore} s ON s.{q('id')} = p.{q('semaphore_id')}"
            f" WHERE r.{q('external_id')} = %s"
        )
        # The release by key and that read as one procedure, which the
        # server parses and plans once per connection. MariaDB's statements
        # commit one by one (autocommit); PostgreSQL's call is one
        # transaction, undone as a whole if a migration drops the procedure
        # while it runs (the retry then releases the general way).
        # (MySQL: two statements.)
        self.calls_procedure = bool(self.by_key_sql) and (
            self.connection.vendor == "postgresql" or backends.bounds_each_statement(connection)
        )

    def procedure_body(self) -> str:
        """The release procedure's body: the release by key, then what it
        released (``released_on_key_sql``) if it released anything and
        ``p_read`` (a ``ReadBack``) says so."""
        acquired, released = f"'{self.acquired}'", f"'{self.released}'"
        arguments = self._by_key_params(acquired, released, "p_reason", "p_key", "p_lock_wait")
        if self.connection.vendor == "postgresql":
            by_key_sql = with_arguments(self.by_key_sql, *arguments)
            read_sql = with_arguments(self.released_on_key_sql, "p_key")
            outputs_sql = ", ".join(POSTGRES_READ)
            aggregates_sql = ", ".join(f"array_agg(x.{output})" for output in POSTGRES_READ)
            return (
                f"\nBEGIN\n {by_key_sql} INTO out_ended;\n"
                f" IF out_ended > 0 AND {self.reads_back_sql} THEN\n"
                f"  SELECT {aggregates_sql} INTO {outputs_sql}"
                f" FROM ({read_sql}) AS x({outputs_sql});\n"
                " END IF;\nEND\n"
            )
        return with_arguments(
            "BEGIN DECLARE v_released BIGINT;"
            f" SET STATEMENT innodb_lock_wait_timeout = p_wait FOR {self.by_key_sql};"
            " SET v_released = ROW_COUNT(); SELECT v_released;"
            f" IF v_released > 0 AND {self.reads_back_sql} THEN"
            f" {self.released_on_key_sql}; END IF; END",
            *arguments,
            "p_key",
        )

    def _by_key_params(
        self, acquired: str, released: str, reason: str, key: str, lock_timeout: str
    ) -> list[str]:
        """The parameters of ``by_key_sql``, in its order (``lock_timeout``:
        PostgreSQL's only)."""
        if self.connection.vendor == "mysql":
            return [acquired, released, released, reason, key, acquired, key]
        return [released, reason, key, acquired, lock_timeout, released, acquired]

    def _by_key_sql(self) -> str:
        """Release by key in one statement where the database can update
        three tables in one; "" elsewhere (SQLite: the general path, one
        transaction). It runs in autocommit, its own transaction."""
        q, now = self.q, self.now
        request, permit, counter = self.request, self.permit, self.counter
        if self.connection.vendor == "mysql":
            # The join reads the request by its key, its permits through the
            # request's index in id order -- the order the grant inserted them,
            # semaphore id order -- and each release counter by its key: the
            # counters are locked in semaphore id order. The binary comparison
            # keeps keys exact under a case-insensitive collation.
            return (
                f"UPDATE {request} r LEFT JOIN {permit} p"
                f" ON p.{q('request_id')} = r.{q('id')} AND p.{q('state')} = %s"
                f" LEFT JOIN {self.counter} c ON c.{q('semaphore_id')} = p.{q('semaphore_id')}"
                f" SET c.{q('released')} = c.{q('released')} + p.{q('count')},"
                f" p.{q('state')} = %s, r.{q('state')} = %s, r.{q('released_at')} = {now},"
                f" r.{q('updated_at')} = {now}, r.{q('release_reason')} = %s"
                f" WHERE r.{q('external_id')} = %s AND r.{q('state')} = %s"
                f" AND CAST(r.{q('external_id')} AS BINARY) = CAST(%s AS BINARY)"
            )
        if self.connection.vendor == "postgresql":
            # The same three updates, chained by RETURNING; the request's
            # filter first sets the statement's lock-wait bound (an InitPlan,
            # run before any row is locked; autocommit makes the statement its
            # transaction, so the setting ends with it). The release counters
            # are locked in semaphore id order by the manager's locking read
            # ("l": its ORDER BY is applied before its locks); the counters'
            # update reaches only rows "l" has locked. An update that joins the
            # permits itself locks in whatever order its plan scans the
            # table, where updates keep moving the rows: it deadlocked with
            # grants, at times through every retry (the stress mode found it).
            # An update re-reads a row changed since the statement began
            # (READ COMMITTED): a concurrent release of the same key makes
            # this one match nothing.
            locking = self._lock_released_on_sql()
            return (
                f"WITH r AS (UPDATE {request} SET {q('state')} = %s, {q('released_at')} = {now},"
                f" {q('updated_at')} = {now}, {q('release_reason')} = %s"
                f" WHERE {q('external_id')} = %s AND {q('state')} = %s"
                " AND (SELECT set_config('lock_timeout', %s, true)) IS NOT NULL"
                f" RETURNING {q('id')}),"
                f" p AS (UPDATE {permit} SET {q('state')} = %s"
                f" WHERE {q('request_id')} IN (SELECT {q('id')} FROM r) AND {q('state')} = %s"
                f" RETURNING {q('semaphore_id')}, {q('count')}),"
                f" l AS ({locking}),"
                f" c AS (UPDATE {counter} SET {q('released')} = {q('released')} + p.{q('count')}"
                f" FROM p JOIN l ON l.{q('semaphore_id')} = p.{q('semaphore_id')}"
                f" WHERE {counter}.{q('semaphore_id')} = l.{q('semaphore_id')})"
                " SELECT COUNT(*) FROM r"
            )
        return ""

    # Outside any transaction.

    def holds(self, request_ids: Sequence[int], reason: str) -> list[tuple[Any, ...]]:
        """(request id, semaphore name, count, granted at, released at) of
        the permits of these requests that ended with ``reason``."""
        with self.connection.cursor() as cursor:
            cursor.execute(
                self.holds_sql.format(ids=placeholders(len(request_ids))), [*request_ids, reason]
            )
            return list(cursor.fetchall())

    def find_request(self, key: str) -> tuple[int, str] | None:
        """(id, state) of the request with exactly this key."""
        with self.connection.cursor() as cursor:
            cursor.execute(self.key_sql, [key])
            row = cursor.fetchone()
        # Not another key that only the collation calls equal.
        return None if row is None or row[2] != key else (row[0], row[1])

    def released_on_key(self, key: str) -> list[ReleasedPermit]:
        """What the key's request held, by one plain read (after its
        release committed; see ``released_on_key_sql``)."""
        with self.connection.cursor() as cursor:
            cursor.execute(self.released_on_key_sql, [key])
            return self._exactly(key, cursor.fetchall())

    @staticmethod
    def _exactly(key: str, rows: Sequence[Sequence[Any]]) -> list[ReleasedPermit]:
        """The rows of ``released_on_key_sql`` of exactly this key, not of
        another that only the collation calls equal."""
        return [ReleasedPermit(*row) for stored, *row in rows if stored == key]

    def releases_by_key(self) -> bool:
        """Whether ``release_by_key`` may run now: where the database can say
        it in one statement, and on PostgreSQL outside the caller's
        transaction (its lock-wait setting lasts as long as the transaction
        it runs in)."""
        return bool(self.by_key_sql) and not (
            self.connection.vendor == "postgresql" and self.connection.in_atomic_block
        )

    def release_by_key(
        self, key: str, reason: str, lock_wait: float, read: ReadBack
    ) -> tuple[bool, list[ReleasedPermit] | None]:
        """Release the key's request, its permits and their share of the
        counters in one statement: whether this call released it and what
        it released, as ``read`` asks, when the database reads it in the
        same trip (its procedure; ``None``: not read, see
        ``released_on_key``)."""
        procedure = self.calls_procedure and backends.routines_installed(self.connection)
        if procedure and self.connection.vendor == "postgresql":
            with self.connection.cursor() as cursor:
                cursor.execute(
                    f"CALL {ROUTINE}(%s, %s, %s, %s{', NULL' * (1 + len(POSTGRES_READ))})",
                    [key, reason, backends.lock_timeout(lock_wait), read.value],
                )
                ended, *columns = cursor.fetchone()
            rows = list(zip(*columns, strict=True)) if ended and columns[0] else []
            return bool(ended), self._exactly(key, rows)
        if procedure:
            with self.connection.cursor() as cursor:
                wait = max(1, math.ceil(lock_wait))
                cursor.execute(f"CALL {ROUTINE}(%s, %s, %s, %s)", [key, reason, wait, read.value])
                ended = bool(cursor.fetchone()[0])
                rows = cursor.fetchall() if cursor.nextset() and ended else []
                while cursor.nextset():  # the call's closing status
                    pass
            return ended, self._exactly(key, rows)
        params = self._by_key_params(
            self.acquired, self.released, reason, key, backends.lock_timeout(lock_wait)
        )
        with self.connection.cursor() as cursor:
            cursor.execute(self.bounded(self.by_key_sql, lock_wait), params)
            if self.connection.vendor == "mysql":
                # Django connects with CLIENT.FOUND_ROWS: rows matched, and the
                # request row matches only while ACQUIRED (so does ROW_COUNT()).
                return bool(cursor.rowcount), None
            return bool(cursor.fetchone()[0]), None

    # Inside a transaction.

    def release(
        self, cursor: CursorWrapper, request_ids: list[int], reason: str, lock_wait: float
    ) -> tuple[int, dict[int, int]]:
        """Release these requests and their permits, lowering the counters:
        (requests this call released, semaphore id -> permits it freed)."""
        _, freed = self.release_permits(cursor, request_ids, lock_wait, column="request_id")
        cursor.execute(
            self.release_requests_sql.format(ids=placeholders(len(request_ids))),
            [self.released, reason, *request_ids, self.acquired],
        )
        return int(cursor.rowcount), freed

    def release_permits(
        self, cursor: CursorWrapper, ids: list[int], lock_wait: float, column: str = "id"
    ) -> tuple[int, dict[int, int]]:
        """Release the ACQUIRED permits whose ``column`` is in ``ids`` (by
        default the permits' own ids: the sweep's repairs, whatever their
        requests say) and lower their semaphores' counters, under the
        release counters' locks taken in semaphore id order: (permits this
        call released, semaphore id -> count freed)."""
        column = self.q(column)
        listed = placeholders(len(ids))
        if self.connection.features.has_select_for_update:
            cursor.execute(
                self.held_on_sql.format(column=column, ids=listed), [*ids, self.acquired]
            )
            semaphore_ids = [int(id) for (id,) in cursor.fetchall()]
            if not semaphore_ids:
                return 0, {}
            cursor.execute(
                self.bounded(self._lock_by_id(len(semaphore_ids)), lock_wait), semaphore_ids
            )
        # Under the locks (SQLite: the file's write lock): no other release
        # can free these permits now.
        cursor.execute(
            self.held_counts_sql.format(column=column, ids=listed), [*ids, self.acquired]
        )
        freed = {int(id): int(n) for id, n in cursor.fetchall()}
        if not freed:
            return 0, {}
        cursor.execute(
            self.release_permits_sql.format(column=column, ids=listed),
            [self.released, *ids, self.acquired],
        )
        released = int(cursor.rowcount)
        # Under the locks taken above: what was freed, on the release counters.
        cursor.execute(
            self.add_released_sql.format(
                cases=" ".join([self.add_case_sql] * len(freed)), ids=placeholders(len(freed))
            ),
            [*(v for item in freed.items() for v in item), *freed],
        )
        return released, freed

    def _lock_by_id(self, count: int) -> str:
        """The locking read of ``count`` semaphores' release counters, compiled once."""
        if count not in self.locks_by_id:
            self.locks_by_id[count] = self.locking_read(
                ReleaseCounter, "semaphore_id", list(range(count)), "semaphore_id"
            )
        return self.locks_by_id[count]

    def _lock_released_on_sql(self) -> str:
        """The locking read of the release counters of the permits the
        statement released (its "p"): the manager's, its one id placeholder
        made a read of "p" (with neither RawSQL nor values in the text)."""
        sql = self.locking_read(ReleaseCounter, "semaphore_id", [0], "semaphore_id")
        return self.replaced_once(sql, "IN (%s)", f"IN (SELECT {self.q('semaphore_id')} FROM p)")


def release_statements(connection: BaseDatabaseWrapper) -> ReleaseStatements:
    """This connection's release statements."""
    return built(ReleaseStatements, connection)
