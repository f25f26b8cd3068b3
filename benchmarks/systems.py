"""What one benchmark client does per cycle, for each system measured.

A client connects before the clock starts, then loops: ``acquire()`` (timed;
``False`` means "no room", a rejection), ``release()``. Every system runs the
same loop, so the figures compare like with like.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from benchmarks import db, roundtrips

# Systems by what they are; the table shows them in this order.
LIMIT_HOT = "limit: 1 hot row"
LIMIT_ROWS = "limit: row per client"
SEED = "seed design (raw SQL)"
APP = "app acquire/release"
APP_PERMIT = "app permit()"
APP_SQL = "app's SQL alone"
APP_NO_PRELOCK = "app, pre-lock off"
DB_MUTEX = "django-db-mutex"
GET_LOCK = "GET_LOCK (not durable)"
REDIS = "redis-py Lock (not durable)"
SYSTEMS = [
    LIMIT_HOT,
    LIMIT_ROWS,
    SEED,
    APP,
    APP_PERMIT,
    APP_SQL,
    APP_NO_PRELOCK,
    DB_MUTEX,
    GET_LOCK,
    REDIS,
]
APP_SYSTEMS = {APP, APP_PERMIT, APP_SQL, APP_NO_PRELOCK}


@dataclass
class ClientSpec:
    """One client of one cell."""

    system: str
    url: str
    index: int  # global client number: the row of LIMIT_ROWS
    names: list[str] = field(default_factory=list)  # semaphores, sorted
    hold: float = 0.0  # seconds between acquire and release
    timeout: float = 0.0  # acquire's timeout= (app only)
    redis_url: str = ""


class Client:
    def __init__(self, spec: ClientSpec) -> None:
        self.spec = spec
        self.target = db.Target.parse(spec.url)

    def setup(self) -> None:
        """Connect; runs before the clock starts."""

    def acquire(self) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        """Give back what acquire took."""

    def close(self) -> None:
        """Disconnect."""


class RawClient(Client):
    """A DB-API connection with autocommit off: the first statement opens the
    transaction, so a transaction costs no BEGIN round trip (except SQLite's
    BEGIN IMMEDIATE, which is local)."""

    conn: Any

    def setup(self) -> None:
        self.conn = db.connect(self.target)
        self.cursor = self.conn.cursor()

    def execute(self, statement: str, params: Any = ()) -> Any:
        if self.target.vendor == "sqlite":  # the server drivers count their own
            roundtrips.sent(statement)
        self.cursor.execute(db.sql(self.target, statement), params)
        return self.cursor

    def begin(self) -> None:
        if self.target.vendor == "sqlite":
            self.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        if self.target.vendor == "sqlite":
            self.execute("COMMIT")
        else:
            self.conn.commit()

    def rollback(self) -> None:
        if self.target.vendor == "sqlite":
            self.execute("ROLLBACK")
        else:
            self.conn.rollback()

    def close(self) -> None:
        self.conn.close()


class RawLimit(RawClient):
    """``UPDATE`` one row, ``COMMIT``: the serial limit of a row lock + commit."""

    def acquire(self) -> bool:
        row = 1 if self.spec.system == LIMIT_HOT else self.spec.index + 1
        self.begin()
        self.execute("UPDATE bench_counter SET n = n + 1 WHERE id = %s", [row])
        self.commit()
        return True


class Seed(RawClient):
    """The seed design by hand: lock each semaphore row (sorted), SUM its
    acquired permits, INSERT the request and its permits, COMMIT; release is
    two UPDATEs."""

    request_id: int

    def setup(self) -> None:
        super().setup()
        # SQLite has no row locks: BEGIN IMMEDIATE takes the database's write lock.
        self.lock = "" if self.target.vendor == "sqlite" else " FOR UPDATE"

    def acquire(self) -> bool:
        self.begin()
        locked = []
        for name in self.spec.names:
            locked.append(
                self.execute(
                    "SELECT id, capacity FROM seed_semaphore WHERE name = %s" + self.lock, [name]
                ).fetchone()
            )
        for semaphore_id, capacity in locked:
            used = self.execute(
                "SELECT SUM(count) FROM seed_permit WHERE semaphore_id = %s AND state = 'ACQUIRED'",
                [semaphore_id],
            ).fetchone()[0]
            if (used or 0) + 1 > capacity:
                self.rollback()
                return False
        insert = (
            "INSERT INTO seed_permit_request (external_id, owner, state) "
            "VALUES (%s, 'bench', 'ACQUIRED')"
        )
        key = uuid.uuid4().hex
        if self.target.vendor == "postgresql":
            self.request_id = self.execute(insert + " RETURNING id", [key]).fetchone()[0]
        else:
            self.request_id = self.execute(insert, [key]).lastrowid
        values = ", ".join(["(%s, %s, 1, 'ACQUIRED')"] * len(locked))
        params = [value for sem, _ in locked for value in (sem, self.request_id)]
        self.execute(
            "INSERT INTO seed_permit (semaphore_id, permit_request_id, count, state) VALUES "
            + values,
            params,
        )
        self.commit()
        return True

    def release(self) -> None:
        if self.spec.hold:
            time.sleep(self.spec.hold)
        # Two idempotent UPDATEs, committed together (the cheapest correct way).
        self.begin()
        self.execute(
            "UPDATE seed_permit SET state = 'RELEASED' "
            "WHERE permit_request_id = %s AND state != 'RELEASED'",
            [self.request_id],
        )
        self.execute(
            "UPDATE seed_permit_request SET state = 'RELEASED' WHERE id = %s", [self.request_id]
        )
        self.commit()


class GetLock(RawClient):
    """MySQL ``GET_LOCK`` / PostgreSQL advisory lock: a mutex held by the
    connection, gone with it. Not durable; for reference."""

    def setup(self) -> None:
        self.conn = db.connect(self.target, autocommit=True)
        self.cursor = self.conn.cursor()
        self.name = self.spec.names[0]

    def acquire(self) -> bool:
        if self.target.vendor == "mysql":
            return bool(self.execute("SELECT GET_LOCK(%s, 0)", [self.name]).fetchone()[0])
        return bool(
            self.execute("SELECT pg_try_advisory_lock(hashtext(%s))", [self.name]).fetchone()[0]
        )

    def release(self) -> None:
        if self.target.vendor == "mysql":
            self.execute("SELECT RELEASE_LOCK(%s)", [self.name])
        else:
            self.execute("SELECT pg_advisory_unlock(hashtext(%s))", [self.name])


class RedisLock(Client):
    """redis-py's ``Lock`` (SET NX PX; release by a Lua script). Not durable."""

    def setup(self) -> None:
        import redis

        self.redis = redis.Redis.from_url(self.spec.redis_url)
        self.redis.ping()
        self.lock = self.redis.lock(f"bench:{self.spec.names[0]}", timeout=30)

    def acquire(self) -> bool:
        return bool(self.lock.acquire(blocking=False))

    def release(self) -> None:
        self.lock.release()

    def close(self) -> None:
        self.redis.close()


