"""Raw DB-API connections (no Django) and the little SQL that differs by vendor.

The raw clients (the limit, the seed design, GET_LOCK) talk to the database
through these, so what they measure is the database, not an ORM.
"""

from __future__ import annotations

import functools
import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

VENDORS = {
    "mysql": "mysql",
    "mariadb": "mysql",
    "postgres": "postgresql",
    "postgresql": "postgresql",
}


@dataclass(frozen=True)
class Target:
    """Where the benchmark runs, parsed from a database URL."""

    url: str
    vendor: str  # "mysql", "postgresql" or "sqlite"
    host: str = ""
    port: int = 0
    user: str = ""
    password: str = ""
    name: str = ""  # database name, or the SQLite file path

    @classmethod
    def parse(cls, url: str) -> Target:
        parts = urlsplit(url)
        scheme = parts.scheme.split("+")[0]
        if scheme == "sqlite":
            return cls(url=url, vendor="sqlite", name=parts.path[1:] if parts.path else "")
        vendor = VENDORS.get(scheme)
        if vendor is None:
            raise ValueError(f"Unsupported database URL: {url}")
        return cls(
            url=url,
            vendor=vendor,
            host=parts.hostname or "127.0.0.1",
            port=parts.port or (3306 if vendor == "mysql" else 5432),
            user=unquote(parts.username or ""),
            password=unquote(parts.password or ""),
            name=parts.path.lstrip("/"),
        )

    @property
    def placeholder(self) -> str:
        return "?" if self.vendor == "sqlite" else "%s"


def connect(target: Target, *, database: str | None = None, autocommit: bool = False) -> Any:
    """A DB-API connection. Without autocommit the first statement opens a
    transaction (MySQL, PostgreSQL); SQLite clients say BEGIN IMMEDIATE."""
    name = target.name if database is None else database
    if target.vendor == "mysql":
        import MySQLdb

        conn = MySQLdb.connect(
            host=target.host,
            port=target.port,
            user=target.user,
            passwd=target.password,
            charset="utf8mb4",
            **({"db": name} if name else {}),
        )
        conn.autocommit(autocommit)
        return conn
    if target.vendor == "postgresql":
        import psycopg

        return psycopg.connect(
            host=target.host,
            port=target.port,
            user=target.user,
            password=target.password or None,
            dbname=name or "postgres",
            autocommit=autocommit,
            **_postgres_extra(),
        )
    # isolation_level=None: the driver never opens transactions on its own.
    return sqlite3.connect(name, isolation_level=None, timeout=20, check_same_thread=False)


def sql(target: Target, statement: str) -> str:
    """Statements are written with ``%s``; SQLite wants ``?``."""
    return statement.replace("%s", "?") if target.vendor == "sqlite" else statement


def ensure_database(target: Target) -> None:
    """Create the benchmark's database if it does not exist (never drops one)."""
    if target.vendor == "sqlite":
        return
    if target.vendor == "mysql":
        conn = connect(target, database="", autocommit=True)
        conn.cursor().execute(
            f"CREATE DATABASE IF NOT EXISTS `{target.name}` CHARACTER SET utf8mb4"
        )
        conn.close()
        return
    conn = connect(target, database="postgres", autocommit=True)
    exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [target.name]).fetchone()
    if not exists:
        conn.execute(f'CREATE DATABASE "{target.name}"')
    conn.close()


@functools.cache
def server_version(target: Target) -> str:
    conn = connect(target, autocommit=True)
    cursor = conn.cursor()
    if target.vendor == "sqlite":
        cursor.execute("SELECT 'SQLite ' || sqlite_version()")
    else:
        cursor.execute("SELECT version()")
    version = str(cursor.fetchone()[0])
    conn.close()
    return version


def is_mariadb(target: Target) -> bool:
    return target.vendor == "mysql" and "mariadb" in server_version(target).lower()


def numbers(target: Target, first: int, last: int) -> str:
    """A derived table ``nums(n)`` of the integers first..last, for bulk seeding."""
    if target.vendor == "postgresql":
        return f"(SELECT generate_series({first}, {last}) AS n) nums"
    if is_mariadb(target):
        return f"(SELECT seq AS n FROM seq_{first}_to_{last}) nums"
    return (
        f"(WITH RECURSIVE r(n) AS (SELECT {first} UNION ALL SELECT n + 1 FROM r "
        f"WHERE n < {last}) SELECT n FROM r) nums"
    )


