"""Direct MariaDB access for the runner and the checker: plain MySQLdb, never
the app's models, so what the checker reads does not depend on the app.

The audit triggers installed here record, inside the database and in the
same transaction, every committed insert and state change of permits and
requests. Per semaphore, grants are serialized by its row lock, so the audit
id order of permit inserts is their commit order; a release's audit id is
taken before its (autocommit) statement commits, so a grant that saw the
release always has a larger id. Replaying the audit in id order therefore
gives each semaphore's holdings on the database's own timeline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import MySQLdb

DATABASE = "faults"

AUDIT_SQL = [
    """CREATE TABLE IF NOT EXISTS faults_audit (
        id BIGINT AUTO_INCREMENT PRIMARY KEY,
        tbl CHAR(1) NOT NULL,
        op CHAR(1) NOT NULL,
        row_id BIGINT NOT NULL,
        request_id BIGINT NULL,
        semaphore_id BIGINT NULL,
        cnt BIGINT NULL,
        state VARCHAR(8) NULL,
        token BIGINT NULL,
        ext VARCHAR(255) NULL,
        reason VARCHAR(16) NULL,
        trx VARCHAR(32) NULL,
        at DATETIME(6) NOT NULL
    ) ENGINE=InnoDB""",
    """CREATE TABLE IF NOT EXISTS faults_write (
        id BIGINT AUTO_INCREMENT PRIMARY KEY,
        resource VARCHAR(255) NOT NULL,
        token BIGINT NOT NULL,
        ext VARCHAR(255) NOT NULL,
        client VARCHAR(64) NOT NULL
    ) ENGINE=InnoDB""",
    """CREATE TABLE IF NOT EXISTS faults_hog (id INT PRIMARY KEY, n BIGINT NOT NULL)
    ENGINE=InnoDB""",
    "INSERT IGNORE INTO faults_hog VALUES (1, 0)",
]
# The session that wrote the row. (The InnoDB transaction id cannot be read
# reliably from a trigger: INFORMATION_SCHEMA.INNODB_TRX is a cached snapshot.)
TRX = "CONNECTION_ID()"
TRIGGERS = {
    "faults_permit_ins": f"""CREATE TRIGGER faults_permit_ins AFTER INSERT
        ON django_semaphore_permit FOR EACH ROW
        INSERT INTO faults_audit (tbl, op, row_id, request_id, semaphore_id, cnt, state,
                                  token, trx, at)
        VALUES ('P', 'I', NEW.id, NEW.request_id, NEW.semaphore_id, NEW.count, NEW.state,
                NEW.fencing_token, {TRX}, UTC_TIMESTAMP(6))""",
    "faults_permit_upd": f"""CREATE TRIGGER faults_permit_upd AFTER UPDATE
        ON django_semaphore_permit FOR EACH ROW
        INSERT INTO faults_audit (tbl, op, row_id, request_id, semaphore_id, cnt, state,
                                  token, trx, at)
        SELECT 'P', 'U', NEW.id, NEW.request_id, NEW.semaphore_id, NEW.count, NEW.state,
               NEW.fencing_token, {TRX}, UTC_TIMESTAMP(6)
        FROM DUAL WHERE NOT (OLD.state <=> NEW.state)""",
    "faults_request_ins": f"""CREATE TRIGGER faults_request_ins AFTER INSERT
        ON django_semaphore_permitrequest FOR EACH ROW
        INSERT INTO faults_audit (tbl, op, row_id, state, ext, trx, at)
        VALUES ('R', 'I', NEW.id, NEW.state, NEW.external_id, {TRX}, UTC_TIMESTAMP(6))""",
    "faults_request_upd": f"""CREATE TRIGGER faults_request_upd AFTER UPDATE
        ON django_semaphore_permitrequest FOR EACH ROW
        INSERT INTO faults_audit (tbl, op, row_id, state, ext, reason, trx, at)
        SELECT 'R', 'U', NEW.id, NEW.state, NEW.external_id, NEW.release_reason, {TRX},
               UTC_TIMESTAMP(6)
        FROM DUAL WHERE NOT (OLD.state <=> NEW.state)""",
}
APP_TABLES = [
    "django_semaphore_permit",
    "django_semaphore_permitrequest",
    "django_semaphore_capacitychange",
    "django_semaphore_fencingmark",
    "django_semaphore_ticket",
    "django_semaphore_releasecounter",
    "django_semaphore_semaphore",
    "faults_audit",
    "faults_write",
]


def parse(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    return {
        "host": parts.hostname or "127.0.0.1",
        "port": parts.port or 3306,
        "user": parts.username or "root",
        "password": parts.password or "",
    }


def database_url(port: int) -> str:
    return f"mysql://semaphore:semaphore@127.0.0.1:{port}/{DATABASE}"


def connect(url: str, database: str | None = DATABASE, timeout: float = 60) -> Any:
    """Connect, waiting out a restarting server."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            kwargs = parse(url)
            if database:
                kwargs["database"] = database
            return MySQLdb.connect(connect_timeout=3, autocommit=True, **kwargs)
        except MySQLdb.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


@contextmanager
def cursor(url: str) -> Iterator[Any]:
    conn = connect(url)
    try:
        yield conn.cursor()
    finally:
        conn.close()


def create(url: str, env: dict[str, str]) -> None:
    """A fresh database, migrated by Django, with the audit triggers."""
    conn = connect(url, database=None)
    cur = conn.cursor()
    cur.execute(f"DROP DATABASE IF EXISTS {DATABASE}")
    cur.execute(f"CREATE DATABASE {DATABASE} CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
    conn.close()
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--verbosity=0"],
        env={**env, "DJANGO_SETTINGS_MODULE": "benchmarks.faults.settings"},
        check=True,
    )
    with cursor(url) as cur:
        for sql in AUDIT_SQL:
            cur.execute(sql)
        for name, sql in TRIGGERS.items():
            cur.execute(f"DROP TRIGGER IF EXISTS {name}")
            cur.execute(sql)


def reset(url: str, semaphores: dict[str, int]) -> None:
    """Empty every table and create this scenario's semaphores."""
    with cursor(url) as cur:
        cur.execute("SET FOREIGN_KEY_CHECKS = 0")
        for table in APP_TABLES:
            cur.execute(f"TRUNCATE TABLE {table}")
        cur.execute("SET FOREIGN_KEY_CHECKS = 1")
        cur.executemany(
            "INSERT INTO django_semaphore_semaphore"
            " (name, capacity, in_use_counter, released_folded, fencing_counter, fair, family,"
            " own_capacity, created_at, updated_at) VALUES"
            " (%s, %s, 0, 0, 0, FALSE, '', FALSE, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))",
            sorted(semaphores.items()),
        )
        cur.execute(
            "INSERT INTO django_semaphore_releasecounter (semaphore_id, released)"
            " SELECT id, 0 FROM django_semaphore_semaphore"
        )


def status(url: str, name: str) -> int:
    with cursor(url) as cur:
        cur.execute("SHOW GLOBAL STATUS LIKE %s", [name])
        row = cur.fetchone()
    return int(row[1]) if row else 0


def env_for(url: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "FAULTS_DATABASE_URL": url,
        "DJANGO_SETTINGS_MODULE": "benchmarks.faults.settings",
        **extra,
    }
