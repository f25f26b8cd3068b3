"""The algorithm: how permits are granted, renewed and released.

Acquire locks the requested semaphore rows with ``SELECT ... FOR UPDATE`` in
ascending name order (so two multi-semaphore requests never wait on each other
in a circle), sums what is in use, and inserts the request and its permits only
if every semaphore has room, all in one short transaction. Release needs
neither a lock nor a transaction: state only moves ACQUIRED -> RELEASED and
every update says ``AND state = 'ACQUIRED'``, so repeating it is harmless.

This is the only module that takes locks.
"""

from __future__ import annotations

import functools
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar
from weakref import WeakKeyDictionary

from django.conf import settings
from django.db import DatabaseError, IntegrityError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.db.models import Q

from django_semaphore import backends, fairness, holds, routing, signals
from django_semaphore.backends import DatabaseNow, Failure, StatementNow
from django_semaphore.conf import app_settings
from django_semaphore.exceptions import (
    AcquireTimeout,
    CapacityExceeded,
    DatabaseUnavailable,
    IdempotencyConflict,
    LockContention,
    NestedTransactionError,
    PermitAlreadyReleased,
    PermitNotFound,
    SemaphoreError,
    SemaphoreExhausted,
    SemaphoreNotFound,
)
from django_semaphore.guards import engine_writes
from django_semaphore.outcomes import ReleaseOutcome
from django_semaphore.validation import (
    Demand,
    validate_capacity,
    validate_demand,
    validate_key,
    validate_owner,
    validate_timeout,
    validate_ttl,
)

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser

    from django_semaphore.models import PermitRequest, Semaphore

T = TypeVar("T")

# Waiting for room: capped exponential backoff with full jitter, so waiters
# spread out instead of stampeding the row the moment a permit is released.
BACKOFF_BASE = 0.05
BACKOFF_CAP = 2.0


# --- acquire -----------------------------------------------------------------


def acquire(
    names: Any,
    *,
    external_id: str,
    owner: str = "",
    ttl: int | float | timedelta | None = None,
    timeout: int | float | timedelta = 0,
    fair: bool = False,
) -> PermitRequest:
    """Grant permits on every named semaphore, or on none of them.

    Args:
        names: ``"exports"``, ``["exports", "network"]`` or ``{"exports": 2}``.
        external_id: the caller's idempotency key (job id, task id, UUID). A
            repeated call with the same key and demand returns the same request.
        owner: who holds the permits, for operators and liveness checkers.
        ttl: seconds (or a ``timedelta``) after which the permits may be
            reclaimed unless renewed; ``None`` never expires.
        timeout: seconds to keep trying while there is no room; 0 fails fast.
        fair: wait in first-come, first-served order (as on a semaphore whose
            ``fair`` is set): a waiter takes a ticket, and nobody is granted
            ahead of an older live ticket on any of its semaphores.

    Returns:
        The ACQUIRED ``PermitRequest``; ``fencing_tokens`` maps each name to
        the token of its permit.

    Raises:
        InvalidRequest: a malformed argument (nothing is written);
            ``CrossShardRequest`` when the names live on different aliases.
        SemaphoreNotFound: a name has no semaphore.
        CapacityExceeded: a count larger than the semaphore's capacity.
        SemaphoreExhausted: no room now (``AcquireTimeout`` once ``timeout`` ran out).
        IdempotencyConflict: the key was used with other names or counts.
        PermitAlreadyReleased: the key's request was released or expired.
        NestedTransactionError: called inside ``atomic()`` on the app's alias.
        LockContention, DatabaseUnavailable: retries did not get through.
    """
    demand = validate_demand(names)
    key = validate_key(external_id)
    owner = validate_owner(owner)
    ttl_seconds = validate_ttl(ttl)
    wait = validate_timeout(timeout)
    connection = connections[routing.alias_for_names(demand.names)]
    _refuse_outer_transaction(connection)

    deadline = time.monotonic() + wait
    place = fairness.Place(key, owner, demand, fair=bool(fair), deadline=deadline if wait else None)

    def attempt() -> PermitRequest:
        lock_wait = app_settings.LOCK_WAIT_TIMEOUT
        if wait:
            # A waiter never sits in a lock queue past its own deadline.
            lock_wait = min(lock_wait, max(deadline - time.monotonic(), 1.0))
        return run_with_retries(
            connection,
            functools.partial(
                _acquire_once, connection, demand, key, owner, ttl_seconds, lock_wait, place
            ),
        )

    with _finish_signalled(connection, demand):
        try:
            return attempt()
        except SemaphoreExhausted as exc:
            if not wait:
                raise
            refused = exc
        try:
            return _wait_for_room(connection, attempt, place, wait, deadline, refused)
        except BaseException:
            place.leave(connection.alias)
            raise
    raise AssertionError("unreachable")  # pragma: no cover