class DjangoClient(Client):
    """Runs in a thread of a process that has Django set up."""

    def setup(self) -> None:
        from django.db import connection

        connection.ensure_connection()

    def close(self) -> None:
        from django.db import connections

        connections.close_all()


class App(DjangoClient):
    """This app through its public API: ``acquire()`` then ``release()``."""

    def setup(self) -> None:
        super().setup()
        from django_semaphore import acquire, release
        from django_semaphore.exceptions import SemaphoreExhausted

        self._acquire, self._release, self.exhausted = acquire, release, SemaphoreExhausted
        self.demand = dict.fromkeys(self.spec.names, 1)

    def acquire(self) -> bool:
        self.key = uuid.uuid4().hex
        try:
            self._acquire(
                self.demand,
                external_id=self.key,
                owner="bench",
                timeout=self.spec.timeout,
            )
        except self.exhausted:
            return False
        return True

    def release(self) -> None:
        if self.spec.hold:
            time.sleep(self.spec.hold)
        self._release(self.key)


class AppPermit(App):
    """This app's ``permit()`` context manager, entered and left."""

    def setup(self) -> None:
        super().setup()
        from django_semaphore import permit  # type: ignore[attr-defined]

        self.permit = permit

    def acquire(self) -> bool:
        self.block = self.permit(self.demand, owner="bench", timeout=self.spec.timeout)
        try:
            self.block.__enter__()
        except self.exhausted:
            return False
        return True

    def release(self) -> None:
        if self.spec.hold:
            time.sleep(self.spec.hold)
        self.block.__exit__(None, None, None)


class AppSQL(DjangoClient):
    """The app's two statements alone, through Django's cursor: its grant in
    one trip and its release by key, without the public API's Python around
    them (validation, routing, retries, signals, wake-ups). The limit the
    app's SQL sets; MariaDB and PostgreSQL, where the routines are."""

    def setup(self) -> None:
        super().setup()
        from django.db import DEFAULT_DB_ALIAS, connections

        from django_semaphore.conf import app_settings
        from django_semaphore.engine.statements.one_trip import (
            Line,
            Refused,
            one_trip_statements,
        )
        from django_semaphore.engine.statements.release import ReadBack, release_statements
        from django_semaphore.states import ReleaseReason

        connection = connections[DEFAULT_DB_ALIAS]
        self.grant = one_trip_statements(connection).grant
        self.release_by_key = release_statements(connection).release_by_key
        self.demand = dict.fromkeys(self.spec.names, 1)
        self.fails_fast = Line(ticketed=False, lacked=False, ticket_life=None, priority=0)
        self.refused, self.reason, self.read = Refused, ReleaseReason.RELEASED, ReadBack.PARKED
        self.lock_wait = app_settings.LOCK_WAIT_TIMEOUT

    def acquire(self) -> bool:
        self.key = uuid.uuid4().hex
        granted = self.grant(self.demand, self.key, "bench", None, self.lock_wait, self.fails_fast)
        if granted is None:
            raise RuntimeError("the one-trip grant declined: the general grant is needed")
        return not isinstance(granted, self.refused)

    def release(self) -> None:
        if self.spec.hold:
            time.sleep(self.spec.hold)
        self.release_by_key(self.key, self.reason, self.lock_wait, self.read)


class DbMutex(DjangoClient):
    """django-db-mutex: a mutex as a row inserted under a unique key."""

    def setup(self) -> None:
        super().setup()
        from db_mutex.db_mutex import db_mutex
        from db_mutex.exceptions import DBMutexError

        self.mutex, self.taken = db_mutex(self.spec.names[0]), DBMutexError

    def acquire(self) -> bool:
        try:
            self.mutex.start()
        except self.taken:
            return False
        return True

    def release(self) -> None:
        self.mutex.stop()


CLIENTS: dict[str, type[Client]] = {
    LIMIT_HOT: RawLimit,
    LIMIT_ROWS: RawLimit,
    SEED: Seed,
    APP: App,
    APP_PERMIT: AppPermit,
    APP_SQL: AppSQL,
    APP_NO_PRELOCK: App,
    DB_MUTEX: DbMutex,
    GET_LOCK: GetLock,
    REDIS: RedisLock,
}


def make_client(spec: ClientSpec) -> Client:
    return CLIENTS[spec.system](spec)
