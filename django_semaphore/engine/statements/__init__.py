"""The engine's SQL text (grant, release, tickets), built once per connection.

Building and compiling a queryset costs far more CPU than the database
spends on these statements (measured on MariaDB: ~0.5 ms against ~0.04 ms a
statement), and the grant runs them while it holds the semaphore rows'
locks, so every waiter pays for that time too. The locking read is still the
manager's ``locked()`` query, compiled once per number of names; the others
are short, fixed SQL on the models' own table and column names.

Nothing here decides anything: ``grant.py`` and ``releasing.py`` say which
statement runs when. This module has the grant's (and the verifier's);
``release.py`` has release's, ``tickets.py`` the line's, ``probes.py``
the waiters' probe; ``rows.py`` what the grant's reads return;
``one_trip.py`` calls the grant as one routine, whose text
``grant_routine.py`` renders from these.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

from django.conf import settings
from django.db import transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.db.models import (
    BooleanField,
    DateTimeField,
    DurationField,
    ExpressionWrapper,
    OuterRef,
    Q,
    Subquery,
    Value,
)
from django.db.models.expressions import CombinedExpression
from django.db.models.sql import Query

from django_semaphore import backends
from django_semaphore.backends import DatabaseNow, StatementNow
from django_semaphore.engine.statements.rows import LOCKED_COLUMNS, LockedSemaphore, Usage
from django_semaphore.models import Permit, PermitRequest, ReleaseCounter, Semaphore
from django_semaphore.states import State

# The version of the routines this code calls (``routines.py``): part of
# their names, so that code of another version finds its own beside them.
ROUTINES_VERSION = 2
# How stale a grant lets a semaphore's updated_at get: it marks a family
# member as used for the idle clean-up, and written by every grant it would
# change an indexed column each time (no HOT update on PostgreSQL, a
# secondary index entry rewritten on InnoDB, on the hottest row there is).
MARKED_EVERY = timedelta(minutes=1)
# The models whose manager has the app's row lock (``locked()``).
Lockable = type[Semaphore | ReleaseCounter]


def routine(name: str) -> str:
    """The name of this code's version of the routine ``name``."""
    return f"{name}_v{ROUTINES_VERSION}"