def _wait_for_room(
    connection: BaseDatabaseWrapper,
    attempt: Callable[[], PermitRequest],
    place: fairness.Place,
    wait: float,
    deadline: float,
    refused: SemaphoreExhausted,
) -> PermitRequest:
    """Retry ``attempt`` until granted or ``deadline``. Only the first waiter
    of this process's line polls (see ``fairness``); every sleep is taken
    with no transaction open and no row locked."""
    with fairness.waiting_line(place) as turn:
        for polls in itertools.count(1):
            queued_behind = not turn.is_first()
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not turn.wait(remaining):
                raise AcquireTimeout(refused.names, f"{refused} (waited {wait:g}s)")
            if not queued_behind:
                # The last attempt may come at the deadline, never after it.
                place.pause(connection, _backoff(polls), deadline)
            try:
                return attempt()
            except SemaphoreExhausted as exc:
                refused = exc
    raise AssertionError("unreachable")  # pragma: no cover


@contextmanager
def _finish_signalled(connection: BaseDatabaseWrapper, demand: Demand) -> Iterator[None]:
    """Send ``acquire_finished`` when the call is answered: granted, or refused
    for want of room (other errors send nothing). Robust: a failing receiver
    is logged by Django, never raised into a caller who may hold the permit."""
    from django_semaphore.models import PermitRequest

    started = time.monotonic()

    def send(granted: bool, lacking: list[str]) -> None:
        signals.acquire_finished.send_robust(
            sender=PermitRequest,
            names=demand.names,
            granted=granted,
            lacking=lacking,
            waited=time.monotonic() - started,
            using=connection.alias,
        )

    try:
        yield
    except SemaphoreExhausted as exc:
        send(False, exc.names)
        raise
    send(True, [])


def _backoff(attempt: int) -> float:
    return random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2**attempt))


def _refuse_outer_transaction(connection: BaseDatabaseWrapper) -> None:
    # Joining the caller's transaction would keep the permit uncommitted, and
    # the semaphore rows locked, until the caller's block ends. Test-case
    # wrappers are not the caller's and are allowed (as Django's durable=True does).
    if any(not getattr(block, "_from_testcase", False) for block in connection.atomic_blocks):
        raise NestedTransactionError(
            f"acquire() cannot run inside an atomic() block on database "
            f"{connection.alias!r}: the permit would stay uncommitted and the "
            f"semaphore locked until that block ends. Acquire before the block, "
            f"or give the app its own alias with DJANGO_SEMAPHORE['DATABASE']."
        )


def _acquire_once(
    connection: BaseDatabaseWrapper,
    demand: Demand,
    key: str,
    owner: str,
    ttl: int | None,
    lock_wait: float,
    place: fairness.Place,
) -> PermitRequest:
    # No look-up of the key before the grant: the insert's unique index tells
    # whether the key is taken (or, when there is no room, the read that
    # says why).
    with _prelocked(demand.names):
        try:
            with _grant_transaction(connection, lock_wait):
                outcome = _grant(connection, demand, key, owner, ttl, lock_wait, place)
        except IntegrityError:
            # The key has a request already: a repeated call, or two first
            # calls at once where the other's insert won.
            existing = _reattach_key(connection, key, demand)
            if existing is None:
                raise
            return existing
    if isinstance(outcome, _KeyTaken):
        existing = _reattach_key(connection, key, demand)
        # None: deleted by the clean-up since; the key is free again.
        return existing or _acquire_once(connection, demand, key, owner, ttl, lock_wait, place)
    if isinstance(outcome, (SemaphoreNotFound, CapacityExceeded)):
        # Decided before the key was read: a repeated call still answers with
        # its request.
        existing = _reattach_key(connection, key, demand)
        if existing is not None:
            return existing
    if isinstance(outcome, SemaphoreError):
        # Raised only after the commit, so that a reclaim of expired permits
        # done while deciding is kept.
        raise outcome
    return outcome


class _KeyTaken:
    """The grant found the key already used: answer as a repeated acquire."""


@contextmanager
def _grant_transaction(connection: BaseDatabaseWrapper, lock_wait: float) -> Iterator[None]:
    """The grant's own transaction, its lock waits bounded by ``lock_wait``."""
    # On MariaDB every statement of the grant carries its own bound (see
    # _Statements.bounded): no session variable to set and restore around it.
    session_bound = (
        nullcontext()
        if backends.bounds_each_statement(connection)
        else backends.bounded_lock_wait(connection, lock_wait)
    )
    # engine_writes(): fair mode writes queued_until through the ORM.
    with session_bound, transaction.atomic(using=connection.alias, durable=True), engine_writes():
        backends.start_bounded_transaction(connection, lock_wait)
        yield


@dataclass
class _LockedSemaphore:
    id: int
    name: str
    capacity: int
    fencing_counter: int
    fair: bool
    queued_until: Any  # as the driver returns it; fairness converts it if it is set
    queue_live: Any  # queued_until is ahead of the database's clock (true, false or NULL)


