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
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import DatabaseError, IntegrityError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Q, Sum

from django_semaphore import backends, signals
from django_semaphore.backends import DatabaseNow, Failure
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

    Returns:
        The ACQUIRED ``PermitRequest``; ``fencing_tokens`` maps each name to
        the token of its permit.

    Raises:
        InvalidRequest: a malformed argument (nothing is written).
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
    connection = connections[app_settings.DATABASE]
    _refuse_outer_transaction(connection)

    deadline = time.monotonic() + wait
    for attempt in itertools.count(1):
        lock_wait = app_settings.LOCK_WAIT_TIMEOUT
        if wait:
            # A waiter never sits in a lock queue past its own deadline.
            lock_wait = min(lock_wait, max(deadline - time.monotonic(), 1.0))
        try:
            return run_with_retries(
                connection,
                functools.partial(
                    _acquire_once, connection, demand, key, owner, ttl_seconds, lock_wait
                ),
            )
        except SemaphoreExhausted as exc:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if wait:
                    raise AcquireTimeout(exc.names, f"{exc} (waited {wait:g}s)") from None
                raise
            # Sleep with no transaction open and no row locked.
            time.sleep(min(remaining, _backoff(attempt)))
    raise AssertionError("unreachable")  # pragma: no cover


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
) -> PermitRequest:
    existing = _find_request(connection.alias, key)
    if existing is not None:
        return _reattach(connection.alias, existing, demand)
    with _prelocked(demand.names):
        try:
            with (
                backends.bounded_lock_wait(connection, lock_wait),
                transaction.atomic(using=connection.alias, durable=True),
            ):
                backends.start_bounded_transaction(connection, lock_wait)
                outcome = _grant(connection.alias, demand, key, owner, ttl)
        except IntegrityError:
            # Two first calls with one key: the unique key let one insert win;
            # the loser answers with the winner's request.
            existing = _find_request(connection.alias, key)
            if existing is None:
                raise
            return _reattach(connection.alias, existing, demand)
    # Raised only now, after the commit, so that a reclaim of expired
    # permits done while deciding is kept even when nothing was granted.
    if isinstance(outcome, SemaphoreError):
        raise outcome
    return outcome


@dataclass
class _LockedSemaphore:
    id: int
    name: str
    capacity: int
    fencing_counter: int


def _grant(
    alias: str, demand: Demand, key: str, owner: str, ttl: int | None
) -> PermitRequest | SemaphoreError:
    """Inside the transaction: lock, count, maybe reclaim, insert."""
    from django_semaphore.models import Permit, PermitRequest, Semaphore, State

    rows = list(
        Semaphore.objects.using(alias)
        .select_for_update()
        .filter(name__in=demand.names)
        .order_by("name")
        .annotate(db_now=DatabaseNow())
        .values_list("id", "name", "capacity", "fencing_counter", "db_now")
    )
    # A case- or accent-insensitive collation (MySQL's default) also matches
    # "EXPORTS" to the row "exports": names are exact, as Python compares them.
    rows = [row for row in rows if row[1] in demand.counts]
    if len(rows) != len(demand.names):
        return SemaphoreNotFound(set(demand.names) - {row[1] for row in rows})
    # Read once every row was locked: a TTL starts at the grant, not before the lock wait.
    now: datetime = backends.now_after_locking(connections[alias], max(row[4] for row in rows))
    locked = [_LockedSemaphore(*row[:4]) for row in rows]
    too_big = [s.name for s in locked if demand.counts[s.name] > s.capacity]
    if too_big:
        return CapacityExceeded(
            "Asked for more permits than the capacity of: " + ", ".join(too_big)
        )

    lacking = _lacking_room(alias, locked, demand)
    if lacking and _reclaim_expired(alias, [s.id for s in lacking], now):
        lacking = _lacking_room(alias, locked, demand)
    if lacking:
        return SemaphoreExhausted([s.name for s in lacking])

    request = PermitRequest.objects.using(alias).create(
        external_id=key,
        owner=owner,
        ttl=ttl,
        expires_at=None if ttl is None else now + timedelta(seconds=ttl),
        created_at=now,
    )
    permits = []
    for semaphore in locked:
        token = semaphore.fencing_counter + 1
        # This write is what keeps a multi-primary (Galera) cluster from
        # over-granting: row locks are node-local there, but two grants that
        # both write this row conflict at certification. Never drop it.
        Semaphore.objects.using(alias).filter(pk=semaphore.id).update(
            fencing_counter=token, updated_at=now
        )
        permits.append(
            Permit(
                semaphore_id=semaphore.id,
                request=request,
                count=demand.counts[semaphore.name],
                state=State.ACQUIRED,
                fencing_token=token,
            )
        )
    Permit.objects.using(alias).bulk_create(permits)
    request.__dict__["fencing_tokens"] = {
        s.name: p.fencing_token for s, p in zip(locked, permits, strict=True)
    }
    transaction.on_commit(
        lambda: signals.permit_acquired.send(sender=PermitRequest, request=request, using=alias),
        using=alias,
    )
    return request


