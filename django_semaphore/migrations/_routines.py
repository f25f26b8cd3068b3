"""The step of a migration that replaces the database's routines with the
ones it froze in ``sql/`` (``<migration>.<server>.sql``): MariaDB's
procedures, PostgreSQL's functions and procedures; nothing on SQLite and
MySQL. A migration's files, and this module, never change once released:
what a migration installs is what it installed the day it shipped, and its
reverse installs what the migration before it froze.

A MariaDB user without CREATE ROUTINE migrates all the same: the step is
skipped with a warning, and the app takes its general grant
(``check --database`` says so).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from django.db import DatabaseError, migrations
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

logger = logging.getLogger("django_semaphore")

FROZEN = Path(__file__).with_name("sql")
END = "\n-- end of statement\n"
CREATED = re.compile(r"CREATE OR REPLACE (?:FUNCTION|PROCEDURE) (\w+)")
# MariaDB: access denied to the database, to a table, to an operation; no
# right to alter a routine.
MARIADB_DENIED = frozenset({1044, 1142, 1227, 1370})


def replace(old: str | None, new: str | None) -> migrations.RunPython:
    """The step that drops the routines migration ``old`` created and
    creates those ``new`` froze; its reverse, the other way round."""

    def forward(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
        _replace(schema_editor, old, new)

    def backward(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
        _replace(schema_editor, new, old)

    # Not atomic: MariaDB cannot roll DDL back (PostgreSQL runs the whole
    # migration in one transaction all the same).
    return migrations.RunPython(forward, backward, atomic=False, elidable=False)


def _replace(schema_editor: BaseDatabaseSchemaEditor, old: str | None, new: str | None) -> None:
    server = _server(schema_editor.connection)
    if server is None:
        return
    try:
        for name in _created(old, server):
            _drop(schema_editor, server, name)
        for sql in _statements(new, server) if new else []:
            schema_editor.execute(sql, params=None)
    except DatabaseError as exc:
        if server != "mariadb" or not exc.args or exc.args[0] not in MARIADB_DENIED:
            raise
        logger.warning(
            "django_semaphore: the routines of migration %s were not installed (%s); the "
            "app takes its general grant. GRANT CREATE ROUTINE, ALTER ROUTINE and EXECUTE "
            "to the migrating user and migrate again for the one-call grant.",
            new or old,
            exc,
        )


def _server(connection: BaseDatabaseWrapper) -> str | None:
    if connection.vendor == "postgresql":
        return "postgresql"
    if connection.vendor == "mysql" and connection.mysql_is_mariadb:
        return "mariadb"
    return None


def _statements(migration: str, server: str) -> list[str]:
    text = (FROZEN / f"{migration}.{server}.sql").read_text()
    return [sql for sql in text.split(END) if sql.strip()]


def _created(migration: str | None, server: str) -> list[str]:
    if migration is None:
        return []
    return [CREATED.match(sql).group(1) for sql in _statements(migration, server)]  # type: ignore[union-attr]


def _drop(schema_editor: BaseDatabaseSchemaEditor, server: str, name: str) -> None:
    if server == "mariadb":
        schema_editor.execute(f"DROP PROCEDURE IF EXISTS {name}", params=None)
        return
    # Every signature the name has (a function's arguments are part of it).
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT oid::regprocedure::text FROM pg_proc WHERE proname = %s"
            " AND pronamespace = current_schema()::regnamespace",
            [name],
        )
        signatures = [row[0] for row in cursor.fetchall()]
    for signature in signatures:
        schema_editor.execute(f"DROP ROUTINE {signature}", params=None)