def _grant(
    connection: BaseDatabaseWrapper,
    demand: Demand,
    key: str,
    owner: str,
    ttl: int | None,
    lock_wait: float,
    place: fairness.Place,
) -> PermitRequest | SemaphoreError | _KeyTaken:
    """Inside the transaction: lock, count, maybe reclaim, insert.

    From the lock to the commit every waiter on these semaphores waits too,
    so this runs precompiled statements (see ``_Statements``), one per step.
    """
    from django_semaphore.models import PermitRequest, State

    alias = connection.alias
    sql = _statements(connection)
    with connection.cursor() as cursor:
        rows = sql.lock(cursor, demand.names, lock_wait)
        # A case- or accent-insensitive collation (MySQL's default) also matches
        # "EXPORTS" to the row "exports": names are exact, as Python compares them.
        rows = [row for row in rows if row[1] in demand.counts]
        if len(rows) != len(demand.names):
            return SemaphoreNotFound(set(demand.names) - {row[1] for row in rows})
        locked = [_LockedSemaphore(*row) for row in rows]
        too_big = [s.name for s in locked if demand.counts[s.name] > s.capacity]
        if too_big:
            return CapacityExceeded(
                "Asked for more permits than the capacity of: " + ", ".join(too_big)
            )

        # The insert decides the common case in the same statement: it adds
        # the request only if every semaphore has room, by sums read once all
        # the rows are locked, and stamps it with the clock of that moment.
        # While a fair queue is live on one of these semaphores, the queue
        # decides first (see _refusal): nobody is granted past an older ticket.
        queued = any(s.queue_live for s in locked)
        inserted = (
            None
            if queued
            else sql.insert_request_if_room(cursor, key, owner, ttl, locked, demand, lock_wait)
        )
        if inserted is None:
            refusal = _refusal(connection, sql, cursor, key, locked, demand, lock_wait, place)
            if refusal is not None:
                return refusal
            inserted = sql.insert_request_if_room(
                cursor, key, owner, ttl, locked, demand, lock_wait
            )
            if inserted is None:  # pragma: no cover - room only grows while the rows are locked
                return SemaphoreExhausted(list(demand.names))
        request_id, now, expires_at = inserted
        # This write is what keeps a multi-primary (Galera) cluster from
        # over-granting: row locks are node-local there, but two grants that
        # both write these rows conflict at certification. Never drop it.
        sql.advance_fencing_counters(cursor, [s.id for s in locked], now, lock_wait)
        tokens = {s.name: s.fencing_counter + 1 for s in locked}
        sql.insert_permits(
            cursor,
            [(s.id, request_id, demand.counts[s.name], tokens[s.name]) for s in locked],
            lock_wait,
        )
    # The row as inserted: what Django would build had it read the row back.
    request = PermitRequest.from_db(
        alias,
        [
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
        ],
        [request_id, key, owner, State.ACQUIRED, ttl, expires_at, now, now, None, ""],
    )
    request.__dict__["fencing_tokens"] = tokens
    transaction.on_commit(
        lambda: signals.permit_acquired.send_robust(
            sender=PermitRequest, request=request, using=alias
        ),
        using=alias,
    )
    return request


def _refusal(
    connection: BaseDatabaseWrapper,
    sql: _Statements,
    cursor: CursorWrapper,
    key: str,
    locked: list[_LockedSemaphore],
    demand: Demand,
    lock_wait: float,
    place: fairness.Place,
) -> SemaphoreError | _KeyTaken | None:
    """Why this call may not insert: no room even after reclaiming expired
    permits on the semaphores that lack it, or older tickets waiting (fair
    mode takes this call's tickets then). ``None``: it may."""
    ids = [s.id for s in locked]
    usage = sql.usage(cursor, key, ids)
    if usage.key_taken:
        # A repeated call is answered with its request even when full.
        return _KeyTaken()
    lacking = _lacking_room(usage, locked, demand)
    if (
        lacking
        and usage.expired
        and _reclaim_expired_bounded(connection, [s.id for s in lacking], usage.now, lock_wait)
    ):
        lacking = _lacking_room(sql.usage(cursor, key, ids), locked, demand)
    waiting_on = place.admit(
        connection, cursor, locked, usage.now, [s.name for s in lacking], lock_wait
    )
    return SemaphoreExhausted(waiting_on) if waiting_on else None


def _lacking_room(
    usage: _Usage, locked: list[_LockedSemaphore], demand: Demand
) -> list[_LockedSemaphore]:
    return [s for s in locked if usage.in_use[s.id] + demand.counts[s.name] > s.capacity]


def _reclaim_expired_bounded(
    connection: BaseDatabaseWrapper, semaphore_ids: list[int], now: datetime, lock_wait: float
) -> int:
    # The reclaim's ORM updates carry no SET STATEMENT prefix: on MariaDB the
    # session's lock wait is bounded around them instead (elsewhere it already
    # is, for the whole grant transaction).
    bound = (
        backends.bounded_lock_wait(connection, lock_wait)
        if backends.bounds_each_statement(connection)
        else nullcontext()
    )
    with bound:
        return _reclaim_expired(connection.alias, semaphore_ids, now)


def _reclaim_expired(alias: str, semaphore_ids: list[int], now: datetime) -> int:
    """Release expired requests holding the locked semaphores: a TTL takes
    effect when due, not at the next sweep."""
    from django_semaphore.models import PermitRequest, ReleaseReason, State

    expired = list(
        PermitRequest.objects.using(alias)
        .filter(
            state=State.ACQUIRED,
            expires_at__lte=now,
            permits__semaphore_id__in=semaphore_ids,
            permits__state=State.ACQUIRED,
        )
        .values_list("id", flat=True)
        .distinct()
    )
    return release_requests(alias, expired, ReleaseReason.EXPIRED)


# --- idempotent re-entry -----------------------------------------------------


def _find_request(alias: str, key: str) -> PermitRequest | None:
    from django_semaphore.models import PermitRequest

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


