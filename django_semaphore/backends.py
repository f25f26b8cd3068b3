"""The per-database differences: bounding lock waits, reading the clock, and
telling transient errors (retry) from real ones (surface).

Everything vendor-specific lives here so ``engine/grant.py`` reads as the algorithm.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import Error, IntegrityError, InterfaceError, OperationalError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.functions import Now
from django.db.models.sql.compiler import SQLCompiler

from django_semaphore.exceptions import (
    InconsistentData,
    MissingPrivilege,
    SchemaOutOfDate,
    SemaphoreError,
)

logger = logging.getLogger("django_semaphore")


class Failure(enum.Enum):
    """Why a statement failed, as far as retrying is concerned."""

    CONTENTION = "contention"  # deadlock, lock wait timeout, busy: retry
    DISCONNECT = "disconnect"  # connection lost or server restarting: reconnect, retry
    # A routine of the app's version is not installed (``routines_installed``),
    # or the tickets' ranking columns (``tickets_ranked``): the code is newer
    # than the migrations, and the next attempt does without them.
    ROUTINE_MISSING = "routine_missing"


# MySQL/MariaDB server and client error codes.
MYSQL_CONTENTION = frozenset(
    {
        1205,  # ER_LOCK_WAIT_TIMEOUT
        1969,  # ER_STATEMENT_TIMEOUT: max_statement_time
        # ER_LOCK_DEADLOCK, also a Galera certification failure or brute-force
        # abort, from any statement of the transaction or from its COMMIT.
        1213,
        3101,  # ER_TRANSACTION_ROLLBACK_DURING_COMMIT: group replication's conflict
    }
)
MYSQL_DISCONNECT = frozenset(
    {
        1047,  # WSREP has not yet prepared node for application use (Galera)
        1053,  # ER_SERVER_SHUTDOWN
        1077,  # ER_NORMAL_SHUTDOWN
        # ER_ERROR_DURING_COMMIT: a Galera node losing its cluster at COMMIT;
        # retrying is safe, a committed grant is found again by its key.
        1180,
        # ER_OPTION_PREVENTS_STATEMENT (--read-only), ER_READ_ONLY_MODE: a primary
        # demoted by a failover; a new connection through the cluster's router
        # or proxy reaches the new one.
        1290,
        1836,
        1927,  # ER_CONNECTION_KILLED (MariaDB)
        # CR_UNKNOWN_ERROR (and 2014, 2027 below): the client read an answer
        # that is not its own (seen on Galera after a conflict, as "Load
        # data local infile forbidden"); a new connection starts clean, and
        # the retry finds a grant by its key.
        2000,
        2002,  # CR_CONNECTION_ERROR
        2003,  # CR_CONN_HOST_ERROR
        2006,  # CR_SERVER_GONE_ERROR
        2013,  # CR_SERVER_LOST
        2014,  # CR_COMMANDS_OUT_OF_SYNC
        2027,  # CR_MALFORMED_PACKET
        4031,  # ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8)
    }
)
# PostgreSQL SQLSTATEs: deadlock, lock_not_available, serialization_failure,
# query_canceled (statement_timeout).
POSTGRES_CONTENTION = frozenset({"40P01", "55P03", "40001", "57014"})
# MySQL's error numbers and PostgreSQL's SQLSTATEs (ints and strs: never
# equal) of a routine that is not there, or not with these arguments:
# ER_SP_DOES_NOT_EXIST, ER_SP_WRONG_NO_OF_ARGS; undefined_function.
NO_ROUTINE = frozenset({1305, 1318, "42883"})
# The user may not run a routine: ER_PROCACCESS_DENIED_ERROR; insufficient_privilege.
DENIED = frozenset({1370, "42501"})
# Class 08 is "connection exception"; 57P0x are shutdowns and crashes; 25006
# (read_only_sql_transaction) is a standby, e.g. the old primary after a
# failover: a new connection (libpq target_session_attrs=read-write, or the
# pooler) reaches the new primary.
POSTGRES_DISCONNECT_PREFIXES = ("08", "57P01", "57P02", "57P03", "25006")


def classify(connection: BaseDatabaseWrapper, exc: Error) -> Failure | None:
    """Whether ``exc`` is worth retrying, and how; ``None`` means surface it."""
    vendor, code = connection.vendor, _error_code(connection, exc)
    if _routine_missing(code, exc) or _unranked_tickets(code, exc):
        # One of the app's routines is not installed, or not in the version
        # called, or the tickets' ranking is not: the code is newer than the
        # migrations.
        return Failure.ROUTINE_MISSING
    if isinstance(exc, InterfaceError):
        # A server's connection the driver gave up on. SQLite has none to
        # lose: its InterfaceError is a value it could not bind, a bug.
        return None if vendor == "sqlite" else Failure.DISCONNECT
    if code in MYSQL_CONTENTION or code in POSTGRES_CONTENTION:
        return Failure.CONTENTION
    if code in MYSQL_DISCONNECT or (
        isinstance(code, str) and code.startswith(POSTGRES_DISCONNECT_PREFIXES)
    ):
        return Failure.DISCONNECT
    if vendor == "postgresql" and code is None:
        # psycopg reports a dropped socket as an OperationalError without
        # a SQLSTATE; an error the server raised always carries one.
        return Failure.DISCONNECT if isinstance(exc, OperationalError) else None
    if vendor == "sqlite":
        message = str(exc)
        if "database is locked" in message or "database table is locked" in message:
            return Failure.CONTENTION
    return None


# A table or column of the app is missing: its migrations are not applied.
# ER_NO_SUCH_TABLE, ER_BAD_FIELD_ERROR, ER_SP_DOES_NOT_EXIST (a routine,
# engine/statements/routines.py); undefined_table, undefined_column,
# undefined_function (a routine).
NO_SCHEMA = frozenset({1146, 1054, 1305, "42P01", "42703", "42883"})
SQLITE_NO_SCHEMA = ("no such table", "no such column")


def translate(connection: BaseDatabaseWrapper, exc: Error) -> SemaphoreError:
    """A database error not worth retrying (``classify`` said ``None``), as
    the ``SemaphoreError`` that tells the caller what to do about it."""
    alias, code = connection.alias, _error_code(connection, exc)
    if isinstance(exc, IntegrityError):
        # The grant's own inserts collide only with rows the engine did not
        # write: a fencing counter lowered below a token already issued (a
        # stale save() before 0004, an UPDATE, a restore), a permit without
        # its request. Retrying cannot help; the sweep repairs these.
        return InconsistentData(
            f"The semaphore tables on database {alias!r} contradict themselves ({exc}). "
            "Run manage.py semaphore_sweep --orphans (sweep.release_orphans()) to repair "
            "them; manage.py check --database lists what it finds."
        )
    if code in DENIED:
        return MissingPrivilege(
            f"The user of database {alias!r} may not run the app's routines ({exc}). "
            "Run, as their owner: GRANT EXECUTE ON <database>.* TO <user> (MariaDB), or "
            "GRANT EXECUTE ON ALL ROUTINES IN SCHEMA <schema> TO <user> (PostgreSQL)."
        )
    if code in NO_SCHEMA or (
        connection.vendor == "sqlite" and str(exc).startswith(SQLITE_NO_SCHEMA)
    ):
        return SchemaOutOfDate(
            f"The semaphore tables on database {alias!r} are missing or out of date "
            f"({exc}). Run manage.py migrate django_semaphore --database {alias}."
        )
    return SemaphoreError(
        f"Unexpected database error on {alias!r}: {exc} (the driver's error is this "
        "exception's __cause__; please report it if the database itself is healthy)."
    )


def _error_code(connection: BaseDatabaseWrapper, exc: Error) -> int | str | None:
    """MySQL's error number, PostgreSQL's SQLSTATE; ``None`` elsewhere."""
    if connection.vendor == "mysql":
        return exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
    if connection.vendor == "postgresql":
        return getattr(exc.__cause__, "sqlstate", None)
    return None


# Alias -> when to call the routines again, in this process: a migration may
# install them meanwhile.
_without_routines: dict[str, float] = {}
ROUTINES_RECHECK = 60.0


# Alias -> when to rank tickets again (``Ticket.ranked_at``, ``priority``,
# ``share``, ``turn_at``),
# in this process: until their migration is applied, waiters are served by
# arrival alone.
_without_ranks: dict[str, float] = {}
RANKS = ("priority", "ranked_at", "share", "turn_at")


def _routine_missing(code: int | str | None, exc: Error) -> bool:
    # PostgreSQL's internal_error "cache lookup failed for function": a
    # migration dropped the routine while this call ran it; the call, one
    # transaction, was undone.
    message = str(exc)
    return "django_semaphore_" in message and (
        code in NO_ROUTINE or (code == "XX000" and "cache lookup failed for function" in message)
    )


def _unranked_tickets(code: int | str | None, exc: Error) -> bool:
    # ER_BAD_FIELD_ERROR, undefined_column, naming a ranking column.
    return code in (1054, "42703") and any(column in str(exc) for column in RANKS)


def tickets_ranked(connection: BaseDatabaseWrapper) -> bool:
    """Whether the tickets on ``connection`` carry their ranking: yes unless
    a statement found its columns missing less than ``ROUTINES_RECHECK``
    seconds ago."""
    again_at = _without_ranks.get(connection.alias)
    return again_at is None or time.monotonic() >= again_at


def routines_installed(connection: BaseDatabaseWrapper) -> bool:
    """Whether to call this version's routines on ``connection``: yes unless
    a call found them missing less than ``ROUTINES_RECHECK`` seconds ago."""
    again_at = _without_routines.get(connection.alias)
    return again_at is None or time.monotonic() >= again_at


def note_routines_missing(connection: BaseDatabaseWrapper, exc: Error) -> None:
    """Take the general path on ``connection`` for a while (``Failure.ROUTINE_MISSING``);
    logged once per alias and process."""
    if connection.alias not in _without_routines:
        logger.warning(
            "django_semaphore: database %r lacks the routines or columns of this version (%s); "
            "granting and releasing the general way until they are installed "
            "(manage.py migrate django_semaphore; manage.py check --database %s says more).",
            connection.alias,
            exc,
            connection.alias,
        )
    _without_routines[connection.alias] = time.monotonic() + ROUTINES_RECHECK
    if _unranked_tickets(_error_code(connection, exc), exc):
        _without_ranks[connection.alias] = time.monotonic() + ROUTINES_RECHECK


@contextmanager
def bounded_lock_wait(connection: BaseDatabaseWrapper, seconds: float) -> Iterator[None]:
    """Bound how long the next transaction waits for a row lock, then restore.

    Wraps the whole ``atomic()`` block. PostgreSQL is bounded from inside the
    transaction instead (see :func:`start_bounded_transaction`).
    """
    if connection.vendor not in ("mysql", "sqlite"):
        yield
        return
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            # Integer seconds, at least 1. The old value is kept server-side in a
            # user variable so the bound costs no extra round trip to read it.
            cursor.execute(
                "SET @django_semaphore_lock_wait = @@SESSION.innodb_lock_wait_timeout,"
                " SESSION innodb_lock_wait_timeout = %s",
                [max(1, math.ceil(seconds))],
            )
            restore = "SET SESSION innodb_lock_wait_timeout = @django_semaphore_lock_wait"
        else:
            # The busy timeout is what BEGIN IMMEDIATE waits for the write lock.
            cursor.execute("PRAGMA busy_timeout")
            restore = f"PRAGMA busy_timeout = {int(cursor.fetchone()[0])}"
            cursor.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")
    try:
        yield
    finally:
        # If the connection died mid-transaction there is nothing left to
        # restore: the session that carried the setting is gone with it.
        with suppress(Error), connection.cursor() as cursor:
            cursor.execute(restore)


def bounds_each_statement(connection: BaseDatabaseWrapper) -> bool:
    """MariaDB can bound one statement's lock wait (``SET STATEMENT ... FOR``)."""
    return connection.vendor == "mysql" and bool(getattr(connection, "mysql_is_mariadb", False))


