"""Raw DB-API connections (no Django) and the little SQL that differs by vendor.

The raw clients (the limit, the seed design, GET_LOCK) talk to the database
through these, so what they measure is the database, not an ORM.
"""

from __future__ import annotations

import functools
import sqlite3
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