def _reattach_key(
    connection: BaseDatabaseWrapper, key: str, demand: Demand
) -> PermitRequest | None:
    """The key's request, answered as a repeated acquire; ``None`` if the key
    has none (one indexed probe; the request is loaded only if it exists)."""
    if not _statements(connection).key_exists(key):
        return None
    existing = _find_request(connection.alias, key)
    return None if existing is None else _reattach(connection.alias, existing, demand)


def _reattach(alias: str, request: PermitRequest, demand: Demand) -> PermitRequest:
    """Answer a repeated acquire with the request its key already has."""
    from django_semaphore.models import ReleaseReason

    held = {
        name: (count, token)
        for name, count, token in request.permits.using(alias).values_list(
            "semaphore__name", "count", "fencing_token"
        )
    }
    if {name: count for name, (count, _) in held.items()} != demand.counts:
        raise IdempotencyConflict(
            f"Key {request.external_id!r} already holds {_describe(held)}, "
            f"not {_describe({n: (c, 0) for n, c in demand.counts.items()})}."
        )
    _raise_if_not_held(alias, request, ReleaseReason.EXPIRED)
    request.__dict__["fencing_tokens"] = {name: token for name, (_, token) in held.items()}
    return request


def _describe(held: dict[str, tuple[int, int]]) -> str:
    return ", ".join(f"{name}x{count}" for name, (count, _) in sorted(held.items())) or "nothing"


def _raise_if_not_held(alias: str, request: PermitRequest, reason: str) -> None:
    from django_semaphore.models import State

    if request.state != State.ACQUIRED:
        raise PermitAlreadyReleased(
            f"Request {request.external_id!r} was released "
            f"({request.release_reason or 'unknown reason'})."
        )
    db_now: datetime = request.db_now  # type: ignore[attr-defined]
    if request.expires_at is not None and request.expires_at <= db_now:
        release_requests(alias, [request.pk], reason)
        raise PermitAlreadyReleased(f"Request {request.external_id!r} expired.")


# --- release and renew -------------------------------------------------------


def release(external_id: str) -> ReleaseOutcome:
    """End the request with this key; safe to repeat.

    Returns:
        ``RELEASED`` if this call ended it, ``ALREADY_RELEASED`` if it had
        ended before (released, expired or revoked), ``NOT_FOUND`` otherwise.
    """
    from django_semaphore.models import ReleaseReason, State

    key = validate_key(external_id)
    connection = connections[routing.alias_for_key(key)]

    def attempt() -> ReleaseOutcome:
        sql = _statements(connection)
        # One statement, unless someone listens for the released ids (as
        # Django's delete skips fetching rows nobody's signal receives).
        if (
            sql.release_by_key_sql
            and not _released_ids_wanted()
            and sql.release_by_key(key, ReleaseReason.RELEASED)
        ):
            return ReleaseOutcome.RELEASED
        row = sql.find_request(key)
        if row is None:
            return ReleaseOutcome.NOT_FOUND
        pk, state = row
        if state == State.RELEASED:
            return ReleaseOutcome.ALREADY_RELEASED
        released = release_requests(connection.alias, [pk], ReleaseReason.RELEASED)
        return ReleaseOutcome.RELEASED if released else ReleaseOutcome.ALREADY_RELEASED

    return run_with_retries(connection, attempt)


def release_requests(alias: str, request_ids: Sequence[int], reason: str) -> int:
    """Release the given requests; returns how many this call released.

    Permits first, then their requests, each update conditional on ACQUIRED:
    no lock and no transaction needed, and a crash between the two leaves a
    half-released request that the sweep completes.
    """
    from django_semaphore.models import PermitRequest

    if not request_ids:
        return 0
    connection = connections[alias]
    ids = list(request_ids)
    released = _statements(connection).release(ids, reason)
    if released:

        def announce() -> None:
            signals.permit_released.send_robust(
                sender=PermitRequest, request_ids=ids, reason=reason, using=alias
            )
            holds.send_hold_ended(PermitRequest, ids, reason, alias)

        transaction.on_commit(announce, using=alias)
    return released


def release_permits(alias: str, permit_ids: Sequence[int]) -> int:
    """Release the given permits that are still ACQUIRED, whatever their
    request says; returns how many this call released.

    Only for the sweep's repairs: permits held under a released request, or
    with no request at all. Every other release goes by request.
    """
    from django_semaphore.models import Permit, State

    if not permit_ids:
        return 0
    with engine_writes():
        return (
            Permit.objects.using(alias)
            .filter(pk__in=list(permit_ids), state=State.ACQUIRED)
            .update(state=State.RELEASED)
        )


def _released_ids_wanted() -> bool:
    """Whether a receiver wants to know which requests a release ended."""
    from django_semaphore.models import PermitRequest

    return signals.permit_released.has_listeners(PermitRequest) or signals.hold_ended.has_listeners(
        PermitRequest
    )