def concat(target: Target, *parts: str) -> str:
    if target.vendor == "mysql":
        return f"CONCAT({', '.join(parts)})"
    return " || ".join(f"CAST({part} AS TEXT)" if part == "n" else part for part in parts)


# --- commit modes (python -m benchmarks --fast-commit / --durable) -----------

# "fast": commits do not wait for the disk; "durable": they do (where the
# server lets a session or a global say so); "": the server's own settings.
COMMIT_MODES = ("", "fast", "durable")
MARIADB_FLUSH = {"fast": 2, "durable": 1}  # innodb_flush_log_at_trx_commit
POSTGRES_SYNC = {"fast": "off", "durable": "on"}  # synchronous_commit


def commit_mode() -> str:
    """The run's commit mode, passed to the client processes in the environment."""
    mode = os.environ.get("BENCH_COMMIT", "")
    if mode not in COMMIT_MODES:
        raise ValueError(f"BENCH_COMMIT={mode!r}: one of {COMMIT_MODES}")
    return mode


def _postgres_extra() -> dict[str, Any]:
    options = postgres_options()
    return {"options": options} if options else {}


def postgres_options() -> str:
    """libpq ``options`` for every PostgreSQL connection of the run (the app's
    Django connection and the raw clients' alike): synchronous_commit is a
    session setting, so no server setting changes."""
    mode = commit_mode()
    return f"-c synchronous_commit={POSTGRES_SYNC[mode]}" if mode else ""


def commit_settings(target: Target) -> dict[str, Any]:
    """What a commit waits for on this server, as a client of the run sees it."""
    if target.vendor == "sqlite":
        return {}
    conn = connect(target, autocommit=True)
    try:
        cursor = conn.cursor()
        if target.vendor == "mysql":
            cursor.execute("SELECT @@innodb_flush_log_at_trx_commit, @@sync_binlog, @@log_bin")
            flush, sync_binlog, log_bin = cursor.fetchone()
            return {
                "innodb_flush_log_at_trx_commit": int(flush),
                "sync_binlog": int(sync_binlog),
                "log_bin": int(log_bin),
            }
        cursor.execute(
            "SELECT current_setting('synchronous_commit'), current_setting('fsync'),"
            " current_setting('wal_sync_method')"
        )
        sync, fsync, method = cursor.fetchone()
        return {"synchronous_commit": sync, "fsync": fsync, "wal_sync_method": method}
    finally:
        conn.close()


def apply_commit_mode(target: Target) -> tuple[str, Callable[[], None]]:
    """Set MariaDB's ``innodb_flush_log_at_trx_commit`` for the run (a global)
    and return who set it and how to put the old value back. PostgreSQL's is
    per session (``postgres_options``): nothing to set or restore here.

    A global needs a user that may set globals: the benchmark's own, or else
    ``root`` over TCP without a password, as ``scripts/servers.py`` creates it
    for the private server (``root@127.0.0.1``)."""
    mode = commit_mode()
    if not mode or target.vendor != "mysql":
        return "", lambda: None
    import MySQLdb

    errors = []
    for user, password in ((target.user, target.password), ("root", "")):
        try:
            conn = MySQLdb.connect(host=target.host, port=target.port, user=user, passwd=password)
            cursor = conn.cursor()
            cursor.execute("SELECT @@GLOBAL.innodb_flush_log_at_trx_commit")
            before = int(cursor.fetchone()[0])
            cursor.execute(f"SET GLOBAL innodb_flush_log_at_trx_commit = {MARIADB_FLUSH[mode]}")
        except MySQLdb.Error as exc:
            errors.append(f"{user}: {exc}")
            continue

        def restore(conn: Any = conn, before: int = before) -> None:
            try:
                conn.cursor().execute(f"SET GLOBAL innodb_flush_log_at_trx_commit = {before}")
            finally:
                conn.close()

        return f"{user}@{target.host}:{target.port} (was {before})", restore
    raise RuntimeError("cannot set innodb_flush_log_at_trx_commit (a global): " + "; ".join(errors))