class SQL:
    """What every statement builder starts from: the connection, its quoting,
    the tables and the database's clock, compiled once."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        self.connection = connection
        self.use_tz = settings.USE_TZ
        self.adapt = connection.ops.adapt_datetimefield_value  # a datetime as a parameter
        self.acquired, self.released = State.ACQUIRED.value, State.RELEASED.value
        self.q = q = connection.ops.quote_name
        self.semaphore, self.request, self.permit, self.counter = (
            q(m._meta.db_table) for m in (Semaphore, PermitRequest, Permit, ReleaseCounter)
        )
        self.compiler = Query(PermitRequest).get_compiler(connection=connection)
        self.now, _ = self.compiler.compile(DatabaseNow())
        # A key's request: (id, state, key as stored).
        self.key_sql = (
            f"SELECT {q('id')}, {q('state')}, {q('external_id')} FROM {self.request}"
            f" WHERE {q('external_id')} = %s"
        )

    def bounded(self, sql: str, lock_wait: float) -> str:
        return backends.bound_statement(self.connection, sql, lock_wait)

    def locking_read(
        self, model: Lockable, field: str, values: list[Any], *columns: str, **annotations: Any
    ) -> str:
        """The manager's row lock (``locked()``: semaphores in name order,
        release counters in semaphore id order) of the rows whose ``field``
        is one of ``values``, as SQL text: the statements that run it raw
        (compiled once, reused with as many other values) keep the app's
        lock orders."""
        queryset = (
            model._default_manager.using(self.connection.alias)
            .filter(**{f"{field}__in": values})
            .locked()
            .annotate(**annotations)
            .values_list(*columns)
        )
        # Django compiles a locking read only inside a transaction; a statement
        # built for autocommit (PostgreSQL's one-statement release) is not in
        # one. Nothing runs in it: it only lets the compiler through.
        with transaction.atomic(using=self.connection.alias, savepoint=False):
            sql, params = queryset.query.get_compiler(connection=self.connection).as_sql()
        # Reused with other values: these must be its only parameters.
        if list(params) != values:  # pragma: no cover - a Django change would show here
            raise AssertionError(f"Unexpected parameters in the locking read: {params!r}")
        return str(sql)

    @staticmethod
    def replaced_once(sql: str, old: str, new: str) -> str:
        """``sql`` (as Django compiled it) with ``old``, found there exactly
        once, made ``new``."""
        if sql.count(old) != 1:  # pragma: no cover - a Django change would show here
            raise AssertionError(f"Unexpected SQL, {old!r} not once in: {sql!r}")
        return sql.replace(old, new)


class Statements(SQL):
    """The grant's statements (and the verifier's), for one connection."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        super().__init__(connection)
        q, compiler, now = self.q, self.compiler, self.now
        semaphore, request, permit = self.semaphore, self.request, self.permit
        self.locks: dict[int, str] = {}
        self.total_with_the_lock = connection.vendor != "postgresql"
        self.returning = connection.features.can_return_columns_from_insert
        # The request's insert reads the clock once: when it starts, every row
        # it depends on is locked already.
        self.stamp, _ = compiler.compile(StatementNow())
        self.duration = DurationField()
        expiry = CombinedExpression(
            StatementNow(), "+", Value(timedelta(), self.duration), output_field=DateTimeField()
        )
        self.expires_sql, params = compiler.compile(expiry.resolve_expression(compiler.query))
        if len(params) != 1:  # pragma: no cover - a Django change would show here
            raise AssertionError(f"Unexpected parameters in the expiry: {params!r}")
        # Whether an expired request still holds one of the semaphores ``{ids}``
        # at ``{now}``: only then is a reclaim worth its statements.
        self.expired_sql = (
            f"EXISTS(SELECT 1 FROM {request} r JOIN {permit} p"
            f" ON p.{q('request_id')} = r.{q('id')}"
            f" WHERE r.{q('state')} = '{self.acquired}' AND r.{q('expires_at')} <= {{now}}"
            f" AND p.{q('semaphore_id')} IN ({{ids}}) AND p.{q('state')} = '{self.acquired}')"
        )
        expired_sql = self.expired_sql.format(ids="{ids}", now=now)
        # Read once the semaphore rows are locked, and only when one lacks
        # room. The clock is read here, not in the locking read, which may
        # compute it before its wait for the lock (PostgreSQL does).
        self.usage_sql = (
            f"SELECT {now}, (SELECT {q('id')} FROM {request} WHERE {q('external_id')} = %s),"
            f" {expired_sql}"
        )
        self.released_sql = (
            f"SELECT {q('semaphore_id')}, {q('released')} FROM {self.counter}"
            f" WHERE {q('semaphore_id')} IN ({{ids}})"
        )
        # The routines run these three writes too (``grant_routine.py``).
        self.insert_request_sql = (
            f"INSERT INTO {request} ({q('external_id')}, {q('owner')}, {q('state')},"
            f" {q('ttl')}, {q('expires_at')}, {q('created_at')}, {q('updated_at')},"
            f" {q('released_at')}, {q('release_reason')})"
            " VALUES (%s, %s, %s, %s, {expires}, {now}, {now}, NULL, '')"
        )
        self.returning_sql = f" RETURNING {q('id')}, {q('created_at')}, {q('expires_at')}"
        self.stamps_sql = (
            f"SELECT {q('created_at')}, {q('expires_at')} FROM {request} WHERE {q('id')} = %s"
        )
        # One statement per grant for the engine-owned counters, written as
        # values: the row is locked, and only grants (and the verifier, under
        # the same lock) write them. The fencing write is also what keeps a
        # multi-primary (Galera) cluster from over-granting: row locks are
        # node-local there, but two grants that both write these rows
        # conflict at certification. ``updated_at``: at most once a
        # ``MARKED_EVERY`` (its parameters: that long ago, then now).
        self.grant_sql = (
            f"UPDATE {semaphore} SET {q('fencing_counter')} = {q('fencing_counter')} + 1,"
            f" {q('in_use_counter')} = {{counted}}, {q('released_folded')} = {{folded}},"
            f" {q('slots_open')} = {q('slots_open')} + {{slots}},"
            f" {q('updated_at')} = CASE WHEN {q('updated_at')} < %s THEN %s"
            f" ELSE {q('updated_at')} END WHERE {q('id')} IN ({{ids}})"
        )
        # A rate limit's slots that ended since it last closed them: a range
        # of the (semaphore, slot_ends) index, never the slots of past windows.
        ended = (
            f"SELECT COALESCE(SUM({q('count')}), 0) FROM {permit}"
            f" WHERE {q('semaphore_id')} = %s AND {q('slot_ends')} <= %s"
        )
        self.ended_sql = {True: ended, False: ended + f" AND {q('slot_ends')} > %s"}
        self.close_slots_sql = (
            f"UPDATE {semaphore} SET {q('slots_open')} = {q('slots_open')} - %s,"
            f" {q('slots_closed_until')} = %s WHERE {q('id')} = %s"
        )
        # The slots that end first, for saying when the next one frees.
        self.next_slots_sql = (
            f"SELECT {q('slot_ends')}, {q('count')} FROM {permit}"
            f" WHERE {q('semaphore_id')} = %s AND {q('slot_ends')} > %s"
            f" ORDER BY {q('slot_ends')} LIMIT %s"
        )
        self.case_sql = f"WHEN {q('id')} = %s THEN %s"
        self.insert_permits_sql = (
            f"INSERT INTO {permit} ({q('semaphore_id')}, {q('request_id')}, {q('count')},"
            f" {q('fencing_token')}, {q('slot_ends')}, {q('state')}) {{rows}}"
        )
        self.set_counted_sql = (
            f"UPDATE {semaphore} SET {q('in_use_counter')} = %s, {q('released_folded')} = %s"
            f" WHERE {q('id')} = %s"
        )

    # Outside any transaction.

    def key_exists(self, key: str) -> bool:
        """Whether a request has this key, or one the collation calls equal
        (``grant.find_request`` tells those apart)."""
        with self.connection.cursor() as cursor:
            cursor.execute(self.key_sql, [key])
            return cursor.fetchone() is not None

    # Inside a transaction.

    def lock(
        self, cursor: CursorWrapper, names: Sequence[str], lock_wait: float
    ) -> list[LockedSemaphore]:
        """Lock the semaphore rows in name order."""
        cursor.execute(self.bounded(self.lock_sql(len(names)), lock_wait), list(names))
        locked = [LockedSemaphore(*row) for row in cursor.fetchall()]
        for s in locked:
            # A row created while this read waited for it (a family member)
            # may have its release counter read from before (MariaDB's
            # snapshot): NULL, nothing counted until ``read_released``.
            s.released = s.released or 0
            s.slots_closed_until = backends.datetime_from_db(self.connection, s.slots_closed_until)
        return locked

    def lock_sql(self, count: int) -> str:
        """The locking read of ``count`` names, compiled once."""
        if count not in self.locks:
            released = self._released_with_the_lock()
            self.locks[count] = self.locking_read(
                Semaphore,
                "name",
                [f"name-{i}" for i in range(count)],
                *LOCKED_COLUMNS,
                *released,
                # The clock may be read before the wait for the lock: a queue
                # then looks live a little longer, never shorter.
                queue_live=ExpressionWrapper(
                    Q(queued_until__gt=DatabaseNow()), output_field=BooleanField()
                ),
                **released,
            )
        return self.locks[count]

    def _released_with_the_lock(self) -> dict[str, Subquery]:
        """The release total, read by the locking read where that is safe.

        MariaDB reads a subquery of the select list once the row lock is
        granted, without locking its rows (measured: a release committed
        during the wait is seen). PostgreSQL reads it as of the statement's
        start, before the wait for the lock, so under contention, when it
        matters, it would miss the releases of the wait: there the total
        counts as nothing until ``read_released`` reads it.
        """
        if not self.total_with_the_lock:
            return {}
        counter = ReleaseCounter.objects.filter(semaphore=OuterRef("pk"))
        return {"released": Subquery(counter.values("released"))}

    def fresh_with_the_lock(self, locked: Sequence[LockedSemaphore]) -> bool:
        """Whether the release totals the locking read returned are as fresh
        as a second read would be: one row, whose total was read once its
        lock was granted, with no wait after it (see above)."""
        return len(locked) == 1 and self.total_with_the_lock

    def usage(self, cursor: CursorWrapper, key: str, semaphore_ids: list[int]) -> Usage:
        """The clock, whether ``key`` is taken, and whether expired permits
        hold any of the semaphores: one round trip."""
        cursor.execute(
            self.usage_sql.format(ids=placeholders(len(semaphore_ids))), [key, *semaphore_ids]
        )
        now, key_id, expired = cursor.fetchone()
        return Usage(
            now=backends.datetime_from_db(self.connection, now),
            key_taken=key_id is not None,
            expired=bool(expired),
        )

    def read_released(self, cursor: CursorWrapper, locked: Sequence[LockedSemaphore]) -> None:
        """Read the release counters of rows this transaction holds locked
        again, now: their ``in_use`` is exact (and the grant folds it in)."""
        cursor.execute(
            self.released_sql.format(ids=placeholders(len(locked))), [s.id for s in locked]
        )
        released = {int(id): int(n) for id, n in cursor.fetchall()}
        for s in locked:
            s.released = max(released[s.id], s.released)

    def insert_request(
        self, cursor: CursorWrapper, key: str, owner: str, ttl: int | None, lock_wait: float
    ) -> tuple[int, datetime, datetime | None]:
        """Insert the request: (id, the clock it was stamped with, its expiry).

        A taken key fails with IntegrityError; a concurrent first call with
        the same key waits here on the unique index until the other commits.
        """
        expires, params = "NULL", [key, owner, self.acquired, ttl]
        if ttl is not None:
            expires = self.expires_sql
            params.append(self.duration.get_db_prep_value(timedelta(seconds=ttl), self.connection))
        sql = self.insert_request_sql.format(expires=expires, now=self.stamp)
        if self.returning:
            sql += self.returning_sql
        cursor.execute(self.bounded(sql, lock_wait), params)
        if self.returning:
            request_id, now, expires_at = cursor.fetchone()
        else:
            request_id = cursor.lastrowid
            cursor.execute(self.stamps_sql, [request_id])
            now, expires_at = cursor.fetchone()
        stamp = functools.partial(backends.datetime_from_db, self.connection)
        return int(request_id), stamp(now), stamp(expires_at)

    def count_grant(
        self,
        cursor: CursorWrapper,
        locked: Sequence[LockedSemaphore],
        added: dict[int, int],
        now: datetime,
    ) -> None:
        """Advance the fencing counters and count ``added`` (semaphore id ->
        count) on rows this transaction holds locked, folding in the
        releases read (``read_released``)."""
        # Never below zero: a counter written behind the engine's back must
        # not make a grant fail (the verifier reports and corrects it).
        counted = {s.id: s.held + added[s.id] for s in locked}
        folded = {s.id: s.folded for s in locked}
        # A rate limit's slots: what it grants counts until its window ends,
        # released or not (the release counter counts its holders).
        slots = {s.id: added[s.id] if s.limit.is_rate else 0 for s in locked}
        case = self.case_placeholders(len(locked))
        # No lock wait to bound: the rows are this transaction's already.
        cursor.execute(
            self.grant_sql.format(
                counted=case, folded=case, slots=case, ids=placeholders(len(locked))
            ),
            [
                *(value for values in (counted, folded, slots) for value in _case_params(values)),
                self.adapt(now - MARKED_EVERY),
                self.adapt(now),
                *counted,
            ],
        )

    def insert_permits(
        self, cursor: CursorWrapper, rows: list[tuple[int, int, int, int, datetime | None]]
    ) -> None:
        """``rows``: (semaphore id, request id, count, fencing token, end of
        its slot on a rate limit) each."""
        # No lock wait to bound: the rows its keys refer to (the request, the
        # semaphores) are this transaction's, and no other can insert a token
        # of these semaphores while it holds them.
        values = "VALUES " + ", ".join(["(%s, %s, %s, %s, %s, %s)"] * len(rows))
        cursor.execute(
            self.insert_permits_sql.format(rows=values),
            [value for *row, ends in rows for value in (*row, self.adapt(ends), self.acquired)],
        )

    def close_slots(self, cursor: CursorWrapper, s: LockedSemaphore, now: datetime) -> None:
        """Stop counting the slots of the rate limit ``s`` (its row locked by
        this transaction) that ended by ``now``: those since it last closed
        them."""
        closed = s.slots_closed_until
        cursor.execute(
            self.ended_sql[closed is None],
            [s.id, self.adapt(now)] + ([] if closed is None else [self.adapt(closed)]),
        )
        (ended,) = cursor.fetchone()
        cursor.execute(self.close_slots_sql, [int(ended), self.adapt(now), s.id])
        s.slots_open -= int(ended)
        s.slots_closed_until = now

    def next_slot(
        self, cursor: CursorWrapper, s: LockedSemaphore, wanted: int, now: datetime
    ) -> datetime | None:
        """When enough of the open slots of the rate limit ``s`` will have
        ended for ``wanted`` more permits (``None``: the slots do not add
        up, a counter written behind the engine's back)."""
        needed = s.in_use + wanted - s.capacity
        cursor.execute(self.next_slots_sql, [s.id, self.adapt(now), needed])
        for ends, count in cursor.fetchall():
            needed -= int(count)
            if needed <= 0:
                at: datetime = backends.datetime_from_db(self.connection, ends)
                return at
        return None

    def case_placeholders(self, count: int) -> str:
        """A value per row by its id, for ``count`` rows (``_case_params``):
        one placeholder, or a CASE on the id."""
        if count == 1:
            return "%s"
        return "CASE " + " ".join([self.case_sql] * count) + " END"

    def set_counted(self, cursor: CursorWrapper, values: dict[int, tuple[int, int]]) -> None:
        """Set (``in_use_counter``, ``released_folded``) by semaphore id on
        rows this transaction holds locked, their release counters too: the
        verifier's correction."""
        for id, (counted, folded) in values.items():
            cursor.execute(self.set_counted_sql, [counted, folded, id])