def renew(external_id: str, ttl: int | float | timedelta | None = None) -> PermitRequest:
    """Push the request's expiry to now + ``ttl`` (default: its own ttl).

    Raises:
        PermitAlreadyReleased: it was released or had expired; the holder has
            lost its permits and must stop. ``PermitNotFound`` (a subclass)
            when no request has this key.
    """
    from django_semaphore.models import PermitRequest, ReleaseReason, State

    key = validate_key(external_id)
    ttl_seconds = validate_ttl(ttl)
    connection = connections[routing.alias_for_key(key)]
    alias = connection.alias

    def attempt() -> PermitRequest:
        request = _find_request(alias, key)
        if request is None:
            raise PermitNotFound(f"No permit request has the key {key!r}.")
        _raise_if_not_held(alias, request, ReleaseReason.EXPIRED)
        new_ttl = ttl_seconds or request.ttl
        if new_ttl is None:
            return request
        expires_at = request.db_now + timedelta(seconds=new_ttl)  # type: ignore[attr-defined]
        # Conditional on still being held and unexpired by the database's
        # clock: a lapsed permit is never silently revived.
        renewed = (
            PermitRequest.objects.using(alias)
            .filter(pk=request.pk, state=State.ACQUIRED)
            .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=DatabaseNow()))
            .update(ttl=new_ttl, expires_at=expires_at, updated_at=DatabaseNow())
        )
        if not renewed:
            raise PermitAlreadyReleased(f"Request {key!r} ended while being renewed.")
        request.ttl, request.expires_at = new_ttl, expires_at
        return request

    return run_with_retries(connection, attempt)


# --- capacity ----------------------------------------------------------------


def set_capacity(
    name: str,
    capacity: int,
    *,
    changed_by: AbstractBaseUser | None = None,
    reason: str = "",
) -> Semaphore:
    """Change a semaphore's capacity under its row lock and record it.

    Lowering below what is in use is allowed: the semaphore is over capacity
    and grants nothing until usage falls; held permits are never revoked.
    Runs in the caller's transaction if there is one (the admin's save).
    """
    capacity = validate_capacity(capacity)
    reason = validate_owner(reason, field="reason")
    connection = connections[routing.alias_for_name(name)]
    return run_with_retries(
        connection,
        lambda: _set_capacity(connection.alias, name, capacity, changed_by, reason),
    )


def _set_capacity(
    alias: str,
    name: str,
    capacity: int,
    changed_by: AbstractBaseUser | None,
    reason: str,
) -> Semaphore:
    from django_semaphore.models import Semaphore

    with transaction.atomic(using=alias):
        try:
            semaphore = Semaphore.objects.using(alias).select_for_update().get(name=name)
        except Semaphore.DoesNotExist:
            raise SemaphoreNotFound([name]) from None
        _change_capacity(alias, semaphore, capacity, changed_by, reason)
    return semaphore


def lock_for_save(alias: str, semaphore_id: int, capacity: int | None) -> bool:
    """``Semaphore.save()`` of an existing row: lock it and, if ``capacity``
    is given, change it as :func:`set_capacity` does (no user, no reason).
    In the caller's transaction; ``False`` if no row has this id."""
    from django_semaphore.models import Semaphore

    if capacity is not None:
        capacity = validate_capacity(capacity)
    semaphore = Semaphore.objects.using(alias).select_for_update().filter(pk=semaphore_id).first()
    if semaphore is None:
        return False
    if capacity is not None:
        _change_capacity(alias, semaphore, capacity, None, "")
    return True


def _change_capacity(
    alias: str,
    semaphore: Semaphore,
    capacity: int,
    changed_by: AbstractBaseUser | None,
    reason: str,
) -> None:
    """On the locked row: record the change, then make it."""
    from django_semaphore.models import CapacityChange

    if semaphore.capacity == capacity:
        return
    CapacityChange.objects.using(alias).create(
        semaphore=semaphore,
        old_capacity=semaphore.capacity,
        new_capacity=capacity,
        changed_by_id=None if changed_by is None else changed_by.pk,
        reason=reason,
    )
    semaphore.capacity = capacity
    with engine_writes():
        semaphore.save(using=alias, update_fields=["capacity", "updated_at"])


# --- the hot path's SQL, built once per connection ----------------------------


