"""The grant: one short transaction that gives permits on every named
semaphore, or on none.

1. Lock the semaphore rows with ``SELECT ... FOR UPDATE`` in name order, so
   two multi-semaphore requests never wait on each other in a circle. On
   PostgreSQL, wait first in the names' queue (``statements/queue.py``):
   the waiters of a row that a grant updates would all wake at its commit.
2. Check room on what the lock returned: ``in_use + count <= capacity``.
   ``in_use`` is the row's counter, raised by grants, less what releases
   counted on a row of their own (``ReleaseCounter``, so they never queue
   behind grants), read with the lock and again, fresh, only when there
   seems to be no room; the grant folds it into the row. The check is O(1)
   however many permits are held.
   On a rate limit (a semaphore with a window) what counts is its slots,
   ``slots_open``: every grant of the window, released or not.
3. Only if some semaphore lacks room: close the rate limits' slots that
   ended (one index range of ``Permit.slot_ends``, never past windows),
   reclaim expired permits holding the concurrency limits, and let the
   line say whether this call must wait behind older tickets. A refusal
   says when a rate limit's next slot frees.
4. Insert the request (its unique key settles repeated and concurrent first
   calls), raise the counters and advance the fencing counters in one
   update, insert the permits with their tokens (and the end of their slot
   on a rate limit, whose ended slots are also closed once a window).
   Commit.

From the lock to the commit every other caller of these semaphores waits, so
each step is one precompiled statement (``statements/``). On MariaDB and
PostgreSQL the common case -- room everywhere, nobody queued, no rate limit
-- is one call that runs these steps in the database (``grant_in_one_trip``,
``statements/one_trip.py``); everything else comes here.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime

from django.db import IntegrityError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from django_semaphore import backends, signals
from django_semaphore.backends import DatabaseNow
from django_semaphore.conf import declared_capacity
from django_semaphore.engine import fairness, families, prelock
from django_semaphore.engine.line import fits, lacking_room
from django_semaphore.engine.releasing import reclaim_expired, release_requests
from django_semaphore.engine.statements import Statements, queue, statements
from django_semaphore.engine.statements.one_trip import Line, Refused, one_trip_statements
from django_semaphore.engine.statements.rows import LockedSemaphore
from django_semaphore.exceptions import (
    CapacityExceeded,
    IdempotencyConflict,
    PermitAlreadyReleased,
    SemaphoreError,
    SemaphoreExhausted,
    SemaphoreNotFound,
)
from django_semaphore.models import PermitRequest
from django_semaphore.states import ReleaseReason, State
from django_semaphore.validation import Demand

# The columns of a request, in the order grant() has their values.
REQUEST_COLUMNS = [
    "id",
    "external_id",
    "owner",
    "state",
    "ttl",
    "expires_at",
    "created_at",
    "updated_at",
    "released_at",
    "release_reason",
]


def acquire_once(
    connection: BaseDatabaseWrapper,
    ask: fairness.Ask,
    standing: fairness.Standing,
    ttl: int | None,
    lock_wait: float,
    creations: int = 0,
) -> PermitRequest | fairness.Refusal:
    """One attempt at the grant; a repeated call is answered with its request.

    Returns a ``fairness.Refusal`` when there is no room (the caller may wait and
    call again with its standing). Raises any database error as it came (the
    caller retries). Missing names that a family matches are created
    (``families``), and the grant is attempted again.
    """
    demand, key = ask.demand, ask.key
    # No look-up of the key before the grant: the insert's unique index tells
    # whether the key is taken (or, when there is no room, the read that
    # says why).
    with prelock.prelocked(demand.names):
        try:
            outcome: PermitRequest | SemaphoreError | KeyTaken | fairness.Refusal | None = (
                grant_in_one_trip(connection, ask, standing, ttl, lock_wait)
            )
            if outcome is None:
                with _transaction(connection, demand.names, lock_wait):
                    outcome = grant(connection, ask, standing, ttl, lock_wait)
        except IntegrityError:
            # The key has a request already: a repeated call, or two first
            # calls at once where the other's insert won.
            existing = reattach_key(connection, key, demand)
            if existing is None:
                raise
            return existing
    if isinstance(outcome, fairness.Refusal):
        # Returned after the commit: a reclaim of expired permits done while
        # deciding, and the tickets taken, are kept.
        return outcome
    if isinstance(outcome, KeyTaken):
        existing = reattach_key(connection, key, demand)
        # None: deleted by the clean-up since; the key is free again.
        return existing or acquire_once(connection, ask, standing, ttl, lock_wait)
    if isinstance(outcome, (SemaphoreNotFound, CapacityExceeded)):
        # Decided before the key was read: a repeated call still answers with
        # its request.
        existing = reattach_key(connection, key, demand)
        if existing is not None:
            return existing
    if isinstance(outcome, SemaphoreNotFound) and creations < MAX_CREATIONS:
        # Only now, after the grant's transaction: the members are created in
        # a transaction of their own, and the next attempt locks them in the
        # usual sorted order. A name no family matches raises here.
        families.create_members(connection, outcome.names, lock_wait)
        return acquire_once(connection, ask, standing, ttl, lock_wait, creations=creations + 1)
    if isinstance(outcome, SemaphoreError):
        # Raised only after the commit, so that a reclaim of expired permits
        # done while deciding is kept.
        raise outcome
    return outcome


@contextmanager
def _transaction(
    connection: BaseDatabaseWrapper, names: Sequence[str], lock_wait: float
) -> Iterator[None]:
    """The general grant's transaction, its lock waits bounded; on
    PostgreSQL it first waits its turn in the names' queue (``queue.py``),
    as the one-trip grant does."""
    if connection.vendor == "postgresql":
        with transaction.atomic(using=connection.alias, durable=True):
            queue.enter(connection, names, lock_wait)
            yield
    else:
        with backends.bounded_transaction(
            connection, lock_wait, statements_bounded=True, durable=True
        ):
            yield


# Attempts at creating a family's missing members before the name is reported
# missing: more than one only when the clean-up deleted a member between its
# creation and the grant; a name that a case-insensitive collation calls
# equal to another member's is never found, however often it is created.
MAX_CREATIONS = 3


class KeyTaken:
    """The grant found the key already used: answer as a repeated acquire."""


def grant(
    connection: BaseDatabaseWrapper,
    ask: fairness.Ask,
    standing: fairness.Standing,
    ttl: int | None,
    lock_wait: float,
) -> PermitRequest | SemaphoreError | KeyTaken | fairness.Refusal:
    """Inside the transaction: lock, check room, maybe reclaim, insert."""
    alias = connection.alias
    demand, key, owner = ask.demand, ask.key, ask.owner
    sql = statements(connection)
    with connection.cursor() as cursor:
        locked = sql.lock(cursor, demand.names, lock_wait)
        # A case- or accent-insensitive collation (MySQL's default) also matches
        # "EXPORTS" to the row "exports": names are exact, as Python compares them.
        locked = [s for s in locked if s.name in demand.counts]
        if len(locked) != len(demand.names):
            return SemaphoreNotFound(set(demand.names) - {s.name for s in locked})
        # Beyond the capacity settings declare, a demand is a programming
        # error; beyond one an operator lowered (or closed: 0), it waits.
        too_big = [
            s.name
            for s in locked
            if not fits(0, demand.counts[s.name], s.capacity)
            and demand.counts[s.name] > declared_capacity(s.name)
        ]
        if too_big:
            return CapacityExceeded(
                "Asked for more permits than the capacity settings declare for: "
                + ", ".join(too_big)
            )
        if lacking_room(locked, demand.counts) and not sql.fresh_with_the_lock(locked):
            # The release totals read with the lock may predate the wait for
            # a second row (MariaDB) or not be read at all (PostgreSQL): read
            # them again before saying no.
            sql.read_released(cursor, locked)
        # While a line is live on one of these semaphores, the line
        # decides too (see refusal): nobody is granted past an older ticket.
        if lacking_room(locked, demand.counts) or any(s.queue_live for s in locked):
            refused = refusal(connection, sql, cursor, locked, lock_wait, ask, standing)
            if refused is not None:
                return refused
        request_id, now, expires_at = sql.insert_request(cursor, key, owner, ttl, lock_wait)
        for s in locked:
            if s.limit.closing_due(now, s.slots_closed_until):
                sql.close_slots(cursor, s, now)
        sql.count_grant(cursor, locked, {s.id: demand.counts[s.name] for s in locked}, now)
        tokens = {s.name: s.fencing_counter + 1 for s in locked}
        # In semaphore id order: a release by key reaches the release
        # counters through the permits in id order (statements/release.py).
        sql.insert_permits(
            cursor,
            [
                (
                    s.id,
                    request_id,
                    demand.counts[s.name],
                    tokens[s.name],
                    s.limit.slot_ends(now, s.slots_closed_until),
                )
                for s in sorted(locked, key=lambda s: s.id)
            ],
        )
    request = _granted(alias, request_id, key, owner, ttl, expires_at, now, tokens)
    if signals.permit_acquired.has_listeners(PermitRequest):
        transaction.on_commit(functools.partial(_announce, request), using=alias)
    return request


def grant_in_one_trip(
    connection: BaseDatabaseWrapper,
    ask: fairness.Ask,
    standing: fairness.Standing,
    ttl: int | None,
    lock_wait: float,
) -> PermitRequest | fairness.Refusal | None:
    """The common grant -- room on every semaphore, nobody queued -- in one
    round trip and its own transaction, where the database can
    (``statements/one_trip.py``); for one name, the line's grants and
    refusals too. ``None``, nothing written, when the call needs the general
    grant: expired permits to reclaim, a rate limit, a live line on several
    names, a missing name."""
    if connection.in_atomic_block:
        return None
    sql = one_trip_statements(connection)
    if not sql.applies():
        return None
    # Where the call stands, as the one-trip grant that may refuse it takes it.
    line = Line(
        standing.ticketed,
        bool(standing.lacked),
        fairness.ticket_life(ask),
        ask.priority,
        bool(ask.share),
    )
    granted = sql.grant(ask.demand.counts, ask.key, ask.owner, ttl, lock_wait, line)
    if granted is None:
        return None
    if isinstance(granted, Refused):
        return fairness.refused_in_one_trip(connection, ask, standing, granted)
    request = _granted(
        connection.alias,
        granted.request_id,
        ask.key,
        ask.owner,
        ttl,
        granted.expires_at,
        granted.granted_at,
        granted.fencing_tokens,
    )
    if signals.permit_acquired.has_listeners(PermitRequest):
        _announce(request)
    return request


def _granted(
    alias: str,
    request_id: int,
    key: str,
    owner: str,
    ttl: int | None,
    expires_at: datetime | None,
    now: datetime,
    tokens: dict[str, int],
) -> PermitRequest:
    """The request as inserted: what Django would build had it read the row back."""
    request = PermitRequest.from_db(
        alias,
        REQUEST_COLUMNS,
        [request_id, key, owner, State.ACQUIRED, ttl, expires_at, now, now, None, ""],
    )
    request.__dict__["fencing_tokens"] = tokens
    return request


def _announce(request: PermitRequest) -> None:
    """``permit_acquired``, once the grant committed."""
    signals.permit_acquired.send_robust(
        sender=PermitRequest, request=request, using=request._state.db
    )


def refusal(
    connection: BaseDatabaseWrapper,
    sql: Statements,
    cursor: CursorWrapper,
    locked: list[LockedSemaphore],
    lock_wait: float,
    ask: fairness.Ask,
    standing: fairness.Standing,
) -> fairness.Refusal | KeyTaken | None:
    """Why this call may not insert: no room even after reclaiming expired
    permits on the semaphores that lack it, or older tickets waiting (a call
    that waits takes its tickets then). ``None``: it may."""
    demand = ask.demand
    usage = sql.usage(cursor, ask.key, [s.id for s in locked])
    if usage.key_taken:
        # A repeated call is answered with its request even when full.
        return KeyTaken()
    for s in locked:
        if s.limit.is_rate:
            # Exact before anything is decided: the line reads it too.
            sql.close_slots(cursor, s, usage.now)
    # Expired holders free room on concurrency limits only: a rate limit's
    # slots end with their window, released or not.
    lacking = [s.id for s in lacking_room(locked, demand.counts) if not s.limit.is_rate]
    if lacking and usage.expired and reclaim_expired(connection, lacking, usage.now, lock_wait):
        sql.read_released(cursor, locked)
    waiting_on, standing = fairness.admit(
        connection, cursor, locked, usage.now, lock_wait, ask, standing
    )
    if not waiting_on:
        return None
    # Seconds until the rate limits that lack room have room for this demand;
    # none when a concurrency limit lacks room too (its holders' releases
    # cannot be foretold).
    retry_after = None
    short = lacking_room(locked, demand.counts)
    if short and all(s.limit.is_rate for s in short):
        frees = [sql.next_slot(cursor, s, demand.counts[s.name], usage.now) for s in short]
        if None not in frees:
            retry_after = max((at - usage.now).total_seconds() for at in frees if at is not None)
    return fairness.Refusal(SemaphoreExhausted(waiting_on, retry_after=retry_after), standing)


# --- idempotent re-entry -----------------------------------------------------


def find_request(alias: str, key: str) -> PermitRequest | None:
    """The request with exactly this key, annotated with the database's clock."""
    request = (
        PermitRequest.objects.using(alias)
        .annotate(db_now=DatabaseNow())
        .filter(external_id=key)
        .first()
    )
    if request is not None and request.external_id != key:
        # Equal under MySQL's collation (case, accents, trailing spaces), yet
        # another caller's key: never hand out or touch its permit.
        raise IdempotencyConflict(
            f"Key {key!r} collides with the existing key {request.external_id!r}: "
            f"the database compares keys ignoring case, accents and trailing spaces."
        )
    return request