def bound_statement(connection: BaseDatabaseWrapper, sql: str, seconds: float) -> str:
    """``sql`` with its lock wait bounded, where the database can say so per
    statement (MariaDB); elsewhere unchanged (:func:`bounded_lock_wait` bounds
    the session instead). Two round trips fewer than setting and restoring
    the session's value, and nothing to restore if the connection dies."""
    if bounds_each_statement(connection):
        return f"SET STATEMENT innodb_lock_wait_timeout = {max(1, math.ceil(seconds))} FOR {sql}"
    return sql


def start_bounded_transaction(connection: BaseDatabaseWrapper, seconds: float) -> None:
    """First statement inside the grant transaction."""
    if connection.vendor == "postgresql":
        # SET LOCAL ends with the transaction: nothing to restore.
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('lock_timeout', %s, true)", [lock_timeout(seconds)])


def lock_timeout(seconds: float) -> str:
    """PostgreSQL's ``lock_timeout`` setting for ``seconds``."""
    return f"{int(seconds * 1000)}ms"


@contextmanager
def bounded_transaction(
    connection: BaseDatabaseWrapper,
    seconds: float,
    *,
    statements_bounded: bool = False,
    durable: bool = False,
) -> Iterator[None]:
    """A transaction whose lock waits end after ``seconds``.

    ``statements_bounded``: the caller bounds each of its statements with
    :func:`bound_statement`, so on MariaDB no session variable is set and
    restored around the transaction (two round trips fewer).
    """
    session = (
        nullcontext()
        if statements_bounded and bounds_each_statement(connection)
        else bounded_lock_wait(connection, seconds)
    )
    with session, transaction.atomic(using=connection.alias, durable=durable):
        start_bounded_transaction(connection, seconds)
        yield