class _Statements:
    """The statements of acquire's and release's common path, for one connection.

    Building and compiling a queryset costs far more CPU than the database
    spends on these statements (measured on MariaDB: ~0.5 ms against ~0.04 ms
    a statement), and the grant runs them while it holds the semaphore rows'
    locks, so every waiter pays for that time too. The locking read is still
    the ORM's ``select_for_update()``, compiled once per number of names; the
    others are short, fixed SQL on the models' own table and column names.
    """

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        from django.db.models import DateTimeField, DurationField, Value
        from django.db.models.expressions import CombinedExpression
        from django.db.models.sql import Query

        from django_semaphore.models import Permit, PermitRequest, Semaphore, State

        self.connection = connection
        self.use_tz = settings.USE_TZ
        self.acquired, self.released = State.ACQUIRED.value, State.RELEASED.value
        self.locks: dict[int, str] = {}
        self.returning = connection.features.can_return_columns_from_insert
        q = connection.ops.quote_name
        compiler = Query(PermitRequest).get_compiler(connection=connection)
        now, _ = compiler.compile(DatabaseNow())
        # The grant's insert reads the clock once: when it starts, every row
        # it depends on is locked already.
        stamp, _ = compiler.compile(StatementNow())
        self.duration = DurationField()
        expiry = CombinedExpression(
            StatementNow(), "+", Value(timedelta(), self.duration), output_field=DateTimeField()
        )
        expires, expires_params = compiler.compile(expiry.resolve_expression(compiler.query))
        if len(expires_params) != 1:  # pragma: no cover - a Django change would show here
            raise AssertionError(f"Unexpected parameters in the expiry: {expires_params!r}")
        semaphore, request, permit = (
            q(m._meta.db_table) for m in (Semaphore, PermitRequest, Permit)
        )
        self.key_sql = (
            f"SELECT {q('id')}, {q('state')}, {q('external_id')} FROM {request}"
            f" WHERE {q('external_id')} = %s"
        )
        # One row, read once the semaphore rows are locked. FOR UPDATE
        # serializes grants; these plain reads then see every permit
        # committed before the lock was granted (Django runs MySQL at READ
        # COMMITTED; PostgreSQL takes a new snapshot per statement). The
        # clock is read here, not in the locking read, which may compute it
        # before its wait for the lock (PostgreSQL does).
        self.usage_sql = (
            f"SELECT {now}, (SELECT {q('id')} FROM {request} WHERE {q('external_id')} = %s),"
            # Whether an expired request still holds one of the semaphores:
            # only then is a reclaim worth its statements.
            f" EXISTS(SELECT 1 FROM {request} r JOIN {permit} p"
            f" ON p.{q('request_id')} = r.{q('id')}"
            f" WHERE r.{q('state')} = %s AND r.{q('expires_at')} <= {now}"
            f" AND p.{q('semaphore_id')} IN ({{ids}}) AND p.{q('state')} = %s){{sums}}"
        )
        self.in_use_sql = (
            f", (SELECT COALESCE(SUM({q('count')}), 0) FROM {permit}"
            f" WHERE {q('semaphore_id')} = %s AND {q('state')} = %s)"
        )
        # INSERT ... SELECT: a row only if every locked semaphore has room.
        # Both Django's MySQL isolation (READ COMMITTED) and PostgreSQL's read
        # the sums from a snapshot taken when this statement starts, after the
        # locking read: every permit committed before the lock is counted.
        self.insert_if_room_sql = (
            f"INSERT INTO {request} ({q('external_id')}, {q('owner')}, {q('state')},"
            f" {q('ttl')}, {q('expires_at')}, {q('created_at')}, {q('updated_at')},"
            f" {q('released_at')}, {q('release_reason')})"
            f" SELECT %s, %s, %s, %s, {{expires}}, {stamp}, {stamp}, NULL, ''"
            + (" FROM DUAL" if connection.vendor == "mysql" else "")
            + " WHERE {room}"
            + (
                f" RETURNING {q('id')}, {q('created_at')}, {q('expires_at')}"
                if self.returning
                else ""
            )
        )
        self.expires_sql = expires
        self.room_sql = (
            f"(SELECT COALESCE(SUM({q('count')}), 0) FROM {permit}"
            f" WHERE {q('semaphore_id')} = %s AND {q('state')} = %s) <= %s"
        )
        self.stamps_sql = (
            f"SELECT {q('created_at')}, {q('expires_at')} FROM {request} WHERE {q('id')} = %s"
        )
        self.fencing_sql = (
            f"UPDATE {semaphore} SET {q('fencing_counter')} = {q('fencing_counter')} + 1,"
            f" {q('updated_at')} = %s WHERE {q('id')} IN ({{ids}})"
        )
        self.insert_permits_sql = (
            f"INSERT INTO {permit} ({q('semaphore_id')}, {q('request_id')}, {q('count')},"
            f" {q('fencing_token')}, {q('state')}) VALUES {{rows}}"
        )
        self.release_permits_sql = (
            f"UPDATE {permit} SET {q('state')} = %s"
            f" WHERE {q('request_id')} IN ({{ids}}) AND {q('state')} = %s"
        )
        self.release_by_key_sql = _release_by_key_sql(connection.vendor, q, request, permit, now)
        self.release_requests_sql = (
            f"UPDATE {request} SET {q('state')} = %s, {q('released_at')} = {now},"
            f" {q('updated_at')} = {now}, {q('release_reason')} = %s"
            f" WHERE {q('id')} IN ({{ids}}) AND {q('state')} = %s"
        )

    # Outside any transaction.

    def key_exists(self, key: str) -> bool:
        """Whether a request has this key, or one the collation calls equal
        (``_find_request`` tells those apart)."""
        with self.connection.cursor() as cursor:
            cursor.execute(self.key_sql, [key])
            return cursor.fetchone() is not None

    def find_request(self, key: str) -> tuple[int, str] | None:
        with self.connection.cursor() as cursor:
            cursor.execute(self.key_sql, [key])
            row = cursor.fetchone()
        # Not another key that only the collation calls equal (see _find_request).
        return None if row is None or row[2] != key else (row[0], row[1])

    def release(self, request_ids: list[int], reason: str) -> int:
        ids = _placeholders(len(request_ids))
        with self.connection.cursor() as cursor:
            cursor.execute(
                self.release_permits_sql.format(ids=ids),
                [self.released, *request_ids, self.acquired],
            )
            cursor.execute(
                self.release_requests_sql.format(ids=ids),
                [self.released, reason, *request_ids, self.acquired],
            )
            return int(cursor.rowcount)

    def release_by_key(self, key: str, reason: str) -> bool:
        """Release the key's request and its permits in one statement;
        whether this call released it."""
        acquired, released = self.acquired, self.released
        params: list[Any]
        if self.connection.vendor == "mysql":
            params = [acquired, released, released, reason, key, acquired, key]
        else:
            params = [released, reason, key, acquired, released, acquired]
        with self.connection.cursor() as cursor:
            cursor.execute(self.release_by_key_sql, params)
            if self.connection.vendor == "mysql":
                # Django connects with CLIENT.FOUND_ROWS: rows matched, and the
                # request row matches only while ACQUIRED.
                return bool(cursor.rowcount)
            return bool(cursor.fetchone()[0])

    # Inside the grant transaction.

    def bounded(self, sql: str, lock_wait: float) -> str:
        return backends.bound_statement(self.connection, sql, lock_wait)

    def lock(self, cursor: CursorWrapper, names: Sequence[str], lock_wait: float) -> list[Any]:
        """Lock the semaphore rows in name order: (id, name, capacity,
        fencing_counter, fair, queued_until, queue_live) each."""
        sql = self.locks.get(len(names))
        if sql is None:
            sql = self.locks[len(names)] = self._compile_lock(len(names))
        cursor.execute(self.bounded(sql, lock_wait), list(names))
        return list(cursor.fetchall())

    def _compile_lock(self, count: int) -> str:
        from django.db.models import BooleanField, ExpressionWrapper

        from django_semaphore.models import Semaphore

        names = [f"name-{i}" for i in range(count)]
        queryset = (
            Semaphore.objects.using(self.connection.alias)
            .select_for_update()
            .filter(name__in=names)
            .order_by("name")
            # The clock may be read before the wait for the lock: a queue
            # then looks live a little longer, never shorter.
            .annotate(
                queue_live=ExpressionWrapper(
                    Q(queued_until__gt=DatabaseNow()), output_field=BooleanField()
                )
            )
            .values_list(
                "id", "name", "capacity", "fencing_counter", "fair", "queued_until", "queue_live"
            )
        )
        sql, params = queryset.query.get_compiler(connection=self.connection).as_sql()
        # Reused with other names: the names must be its only parameters.
        if list(params) != names:  # pragma: no cover - a Django change would show here
            raise AssertionError(f"Unexpected parameters in the locking read: {params!r}")
        return str(sql)

    def usage(self, cursor: CursorWrapper, key: str, semaphore_ids: list[int]) -> _Usage:
        """The clock, whether ``key`` is taken, whether expired permits
        hold any of the semaphores, and the permits held on each: one round trip."""
        cursor.execute(
            self.usage_sql.format(
                ids=_placeholders(len(semaphore_ids)), sums=self.in_use_sql * len(semaphore_ids)
            ),
            [
                key,
                self.acquired,
                *semaphore_ids,
                self.acquired,
                *(p for id in semaphore_ids for p in (id, self.acquired)),
            ],
        )
        now, key_id, expired, *in_use = cursor.fetchone()
        return _Usage(
            now=backends.datetime_from_db(self.connection, now),
            key_taken=key_id is not None,
            expired=bool(expired),
            in_use={id: int(n) for id, n in zip(semaphore_ids, in_use, strict=True)},
        )

    def insert_request_if_room(
        self,
        cursor: CursorWrapper,
        key: str,
        owner: str,
        ttl: int | None,
        locked: list[_LockedSemaphore],
        demand: Demand,
        lock_wait: float,
    ) -> tuple[int, datetime, datetime | None] | None:
        """Insert the request if every semaphore has room: (id, the clock it
        was stamped with, its expiry), or ``None`` and nothing written.

        A concurrent first call with the same key waits here on the unique
        index until the other commits, then fails with IntegrityError.
        """
        expires, params = "NULL", [key, owner, self.acquired, ttl]
        if ttl is not None:
            expires = self.expires_sql
            params.append(self.duration.get_db_prep_value(timedelta(seconds=ttl), self.connection))
        for s in locked:
            params += [s.id, self.acquired, s.capacity - demand.counts[s.name]]
        room = " AND ".join([self.room_sql] * len(locked))
        cursor.execute(
            self.bounded(self.insert_if_room_sql.format(expires=expires, room=room), lock_wait),
            params,
        )
        if self.returning:
            row = cursor.fetchone()
            if row is None:
                return None
            request_id, now, expires_at = row
        else:
            if not cursor.rowcount:
                return None
            request_id = cursor.lastrowid
            cursor.execute(self.stamps_sql, [request_id])
            now, expires_at = cursor.fetchone()
        stamp = functools.partial(backends.datetime_from_db, self.connection)
        return int(request_id), stamp(now), None if expires_at is None else stamp(expires_at)

    def advance_fencing_counters(
        self, cursor: CursorWrapper, semaphore_ids: list[int], now: datetime, lock_wait: float
    ) -> None:
        cursor.execute(
            self.bounded(self.fencing_sql.format(ids=_placeholders(len(semaphore_ids))), lock_wait),
            [self.connection.ops.adapt_datetimefield_value(now), *semaphore_ids],
        )

    def insert_permits(
        self, cursor: CursorWrapper, rows: list[tuple[int, int, int, int]], lock_wait: float
    ) -> None:
        """``rows``: (semaphore id, request id, count, fencing token) each."""
        values = ", ".join(["(%s, %s, %s, %s, %s)"] * len(rows))
        cursor.execute(
            self.bounded(self.insert_permits_sql.format(rows=values), lock_wait),
            [value for row in rows for value in (*row, self.acquired)],
        )