def _lacking_room(
    alias: str, locked: list[_LockedSemaphore], demand: Demand
) -> list[_LockedSemaphore]:
    from django_semaphore.models import Permit, State

    # FOR UPDATE on the semaphore rows serializes grants; this plain read then
    # sees every permit committed before the lock was granted (Django runs
    # MySQL at READ COMMITTED; PostgreSQL takes a new snapshot per statement).
    in_use = dict(
        Permit.objects.using(alias)
        .filter(semaphore_id__in=[s.id for s in locked], state=State.ACQUIRED)
        .values("semaphore_id")
        .annotate(total=Sum("count"))
        .values_list("semaphore_id", "total")
        .order_by()
    )
    return [s for s in locked if in_use.get(s.id, 0) + demand.counts[s.name] > s.capacity]


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
    from django_semaphore.models import PermitRequest, ReleaseReason, State

    key = validate_key(external_id)
    connection = connections[app_settings.DATABASE]

    def attempt() -> ReleaseOutcome:
        row = (
            PermitRequest.objects.using(connection.alias)
            .filter(external_id=key)
            .values_list("pk", "state", "external_id")
            .first()
        )
        if row is None or row[2] != key:  # not another key equal by collation
            return ReleaseOutcome.NOT_FOUND
        pk, state, _ = row
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
    from django_semaphore.models import Permit, PermitRequest, State

    if not request_ids:
        return 0
    Permit.objects.using(alias).filter(request_id__in=request_ids, state=State.ACQUIRED).update(
        state=State.RELEASED
    )
    released = (
        PermitRequest.objects.using(alias)
        .filter(pk__in=request_ids, state=State.ACQUIRED)
        .update(
            state=State.RELEASED,
            released_at=DatabaseNow(),
            updated_at=DatabaseNow(),
            release_reason=reason,
        )
    )
    if released:
        ids = list(request_ids)
        transaction.on_commit(
            lambda: signals.permit_released.send(
                sender=PermitRequest, request_ids=ids, reason=reason, using=alias
            ),
            using=alias,
        )
    return released


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
    connection = connections[app_settings.DATABASE]
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
    connection = connections[app_settings.DATABASE]
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
    from django_semaphore.models import CapacityChange, Semaphore

    with transaction.atomic(using=alias):
        try:
            semaphore = Semaphore.objects.using(alias).select_for_update().get(name=name)
        except Semaphore.DoesNotExist:
            raise SemaphoreNotFound([name]) from None
        if semaphore.capacity != capacity:
            CapacityChange.objects.using(alias).create(
                semaphore=semaphore,
                old_capacity=semaphore.capacity,
                new_capacity=capacity,
                changed_by_id=None if changed_by is None else changed_by.pk,
                reason=reason,
            )
            semaphore.capacity = capacity
            semaphore.save(using=alias, update_fields=["capacity", "updated_at"])
    return semaphore


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
                raise SemaphoreError(f"Database error: {exc}") from exc
            failure, cause = failure_or_none, exc
        if failure is Failure.DISCONNECT and not connection.in_atomic_block:
            connection.close()  # the next statement reconnects
        if attempt == attempts:
            break
        time.sleep(random.uniform(0.01, 0.05) * attempt)
    if failure is Failure.DISCONNECT:
        raise DatabaseUnavailable(
            f"Database unavailable after {attempts} attempts: {cause}"
        ) from cause
    raise LockContention(f"Gave up after {attempts} attempts: {cause}") from cause


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
