"""The grant in one round trip: the common case -- one semaphore with room,
no fair queue live, no rate window -- decided and written by the database
in a single call, in one transaction of its own.

MariaDB runs the statements as one anonymous block (``BEGIN NOT ATOMIC``),
sent like any statement; PostgreSQL calls a function its migration installs
(``FUNCTION``), whose statements the server plans once per connection. Both
run the grant's own statements: the manager's locking read (the app's one
lock order), the release total read once the lock is held, the room check of
``LockedSemaphore.in_use``, then the request's insert (its unique key
settles repeated calls: a taken key fails as the general path's insert
does), the counters' update and the permit's insert.

Anything else answers "not here" without writing anything, and the grant
goes the general way (``grant.grant``): no room (which reclaims expired
permits, reads a taken key and says when room comes), a missing name (a
family's member is created there), a fair queue, a rate limit, a count
above the capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore import backends
from django_semaphore.engine.statements import SQL, built, statements
from django_semaphore.engine.statements.rows import LOCKED_COLUMNS

# The PostgreSQL function (its migration, 0010, installs it).
FUNCTION = "django_semaphore_grant"


@dataclass
class Granted:
    """What the one-trip grant wrote."""

    request_id: int
    granted_at: datetime
    expires_at: datetime | None
    fencing_token: int
    in_use: int  # the semaphore's permits in use once granted


class OneTripStatements(SQL):
    """The one-trip grant, for one connection."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        super().__init__(connection)
        self.vendor = connection.vendor
        if self.vendor == "postgresql":
            self.call_sql = f"SELECT * FROM {FUNCTION}(%s, %s, %s, %s, %s, %s)"
        elif backends.bounds_each_statement(connection):
            self.call_sql = self._mariadb_block()
        else:
            self.call_sql = ""
        self.calls: dict[int, str] = {}

    def applies(self) -> bool:
        """Whether this database grants in one trip (MariaDB, PostgreSQL)."""
        return bool(self.call_sql)

    def _call(self, lock_wait: float) -> str:
        """The call's text: MariaDB's block says its lock-wait bound (whole
        seconds, at least 1) in its text."""
        if self.vendor == "postgresql":
            return self.call_sql
        wait = max(1, math.ceil(lock_wait))
        text = self.calls.get(wait)
        if text is None:
            text = self.calls[wait] = self.call_sql.replace("{wait}", str(wait))
        return text

    def grant(
        self, name: str, count: int, key: str, owner: str, ttl: int | None, lock_wait: float
    ) -> Granted | None:
        """Grant ``count`` permits of ``name`` to ``key``, committed; ``None``:
        not in one trip (nothing written). Outside any transaction."""
        if self.vendor == "postgresql":
            params: list[Any] = [name, count, key, owner, ttl, f"{int(lock_wait * 1000)}ms"]
        else:
            params = [name, name, count, count, ttl, ttl, key, owner, ttl, count, count, count]
        with self.connection.cursor() as cursor:
            cursor.execute(self._call(lock_wait), params)
            row = cursor.fetchone()
            if self.vendor != "postgresql":
                while cursor.nextset():  # the block's closing status
                    pass
        if row is None or row[0] is None:
            return None
        request_id, granted_at, expires_at, token, in_use = row
        stamp = backends.datetime_from_db
        return Granted(
            int(request_id),
            stamp(self.connection, granted_at),
            None if expires_at is None else stamp(self.connection, expires_at),
            int(token),
            int(in_use),
        )

    def locking_read_into(self, targets: str) -> str:
        """The manager's locking read of one semaphore by name (as the
        general path compiles it), its columns read into ``targets``."""
        sql = statements(self.connection).lock_sql(1)
        source = f" FROM {self.semaphore} WHERE "
        if sql.count(source) != 1:  # pragma: no cover - a Django change would show here
            raise AssertionError(f"Unexpected locking read: {sql!r}")
        return sql.replace(source, f" INTO {targets}{source}")

    def _mariadb_block(self) -> str:
        """The grant as one anonymous block; its parameters, in order: name
        (twice), count (twice), ttl (twice), key, owner, ttl, count (3x)."""
        q, now = self.q, self.now
        semaphore, request, permit = self.semaphore, self.request, self.permit
        columns = [*LOCKED_COLUMNS, "released"]
        variables = [f"v_{column}" for column in columns]
        declarations = "; ".join(
            f"DECLARE v_{column} TYPE OF {semaphore}.{q(column)}"
            for column in columns
            if column not in ("queue_live", "released")
        )
        locking = self.locking_read_into(", ".join(variables))
        bound = "SET STATEMENT innodb_lock_wait_timeout = {wait} FOR "
        return (
            "BEGIN NOT ATOMIC "
            f"{declarations}; DECLARE v_queue_live, v_exact BOOL; DECLARE v_released BIGINT;"
            " DECLARE v_held, v_request BIGINT; DECLARE v_now, v_expires DATETIME(6);"
            " DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;"
            " START TRANSACTION;"
            f" {bound}{locking};"
            # Names are exact, as Python compares them (not as the collation does).
            f" SET v_exact = CAST(v_name AS BINARY) = CAST(%s AS BINARY);"
            f" SET v_held = GREATEST(v_in_use_counter"
            f" - GREATEST(IFNULL(v_released, 0) - v_released_folded, 0), 0);"
            " IF v_id IS NULL OR NOT v_exact OR v_window IS NOT NULL OR IFNULL(v_queue_live, 0)"
            " OR %s > v_capacity OR v_held + %s > v_capacity THEN"
            " ROLLBACK; SELECT NULL, NULL, NULL, NULL, NULL;"
            " ELSE"
            f" SET v_now = {now};"
            " SET v_expires = IF(%s IS NULL, NULL, TIMESTAMPADD(SECOND, %s, v_now));"
            f" {bound}INSERT INTO {request} ({q('external_id')}, {q('owner')}, {q('state')},"
            f" {q('ttl')}, {q('expires_at')}, {q('created_at')}, {q('updated_at')},"
            f" {q('released_at')}, {q('release_reason')})"
            f" VALUES (%s, %s, '{self.acquired}', %s, v_expires, v_now, v_now, NULL, '');"
            " SET v_request = LAST_INSERT_ID();"
            f" UPDATE {semaphore} SET {q('fencing_counter')} = {q('fencing_counter')} + 1,"
            f" {q('in_use_counter')} = v_held + %s,"
            f" {q('released_folded')} = GREATEST(IFNULL(v_released, 0), v_released_folded),"
            f" {q('updated_at')} = v_now WHERE {q('id')} = v_id;"
            f" INSERT INTO {permit} ({q('semaphore_id')}, {q('request_id')}, {q('count')},"
            f" {q('fencing_token')}, {q('slot_ends')}, {q('state')})"
            f" VALUES (v_id, v_request, %s, v_fencing_counter + 1, NULL, '{self.acquired}');"
            " COMMIT;"
            " SELECT v_request, v_now, v_expires, v_fencing_counter + 1, v_held + %s;"
            " END IF;"
            " END"
        )

    def function_body(self) -> str:
        """The PostgreSQL function's body (``install`` creates it; a test
        compares it with the installed one, so a change here needs a
        migration that installs it again)."""
        q = self.q
        locking = self.locking_read_into("s").replace("%s", "p_name")
        return (
            "\nDECLARE s record; v_released bigint; v_held bigint;"
            " v_now timestamptz; v_expires timestamptz; v_request bigint;\n"
            "BEGIN\n"
            " PERFORM set_config('lock_timeout', p_lock_wait, true);\n"
            f" {locking};\n"
            f" IF NOT FOUND OR s.{q('window')} IS NOT NULL OR COALESCE(s.queue_live, false)"
            " OR p_count > s.capacity THEN RETURN; END IF;\n"
            # A statement of its own, so read once the lock is held: the
            # releases committed during the wait count.
            f" SELECT c.{q('released')} INTO v_released FROM {self.counter} c"
            f" WHERE c.{q('semaphore_id')} = s.id;\n"
            " v_held := GREATEST(s.in_use_counter"
            " - GREATEST(COALESCE(v_released, 0) - s.released_folded, 0), 0);\n"
            " IF v_held + p_count > s.capacity THEN RETURN; END IF;\n"
            " v_now := clock_timestamp();\n"
            " v_expires := v_now + make_interval(secs => p_ttl);\n"
            f" INSERT INTO {self.request} ({q('external_id')}, {q('owner')}, {q('state')},"
            f" {q('ttl')}, {q('expires_at')}, {q('created_at')}, {q('updated_at')},"
            f" {q('released_at')}, {q('release_reason')})"
            f" VALUES (p_key, p_owner, '{self.acquired}', p_ttl, v_expires, v_now, v_now,"
            f" NULL, '') RETURNING {q('id')} INTO v_request;\n"
            f" UPDATE {self.semaphore} SET {q('fencing_counter')} = {q('fencing_counter')} + 1,"
            f" {q('in_use_counter')} = v_held + p_count,"
            f" {q('released_folded')} = GREATEST(COALESCE(v_released, 0), s.released_folded),"
            f" {q('updated_at')} = v_now WHERE {q('id')} = s.id;\n"
            f" INSERT INTO {self.permit} ({q('semaphore_id')}, {q('request_id')}, {q('count')},"
            f" {q('fencing_token')}, {q('slot_ends')}, {q('state')})"
            f" VALUES (s.id, v_request, p_count, s.fencing_counter + 1, NULL, '{self.acquired}');\n"
            " RETURN QUERY SELECT v_request, v_now, v_expires, (s.fencing_counter + 1)::bigint,"
            " v_held + p_count;\n"
            "END\n"
        )


def one_trip_statements(connection: BaseDatabaseWrapper) -> OneTripStatements:
    """This connection's one-trip grant."""
    return built(OneTripStatements, connection)


def install(connection: BaseDatabaseWrapper) -> None:
    """Create (or replace) the PostgreSQL function; nothing elsewhere."""
    if connection.vendor != "postgresql":
        return
    body = OneTripStatements(connection).function_body()
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE OR REPLACE FUNCTION {FUNCTION}(p_name text, p_count integer,"
            " p_key text, p_owner text, p_ttl integer, p_lock_wait text)"
            " RETURNS TABLE (granted_request bigint, granted_at timestamptz,"
            " granted_expires_at timestamptz, granted_token bigint, granted_in_use bigint)"
            f" LANGUAGE plpgsql VOLATILE AS $grant${body}$grant$"
        )


def uninstall(connection: BaseDatabaseWrapper) -> None:
    """Drop the PostgreSQL function (the migration's reverse)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                f"DROP FUNCTION IF EXISTS {FUNCTION}(text, integer, text, text, integer, text)"
            )