@dataclass
class _Usage:
    now: datetime  # the database's clock
    key_taken: bool  # a request has the key (or one the collation calls equal)
    expired: bool  # an expired request holds one of the semaphores
    in_use: dict[int, int]  # semaphore id -> permits held


def _release_by_key_sql(
    vendor: str, q: Callable[[str], str], request: str, permit: str, now: str
) -> str:
    """Release by key in one statement where the database can update two
    tables in one (atomic: no half-released request); "" elsewhere."""
    if vendor == "mysql":
        # The binary comparison keeps keys exact under a case-insensitive
        # collation (see _find_request); the other one finds the index.
        return (
            f"UPDATE {request} r LEFT JOIN {permit} p"
            f" ON p.{q('request_id')} = r.{q('id')} AND p.{q('state')} = %s"
            f" SET p.{q('state')} = %s, r.{q('state')} = %s, r.{q('released_at')} = {now},"
            f" r.{q('updated_at')} = {now}, r.{q('release_reason')} = %s"
            f" WHERE r.{q('external_id')} = %s AND r.{q('state')} = %s"
            f" AND CAST(r.{q('external_id')} AS BINARY) = CAST(%s AS BINARY)"
        )
    if vendor == "postgresql":
        return (
            f"WITH r AS (UPDATE {request} SET {q('state')} = %s, {q('released_at')} = {now},"
            f" {q('updated_at')} = {now}, {q('release_reason')} = %s"
            f" WHERE {q('external_id')} = %s AND {q('state')} = %s RETURNING {q('id')}),"
            f" p AS (UPDATE {permit} SET {q('state')} = %s"
            f" WHERE {q('request_id')} IN (SELECT {q('id')} FROM r) AND {q('state')} = %s)"
            " SELECT COUNT(*) FROM r"
        )
    return ""