@dataclass(frozen=True)
class ServerSettings:
    """What the connected server says about itself, for the system checks."""

    read_only: str = ""  # why it refuses writes ("read_only", "in recovery"), or ""
    galera: bool = False  # a Galera cluster node (wsrep_on)
    causal_reads: bool = True  # Galera: reads wait for the writes committed elsewhere
    isolation: str = ""  # the session's isolation level, lower case with spaces


def server_settings(connection: BaseDatabaseWrapper) -> ServerSettings:
    """Ask the server behind ``connection`` (its session, as Django set it up)."""
    if connection.vendor == "mysql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SHOW VARIABLES WHERE Variable_name IN ('read_only', 'super_read_only',"
                " 'wsrep_on', 'wsrep_sync_wait', 'transaction_isolation', 'tx_isolation')"
            )
            values = {name: str(value) for name, value in cursor.fetchall()}
        isolation = values.get("transaction_isolation") or values.get("tx_isolation", "")
        return ServerSettings(
            read_only=", ".join(
                name for name in ("read_only", "super_read_only") if values.get(name) == "ON"
            ),
            galera=values.get("wsrep_on") == "ON",
            # Bit 1 of wsrep_sync_wait: reads wait until the node applied
            # every write the cluster committed before they started.
            causal_reads=int(values.get("wsrep_sync_wait") or 0) & 1 == 1,
            isolation=isolation.lower().replace("-", " "),
        )
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_is_in_recovery(), current_setting('transaction_isolation')")
            in_recovery, isolation = cursor.fetchone()
        return ServerSettings(read_only="in recovery" if in_recovery else "", isolation=isolation)
    return ServerSettings()