def placeholders(count: int) -> str:
    """``%s, %s, ...``: one placeholder per value of an IN list or VALUES row."""
    return ", ".join(["%s"] * count)


def with_arguments(sql: str, *arguments: str) -> str:
    """``sql`` as a routine's statement: its placeholders replaced, in order,
    by the routine's arguments (or literals) -- all of them."""
    for argument in arguments:
        sql = sql.replace("%s", argument, 1)
    if "%s" in sql:  # pragma: no cover - a Django change would show here
        raise AssertionError(f"Parameters left in a routine: {sql!r}")
    return sql


def _case_params(values: dict[int, int]) -> list[int]:
    """The parameters of ``Statements.case_placeholders`` for these values by id."""
    if len(values) == 1:
        return list(values.values())
    return [value for item in values.items() for value in item]


_by_connection: WeakKeyDictionary[BaseDatabaseWrapper, dict[type[SQL], SQL]] = WeakKeyDictionary()
Built = TypeVar("Built", bound=SQL)


def built(kind: type[Built], connection: BaseDatabaseWrapper) -> Built:
    """This connection's statements of ``kind`` (each thread has its own
    connection), built again if ``USE_TZ`` changed (tests override it)."""
    kinds = _by_connection.setdefault(connection, {})
    found = kinds.get(kind)
    if found is None or found.use_tz != settings.USE_TZ:
        found = kinds[kind] = kind(connection)
    return found  # type: ignore[return-value]


def statements(connection: BaseDatabaseWrapper) -> Statements:
    """This connection's grant statements."""
    return built(Statements, connection)