def _placeholders(count: int) -> str:
    return ", ".join(["%s"] * count)


_statements_by_connection: WeakKeyDictionary[BaseDatabaseWrapper, _Statements] = WeakKeyDictionary()


def _statements(connection: BaseDatabaseWrapper) -> _Statements:
    """This connection's statements (each thread has its own connection)."""
    statements = _statements_by_connection.get(connection)
    if statements is None or statements.use_tz != settings.USE_TZ:
        statements = _statements_by_connection[connection] = _Statements(connection)
    return statements


# --- retrying transient database errors -------------------------------------


def run_with_retries(connection: BaseDatabaseWrapper, operation: Callable[[], T]) -> T:
    """Run ``operation``, retrying deadlocks, lock waits and lost connections.

    Safe because every operation is idempotent by its key: a grant whose
    COMMIT succeeded but whose answer was lost is found again by the retry.
    Inside the caller's transaction nothing is retried (the failure may have
    rolled it back), but the error is still translated.
    """
    attempts = 1 if connection.in_atomic_block else max(1, app_settings.RETRY_ATTEMPTS)
    for attempt in range(1, attempts + 1):
        try:
            return operation()
        except _PrelockTimeout:
            failure = Failure.CONTENTION
            cause: Exception = LockContention("Timed out waiting for this process's pre-lock.")
        except DatabaseError as exc:
            failure_or_none = backends.classify(connection, exc)
            if failure_or_none is None:
                raise backends.translate(connection, exc) from exc
            failure, cause = failure_or_none, exc
        if failure is Failure.DISCONNECT and not connection.in_atomic_block:
            connection.close()  # the next statement reconnects
        if attempt == attempts:
            break
        _send_database_retry(connection, failure, attempt, cause)
        time.sleep(random.uniform(0.01, 0.05) * attempt)
    if failure is Failure.DISCONNECT:
        raise DatabaseUnavailable(
            f"Database unavailable after {attempts} attempts: {cause}"
        ) from cause
    raise LockContention(f"Gave up after {attempts} attempts: {cause}") from cause


def _send_database_retry(
    connection: BaseDatabaseWrapper, failure: Failure, attempt: int, error: Exception
) -> None:
    from django_semaphore.models import PermitRequest

    signals.database_retry.send_robust(
        sender=PermitRequest,
        kind=failure.value,
        attempt=attempt,
        error=error,
        using=connection.alias,
    )


# --- in-process pre-lock -----------------------------------------------------


class _PrelockTimeout(Exception):
    pass


_prelocks: dict[str, threading.Lock] = {}
_prelocks_guard = threading.Lock()


@contextmanager
def _prelocked(names: Sequence[str]) -> Iterator[None]:
    """Per-name in-process locks held around the grant transaction.

    N threads of one process waiting on one semaphore then hold one database
    connection in a lock wait, not N. Correctness never depends on it: the
    row lock decides. Locks are kept for the life of the process (one per
    semaphore name this process has used). Sorted order, as for rows.
    """
    timeout = app_settings.PRELOCK_TIMEOUT
    held: list[threading.Lock] = []
    try:
        for name in names:
            with _prelocks_guard:
                lock = _prelocks.setdefault(name, threading.Lock())
            if not lock.acquire(timeout=timeout):
                raise _PrelockTimeout(name)
            held.append(lock)
        yield
    finally:
        for lock in reversed(held):
            lock.release()
