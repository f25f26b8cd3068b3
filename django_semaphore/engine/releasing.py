"""Ending requests: the one-way ACQUIRED -> RELEASED step, with what it
frees counted in the same transaction.

A release adds what it freed to its semaphores' release counters
(``ReleaseCounter``, locked in semaphore id order), never to the semaphore
rows the grants lock: it never queues behind grants, and the room it frees
is there for the next grant once it commits (the grant folds the counters
into its row when it finds no room otherwise). Every path that ends a
permit -- release, the inline reclaim, the sweeps, a force release -- comes
here, and each returns what it freed: the door that called it wakes whoever
waits for that room (``parking.room_made``), once it committed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import datetime
from typing import NamedTuple

from django.db import Error, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from django_semaphore import backends, signals
from django_semaphore.conf import app_settings
from django_semaphore.engine import holds
from django_semaphore.engine.statements.release import (
    ReadBack,
    ReleasedPermit,
    ReleaseStatements,
    release_statements,
)
from django_semaphore.models import PermitRequest
from django_semaphore.states import ReleaseOutcome, ReleaseReason, State

logger = logging.getLogger("django_semaphore")


class Released(NamedTuple):
    """What a release did: how many requests (or permits) this call ended,
    and the permits it freed, by semaphore id."""

    ended: int
    freed: dict[int, int]


def release_key(
    connection: BaseDatabaseWrapper, key: str, parked: bool
) -> tuple[ReleaseOutcome, dict[int, int]]:
    """End the request with this key (one attempt; the caller retries):
    the outcome, and the permits it freed -- with ``parked`` (parked tasks
    are woken from this process), at least on the semaphores where parked
    tasks wait; without it, possibly none."""
    sql = release_statements(connection)
    # One statement where the database can say it; what the signals'
    # receivers and the parked tasks' wake-up need is read once it has
    # committed, off the release's critical path (``announce_key``).
    if sql.releases_by_key():
        read = read_back(parked)
        ended, released = sql.release_by_key(
            key, ReleaseReason.RELEASED, app_settings.LOCK_WAIT_TIMEOUT, read
        )
        if ended:
            freed = {} if read is ReadBack.NEVER else announce_key(connection, key, released)
            return ReleaseOutcome.RELEASED, freed
    row = sql.find_request(key)
    if row is None:
        return ReleaseOutcome.NOT_FOUND, {}
    pk, state = row
    if state == State.RELEASED:
        return ReleaseOutcome.ALREADY_RELEASED, {}
    released_now, freed = release_requests(connection.alias, [pk], ReleaseReason.RELEASED)
    if released_now:
        return ReleaseOutcome.RELEASED, freed
    return ReleaseOutcome.ALREADY_RELEASED, {}


def announce_key(
    connection: BaseDatabaseWrapper, key: str, released: list[ReleasedPermit] | None
) -> dict[int, int]:
    """Tell receivers what the one-statement release of ``key`` ended
    (``released``, when the release read it in the same trip), by one plain
    read once it committed; returns what it freed where parked tasks wait.

    A request's permits only ever go from ACQUIRED to RELEASED, so what the
    read finds is what the statement freed. A task that parked before the
    read is found by it; one that parked after it finds the room itself
    (``parking.park`` looks for room once its row is committed), so no
    wake-up falls between the two. The release is done whatever happens
    here: a failed read is logged, and the beat sweep wakes parked tasks.
    """
    alias = connection.alias
    if released is None:
        try:
            released = release_statements(connection).released_on_key(key)
        except Error:
            logger.warning("Could not read what the release of %r freed.", key, exc_info=True)
            return {}
    if not released:
        return {}
    reason = ReleaseReason.RELEASED.value
    signals.permit_released.send_robust(
        sender=PermitRequest, request_ids=[released[0].request_id], reason=reason, using=alias
    )
    if signals.hold_ended.has_listeners(PermitRequest):
        spans = [
            holds.hold(connection, p.request_id, p.semaphore, p.count, p.granted_at, p.released_at)
            for p in released
        ]
        signals.hold_ended.send_robust(
            sender=PermitRequest, holds=spans, reason=reason, using=alias
        )
    return {p.semaphore_id: p.count for p in released if p.parked_waiting}


def release_requests(alias: str, request_ids: Sequence[int], reason: str) -> Released:
    """Release the given requests: how many this call released, and what
    that freed.

    Repeating it is harmless: every update says ``AND state = 'ACQUIRED'``.
    """
    if not request_ids:
        return Released(0, {})
    ids = list(request_ids)
    with _transaction(alias) as (cursor, sql, lock_wait):
        released = Released(*sql.release(cursor, ids, reason, lock_wait))
        if released.ended:
            transaction.on_commit(lambda: announce(alias, ids, reason), using=alias)
    return released


def release_permits(alias: str, permit_ids: Sequence[int]) -> Released:
    """Release the given permits that are still ACQUIRED, whatever their
    request says, lowering the counters: how many this call released, and
    what that freed.

    Only for the sweep's repairs (permits held under a released request, or
    with no request at all): every other release goes by request.
    """
    if not permit_ids:
        return Released(0, {})
    with _transaction(alias) as (cursor, sql, lock_wait):
        return Released(*sql.release_permits(cursor, list(permit_ids), lock_wait))


def reclaim_expired(
    connection: BaseDatabaseWrapper, semaphore_ids: list[int], now: datetime, lock_wait: float
) -> int:
    """In the caller's transaction, holding these semaphores' rows locked:
    release the expired requests that hold them (how many): a TTL takes
    effect when due, not at the next sweep.

    An expired request may also hold semaphores the caller has not locked;
    its release locks them after these (out of name order), and should that
    meet another transaction in a circle, the database reports a deadlock
    and the caller's attempt is retried whole.
    """
    # Release's updates of request and permit rows carry no per-statement
    # bound (a sweep may hold those rows): on MariaDB the session's lock wait
    # is bounded around the reclaim instead (elsewhere it already is, for
    # the caller's whole transaction).
    bound = (
        backends.bounded_lock_wait(connection, lock_wait)
        if backends.bounds_each_statement(connection)
        else nullcontext()
    )
    with bound:
        expired = list(
            PermitRequest.objects.using(connection.alias)
            .filter(
                state=State.ACQUIRED,
                expires_at__lte=now,
                permits__semaphore_id__in=semaphore_ids,
                permits__state=State.ACQUIRED,
            )
            .values_list("id", flat=True)
            .distinct()
        )
        return release_requests(connection.alias, expired, ReleaseReason.EXPIRED).ended


@contextmanager
def _transaction(alias: str) -> Iterator[tuple[CursorWrapper, ReleaseStatements, float]]:
    """A release's transaction of its own, or its part of the caller's (the
    grant's reclaim, a sweep batch)."""
    connection = connections[alias]
    lock_wait = app_settings.LOCK_WAIT_TIMEOUT
    atomic_block = (
        transaction.atomic(using=alias, savepoint=False)
        if connection.in_atomic_block
        else backends.bounded_transaction(connection, lock_wait, statements_bounded=True)
    )
    with atomic_block, connection.cursor() as cursor:
        yield cursor, release_statements(connection), lock_wait


def announce(alias: str, request_ids: list[int], reason: str) -> None:
    """Tell receivers which requests ended, once that is committed."""
    signals.permit_released.send_robust(
        sender=PermitRequest, request_ids=request_ids, reason=reason, using=alias
    )
    holds.send_hold_ended(PermitRequest, request_ids, reason, alias)


def read_back(parked: bool) -> ReadBack:
    """What a release by key reads of what it ended: all of it for
    ``permit_released``'s and ``hold_ended``'s receivers; with ``parked``,
    where parked tasks wait, while some do."""
    if any(s.has_listeners(PermitRequest) for s in (signals.permit_released, signals.hold_ended)):
        return ReadBack.ALWAYS
    return ReadBack.PARKED if parked else ReadBack.NEVER