def reattach_key(connection: BaseDatabaseWrapper, key: str, demand: Demand) -> PermitRequest | None:
    """The key's request, answered as a repeated acquire; ``None`` if the key
    has none (one indexed probe; the request is loaded only if it exists)."""
    if not statements(connection).key_exists(key):
        return None
    existing = find_request(connection.alias, key)
    return None if existing is None else _reattach(connection.alias, existing, demand)


def _reattach(alias: str, request: PermitRequest, demand: Demand) -> PermitRequest:
    held = request.permits.using(alias).values_list("semaphore__name", "count", "fencing_token")
    counts = {name: count for name, count, _ in held}
    if counts != demand.counts:
        raise IdempotencyConflict(
            f"Key {request.external_id!r} already holds {_describe(counts)}, "
            f"not {_describe(demand.counts)}."
        )
    raise_if_not_held(alias, request)
    request.__dict__["fencing_tokens"] = {name: token for name, _, token in held}
    return request


def _describe(counts: dict[str, int]) -> str:
    return ", ".join(f"{name}x{count}" for name, count in sorted(counts.items())) or "nothing"


def raise_if_not_held(alias: str, request: PermitRequest) -> None:
    """``PermitAlreadyReleased`` unless ``request`` (read by ``find_request``)
    is held; an expired one is released on the way."""
    if request.state != State.ACQUIRED:
        raise PermitAlreadyReleased(
            f"Request {request.external_id!r} was released "
            f"({request.release_reason or 'unknown reason'})."
        )
    db_now: datetime = request.db_now  # type: ignore[attr-defined]
    if request.expires_at is not None and request.expires_at <= db_now:
        release_requests(alias, [request.pk], ReleaseReason.EXPIRED)
        raise PermitAlreadyReleased(f"Request {request.external_id!r} expired.")