def is_sqlite_without_immediate_transactions(database: dict[str, Any]) -> bool:
    """Without BEGIN IMMEDIATE, two SQLite writers fail instead of queueing.

    Takes the ``DATABASES`` entry, so it can be checked without connecting.
    """
    if not database.get("ENGINE", "").endswith("sqlite3"):
        return False
    mode = database.get("OPTIONS", {}).get("transaction_mode") or ""
    return mode.upper() not in {"IMMEDIATE", "EXCLUSIVE"}


def datetime_from_db(connection: BaseDatabaseWrapper, value: Any) -> Any:
    """A ``DatabaseNow()`` value read with a raw cursor, converted as the ORM
    would (SQLite returns text, MySQL a naive datetime); ``None`` stays ``None``
    without building the converters (a grant without a ttl has no expiry)."""
    if value is None:
        return None
    expression = DatabaseNow()
    for convert in connection.ops.get_db_converters(expression):
        value = convert(value, expression, connection)
    return value


class _UtcNow(Now):
    """Django's ``Now()`` but on MySQL, where that is the session's local
    time: with ``USE_TZ`` the stored values are UTC, so MySQL reads
    ``mysql_utc``."""

    mysql_utc = ""

    def as_mysql(
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra_context: Any
    ) -> tuple[str, tuple[str | int, ...]]:
        if settings.USE_TZ and connection.timezone_name == "UTC":
            return self.as_sql(compiler, connection, template=self.mysql_utc, **extra_context)
        return super().as_mysql(compiler, connection, **extra_context)


class DatabaseNow(_UtcNow):
    """The database's clock, in UTC, as Django stores datetimes.

    Expiry is decided by one clock (the database's), never by each client's.

    It is the time the value is computed, not when the statement started
    (``UTC_TIMESTAMP()``, ``STATEMENT_TIMESTAMP()``): in the grant's locking
    read, the start is *before* the wait for the row lock, and a TTL counted
    from there would be cut short by that wait.
    """

    # UTC at the statement's start, plus the time since (SYSDATE is
    # evaluated when read, NOW at the start; both session-local).
    mysql_utc = (
        "TIMESTAMPADD(MICROSECOND, TIMESTAMPDIFF(MICROSECOND, NOW(6),"
        " SYSDATE(6)), UTC_TIMESTAMP(6))"
    )

    def as_postgresql(
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra_context: Any
    ) -> tuple[str, tuple[str | int, ...]]:
        return self.as_sql(compiler, connection, template="CLOCK_TIMESTAMP()", **extra_context)


class StatementNow(_UtcNow):
    """The database's clock when the statement started, in UTC: one value
    however often the statement reads it.

    For statements that run once every lock they need is held (the grant's
    insert), where the start is after any wait and every column written from
    the clock must agree.
    """

    mysql_utc = "UTC_TIMESTAMP(6)"
