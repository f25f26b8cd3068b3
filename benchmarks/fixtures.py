"""Tables and data: the seed design's schema, the limit's counter rows, and
the app's semaphores with held permits or a long released history.

Runs in the driver (Django set up). Bulk data goes in with INSERT ... SELECT
from a generated range, in chunks, so a million rows take seconds, not hours.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from benchmarks import db

CHUNK = 100_000
COUNTER_ROWS = 256
APP_TABLES = [
    "django_semaphore_permit",
    "django_semaphore_permitrequest",
    "django_semaphore_capacitychange",
    "django_semaphore_fencingmark",
    "django_semaphore_releasecounter",
    "django_semaphore_semaphore",
]
SEED_TABLES = ["seed_permit", "seed_permit_request", "seed_semaphore"]

# The seed's schema, verbatim (MySQL), with its (semaphore_id, state) index.
SEED_SCHEMA_MYSQL = [
    """CREATE TABLE IF NOT EXISTS seed_semaphore (
        id BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY,
        name VARCHAR(255) NOT NULL UNIQUE,
        capacity INT NOT NULL,
        created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
        updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP
    ) ENGINE=InnoDB""",
    """CREATE TABLE IF NOT EXISTS seed_permit_request (
        id BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY,
        external_id VARCHAR(255) NOT NULL UNIQUE,
        owner VARCHAR(255),
        state ENUM('ACQUIRED', 'RELEASED') NOT NULL,
        ttl_seconds INT,
        created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
        updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP
    ) ENGINE=InnoDB""",
    """CREATE TABLE IF NOT EXISTS seed_permit (
        id BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY,
        semaphore_id BIGINT UNSIGNED NOT NULL REFERENCES seed_semaphore(id),
        permit_request_id BIGINT UNSIGNED NOT NULL REFERENCES seed_permit_request(id),
        count INT NOT NULL DEFAULT 1,
        state ENUM('ACQUIRED', 'RELEASED') NOT NULL,
        INDEX idx_semaphore_state (semaphore_id, state),
        INDEX idx_request (permit_request_id)
    ) ENGINE=InnoDB""",
    "CREATE TABLE IF NOT EXISTS bench_counter (id INT PRIMARY KEY, n BIGINT NOT NULL)",
]
# The same for PostgreSQL and SQLite (ENUM becomes a checked VARCHAR).
SEED_SCHEMA_OTHER = [
    """CREATE TABLE IF NOT EXISTS seed_semaphore (
        id {serial} PRIMARY KEY,
        name VARCHAR(255) NOT NULL UNIQUE,
        capacity INT NOT NULL,
        created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
        updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
    )""",
    """CREATE TABLE IF NOT EXISTS seed_permit_request (
        id {serial} PRIMARY KEY,
        external_id VARCHAR(255) NOT NULL UNIQUE,
        owner VARCHAR(255),
        state VARCHAR(8) NOT NULL CHECK (state IN ('ACQUIRED', 'RELEASED')),
        ttl_seconds INT,
        created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
        updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
    )""",
    """CREATE TABLE IF NOT EXISTS seed_permit (
        id {serial} PRIMARY KEY,
        semaphore_id BIGINT NOT NULL REFERENCES seed_semaphore(id),
        permit_request_id BIGINT NOT NULL REFERENCES seed_permit_request(id),
        count INT NOT NULL DEFAULT 1,
        state VARCHAR(8) NOT NULL CHECK (state IN ('ACQUIRED', 'RELEASED'))
    )""",
    "CREATE INDEX IF NOT EXISTS idx_semaphore_state ON seed_permit (semaphore_id, state)",
    "CREATE INDEX IF NOT EXISTS idx_request ON seed_permit (permit_request_id)",
    "CREATE TABLE IF NOT EXISTS bench_counter (id INT PRIMARY KEY, n BIGINT NOT NULL)",
]


class Data:
    """The driver's own connection (autocommit) for schema and bulk data."""

    def __init__(self, target: db.Target) -> None:
        self.target = target
        self.conn = db.connect(target, autocommit=True)
        self.mariadb = db.is_mariadb(target)

    def execute(self, statement: str, params: Any = ()) -> Any:
        cursor = self.conn.cursor()
        cursor.execute(db.sql(self.target, statement), params)
        return cursor

    def scalar(self, statement: str, params: Any = ()) -> Any:
        return self.execute(statement, params).fetchone()[0]

    def create_schema(self) -> None:
        """Django's migrations for the app (and django-db-mutex), then ours."""
        from django.core.management import call_command

        call_command("migrate", verbosity=0, interactive=False)
        if self.target.vendor == "mysql":
            statements = SEED_SCHEMA_MYSQL
        else:
            serial = "BIGSERIAL" if self.target.vendor == "postgresql" else "INTEGER"
            statements = [s.format(serial=serial) for s in SEED_SCHEMA_OTHER]
        for statement in statements:
            self.execute(statement)

    def tables(self) -> list[str]:
        from django.db import connection

        present = set(connection.introspection.table_names())
        return [t for t in [*APP_TABLES, *SEED_TABLES, "db_mutex_dbmutex"] if t in present]

    def reset(self) -> None:
        """Empty every table the benchmark writes, and reset the counter rows."""
        tables = self.tables()
        if self.target.vendor == "mysql":
            self.execute("SET FOREIGN_KEY_CHECKS = 0")
            for table in tables:
                self.execute(f"TRUNCATE TABLE {table}")
            self.execute("SET FOREIGN_KEY_CHECKS = 1")
        elif self.target.vendor == "postgresql":
            self.execute(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE")
        else:
            for table in tables:
                self.execute(f"DELETE FROM {table}")
        self.execute("DELETE FROM bench_counter")
        self.execute(
            f"INSERT INTO bench_counter (id, n) SELECT n, 0 FROM "
            f"{db.numbers(self.target, 1, COUNTER_ROWS)}"
        )

    def create_semaphores(self, names: list[str], capacity: int) -> None:
        """The same semaphores in the app's tables and in the seed's."""
        from django_semaphore.models import Semaphore

        Semaphore.objects.bulk_create(Semaphore(name=n, capacity=capacity) for n in names)
        for name in names:
            self.execute(
                "INSERT INTO seed_semaphore (name, capacity) VALUES (%s, %s)", [name, capacity]
            )

    def add_permits(self, name: str, count: int, *, held: bool, prefix: str) -> None:
        """``count`` one-permit requests on ``name``, in the app's and the seed's
        tables: held (ACQUIRED) or history (RELEASED a month ago, so the
        retention clean-up deletes them)."""
        state = "ACQUIRED" if held else "RELEASED"
        stamp = datetime.now(UTC) - (timedelta(minutes=1) if held else timedelta(days=30))
        when = stamp if self.target.vendor == "postgresql" else stamp.replace(tzinfo=None)
        sem_id = self.scalar("SELECT id FROM django_semaphore_semaphore WHERE name = %s", [name])
        seed_id = self.scalar("SELECT id FROM seed_semaphore WHERE name = %s", [name])
        key = db.concat(self.target, f"'{prefix}-'", "n")
        for first in range(1, count + 1, CHUNK):
            nums = db.numbers(self.target, first, min(first + CHUNK - 1, count))
            self.execute(
                "INSERT INTO django_semaphore_permitrequest (external_id, owner, state, ttl,"
                " expires_at, created_at, updated_at, released_at, release_reason)"
                f" SELECT {key}, 'bench', %s, NULL, NULL, %s, %s, %s, %s FROM {nums}",
                [state, when, when, None if held else when, "" if held else "released"],
            )
            self.execute(
                "INSERT INTO seed_permit_request (external_id, owner, state)"
                f" SELECT {key}, 'bench', %s FROM {nums}",
                [state],
            )
        # Fencing tokens must be unique per semaphore: the request id is.
        like = f"{prefix}-%"
        self.execute(
            "INSERT INTO django_semaphore_permit (semaphore_id, request_id, count, state,"
            " fencing_token) SELECT %s, id, 1, %s, id FROM django_semaphore_permitrequest"
            " WHERE external_id LIKE %s",
            [sem_id, state, like],
        )
        self.execute(
            "UPDATE django_semaphore_semaphore SET fencing_counter = (SELECT MAX(fencing_token)"
            " FROM django_semaphore_permit WHERE semaphore_id = %s) WHERE id = %s",
            [sem_id, sem_id],
        )
        if held:
            # The app's exact counter, as its grants would have left it.
            self.execute(
                "UPDATE django_semaphore_semaphore SET in_use_counter = in_use_counter + %s"
                " WHERE id = %s",
                [count, sem_id],
            )
        self.execute(
            "INSERT INTO seed_permit (semaphore_id, permit_request_id, count, state)"
            " SELECT %s, id, 1, %s FROM seed_permit_request WHERE external_id LIKE %s",
            [seed_id, state, like],
        )
        if held:
            for table in ("django_semaphore_semaphore", "seed_semaphore"):
                self.execute(
                    f"UPDATE {table} SET capacity = capacity + %s WHERE name = %s", [count, name]
                )
        self.analyze()

    def analyze(self) -> None:
        """Fresh statistics, as a server would have some time after a bulk load."""
        if self.target.vendor == "mysql":
            for table in [*APP_TABLES, *SEED_TABLES]:
                self.execute(f"ANALYZE TABLE {table}").fetchall()
        elif self.target.vendor == "postgresql":
            self.execute("VACUUM ANALYZE")
        else:
            self.execute("ANALYZE")

    def plans(self, name: str) -> dict[str, str]:
        """How the database runs each design's room check on ``name`` now."""
        seed_id = self.scalar("SELECT id FROM seed_semaphore WHERE name = %s", [name])
        statements = {
            # The room check of the app's grant: the counter on the locked row.
            "app": (
                "SELECT in_use_counter FROM django_semaphore_semaphore WHERE name = %s",
                [name],
            ),
            "seed": (
                "SELECT SUM(count) FROM seed_permit WHERE semaphore_id = %s AND state = 'ACQUIRED'",
                [seed_id],
            ),
        }
        explain = {
            "mysql": "EXPLAIN ",
            "postgresql": "EXPLAIN ",
            "sqlite": "EXPLAIN QUERY PLAN ",
        }[self.target.vendor]
        plans = {}
        for design, (statement, params) in statements.items():
            rows = self.execute(explain + statement, params).fetchall()
            if self.target.vendor == "mysql":
                # id, select_type, table, type, possible_keys, key, key_len, ref, rows, Extra
                plans[design] = "; ".join(
                    f"key={r[5]} rows={r[8]} {r[9] or ''}".strip() for r in rows
                )
            else:
                plans[design] = "; ".join(str(r[-1]) for r in rows)
        return plans

    def held_now(self, name: str) -> int:
        """Permits held on ``name`` in the app's tables (after a run: should be
        what the fixture left there)."""
        return int(
            self.scalar(
                "SELECT COALESCE(SUM(p.count), 0) FROM django_semaphore_permit p"
                " JOIN django_semaphore_semaphore s ON s.id = p.semaphore_id"
                " WHERE s.name = %s AND p.state = 'ACQUIRED'",
                [name],
            )
        )

    def close(self) -> None:
        self.conn.close()
