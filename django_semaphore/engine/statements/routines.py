"""The routines of this code's version (``ROUTINES_VERSION``), rendered
from the statements they run: the grant in one trip (``grant_routine.py``:
a procedure on MariaDB, functions for one name and for several on
PostgreSQL), the release by key with the read of what it ended
(``release.py``: a procedure) and, on PostgreSQL, the queue every grant
waits in (``queue.py``). The server parses and plans their statements once
per connection, whatever the project's binding setting, where Django would
send them as text to parse and plan every time.

The migrations do not install this rendering: each froze its routines'
text in ``migrations/sql/`` (``scripts/freeze_routines.py`` writes a new
version's files from ``creates``), and the code calls the routines by
their versioned names. A test compares ``creates`` with the newest frozen
text, so a routine changed here needs a new version and a migration."""

from __future__ import annotations

from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore import backends
from django_semaphore.engine.statements import grant_routine, one_trip, queue, release


def missing(connection: BaseDatabaseWrapper) -> list[str]:
    """This version's routines that the database behind ``connection`` lacks
    (``check --database``)."""
    names = names_on(connection)
    if not names:
        return []
    if connection.vendor == "postgresql":
        sql = (
            "SELECT proname FROM pg_proc WHERE proname = ANY(%s)"
            " AND pronamespace = current_schema()::regnamespace"
        )
        params: list[Any] = [names]
    else:
        sql = (
            "SELECT ROUTINE_NAME FROM information_schema.ROUTINES"
            " WHERE ROUTINE_SCHEMA = DATABASE() AND ROUTINE_NAME IN"
            f" ({', '.join(['%s'] * len(names))})"
        )
        params = list(names)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        found = {row[0] for row in cursor.fetchall()}
    return [name for name in names if name not in found]


def names_on(connection: BaseDatabaseWrapper) -> list[str]:
    """The names of this version's routines on this database; none on SQLite and MySQL."""
    if connection.vendor == "postgresql":
        return [queue.ROUTINE, one_trip.ROUTINE, one_trip.ONE_NAME_ROUTINE, release.ROUTINE]
    if backends.bounds_each_statement(connection):
        return [one_trip.ROUTINE, release.ROUTINE]
    return []


def creates(connection: BaseDatabaseWrapper) -> list[str]:
    """The ``CREATE`` of each routine, in the order ``names_on`` lists them."""
    grant = grant_routine.GrantRoutine(connection)
    release_statements = release.ReleaseStatements(connection)
    if connection.vendor == "postgresql":
        read = ", ".join(f"OUT {name} {type_}" for name, type_ in release.POSTGRES_READ.items())
        granted = (
            "granted_request bigint, granted_at timestamptz, granted_expires_at timestamptz,"
            " granted_name text, granted_token bigint, granted_in_use bigint"
        )
        return [
            queue.create_sql(),
            f"CREATE OR REPLACE FUNCTION {one_trip.ROUTINE}(p_names text[], p_counts integer[],"
            " p_key text, p_owner text, p_ttl integer, p_lock_wait text, p_fail_fast boolean)"
            f" RETURNS TABLE ({granted}, refused_id bigint, refused_capacity bigint)"
            " LANGUAGE plpgsql VOLATILE"
            f" AS $grant${grant.function_body()}$grant$",
            f"CREATE OR REPLACE FUNCTION {one_trip.ONE_NAME_ROUTINE}(p_name text, p_count integer,"
            " p_key text, p_owner text, p_ttl integer, p_lock_wait text, p_ticketed boolean,"
            " p_lacked boolean, p_life double precision, p_priority integer,"
            " p_head_start double precision)"
            f" RETURNS TABLE ({granted}, refused_id bigint, refused_capacity bigint,"
            " refused_rounds bigint, refused_ticket boolean) LANGUAGE plpgsql VOLATILE"
            f" AS $grant${grant.one_name_function_body()}$grant$",
            f"CREATE OR REPLACE PROCEDURE {release.ROUTINE}(p_key text, p_reason text,"
            f" p_lock_wait text, p_read text, OUT out_ended bigint, {read})"
            f" LANGUAGE plpgsql AS $release${release_statements.procedure_body()}$release$",
        ]
    if not backends.bounds_each_statement(connection):
        return []
    # Parameters typed as the columns they are compared with, so the reads
    # keep their indexes whatever the database's character set; run with
    # the caller's rights.
    q = grant.q
    name = f"TYPE OF {grant.semaphore}.{q('name')}"
    key = f"TYPE OF {grant.request}.{q('external_id')}"
    owner = f"TYPE OF {grant.request}.{q('owner')}"
    reason = f"TYPE OF {grant.request}.{q('release_reason')}"
    return [
        f"CREATE OR REPLACE PROCEDURE {one_trip.ROUTINE}(p_name {name}, p_count INT,"
        f" p_ttl INT, p_key {key}, p_owner {owner}, p_wait INT, p_ticketed BOOL,"
        " p_lacked BOOL, p_life DOUBLE, p_priority INT, p_head_start DOUBLE)"
        f" SQL SECURITY INVOKER {grant.procedure_body()}",
        f"CREATE OR REPLACE PROCEDURE {release.ROUTINE}(p_key {key}, p_reason {reason},"
        " p_wait INT, p_read VARCHAR(6))"
        f" SQL SECURITY INVOKER {release_statements.procedure_body()}",
    ]
