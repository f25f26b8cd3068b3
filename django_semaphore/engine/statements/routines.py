"""The routines the migrations install, rendered from the statements they
run: the grant in one trip (``grant_routine.py``: a procedure on MariaDB,
functions for one name and for several on PostgreSQL), the release by key
with the read of what it ended (``release.py``: a procedure) and, on PostgreSQL, the queue every
grant waits in (``queue.py``). The server parses and plans their
statements once per connection, whatever the project's binding setting,
where Django would send them as text to parse and plan every time. A test
compares each installed routine with the one the code renders, so a
change of either needs a migration that installs it again."""

from __future__ import annotations

from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore import backends
from django_semaphore.engine.statements import grant_routine, one_trip, queue, release

# What PostgreSQL's grant functions take, for dropping them.
GRANT_ARGUMENTS = "text[], integer[], text, text, integer, text"
ONE_NAME_ARGUMENTS = "text, integer, text, text, integer, text, boolean, boolean, boolean, float8"


def install(connection: BaseDatabaseWrapper) -> None:
    """Create (or replace) this database's routines; nothing on SQLite and MySQL."""
    with connection.cursor() as cursor:
        for create in _creates(connection):
            cursor.execute(create)


def uninstall(connection: BaseDatabaseWrapper) -> None:
    """Drop them (the migration's reverse)."""
    drops = []
    if connection.vendor == "postgresql":
        drops = [
            f"DROP FUNCTION IF EXISTS {one_trip.ROUTINE}({GRANT_ARGUMENTS})",
            f"DROP FUNCTION IF EXISTS {one_trip.ONE_NAME_ROUTINE}({ONE_NAME_ARGUMENTS})",
            f"DROP PROCEDURE IF EXISTS {release.ROUTINE}",
            f"DROP FUNCTION IF EXISTS {queue.ROUTINE}({queue.ARGUMENTS})",
        ]
    elif backends.bounds_each_statement(connection):
        drops = [f"DROP PROCEDURE IF EXISTS {name}" for name in (one_trip.ROUTINE, release.ROUTINE)]
    with connection.cursor() as cursor:
        for drop in drops:
            cursor.execute(drop)


def _creates(connection: BaseDatabaseWrapper) -> list[str]:
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
            " p_key text, p_owner text, p_ttl integer, p_lock_wait text)"
            f" RETURNS TABLE ({granted}) LANGUAGE plpgsql VOLATILE"
            f" AS $grant${grant.function_body()}$grant$",
            f"CREATE OR REPLACE FUNCTION {one_trip.ONE_NAME_ROUTINE}(p_name text, p_count integer,"
            " p_key text, p_owner text, p_ttl integer, p_lock_wait text, p_ticketed boolean,"
            " p_lacked boolean, p_fair boolean, p_life double precision)"
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
        " p_lacked BOOL, p_fair BOOL, p_life DOUBLE)"
        f" SQL SECURITY INVOKER {grant.procedure_body()}",
        f"CREATE OR REPLACE PROCEDURE {release.ROUTINE}(p_key {key}, p_reason {reason},"
        " p_wait INT, p_read VARCHAR(6))"
        f" SQL SECURITY INVOKER {release_statements.procedure_body()}",
    ]
