"""The public operations, one function each: acquire, release, renew,
set_capacity, set_window and force_release (the admin and the commands call them too).

A thin layer over the engine: it validates the arguments (nothing is written
for a malformed call), picks the database alias, waits for room when asked
to (``waiting``), retries what is safe to retry and sends the signals. The
transactions themselves are the engine's (``engine/grant.py``,
``engine/releasing.py``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import EllipsisType
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Q

from django_semaphore import conf, parking, routing, signals, waiting
from django_semaphore.backends import DatabaseNow
from django_semaphore.conf import app_settings
from django_semaphore.engine import fairness, families, grant
from django_semaphore.engine.capacity import Limits, change_limits
from django_semaphore.engine.releasing import release_key, release_requests
from django_semaphore.exceptions import (
    InvalidRequest,
    NestedTransactionError,
    PermitAlreadyReleased,
    PermitNotFound,
    SemaphoreExhausted,
)
from django_semaphore.models import PermitRequest, Semaphore
from django_semaphore.owners import caller_owner
from django_semaphore.retry import run_with_retries
from django_semaphore.states import ReleaseOutcome, ReleaseReason, State
from django_semaphore.validation import (
    Demand,
    validate_capacity,
    validate_demand,
    validate_key,
    validate_keys,
    validate_name,
    validate_owner,
    validate_priority,
    validate_share,
    validate_timeout,
    validate_ttl,
    validate_window,
    warn_fair,
)

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser

# A release locks the semaphore rows, so it meets contention too (on Galera,
# certification conflicts with grants on other nodes). One that gives up
# leaves its permits held until their TTL, and repeating it is always safe:
# it insists longer than an acquire, whose caller can try again.
RELEASE_PERSISTENCE = 4


# --- acquire -----------------------------------------------------------------


def acquire(
    names: Any,
    *,
    external_id: str,
    owner: str = "",
    ttl: int | float | timedelta | None = None,
    timeout: int | float | timedelta = 0,
    priority: int = 0,
    share: str | int | None = None,
    fair: bool | None = None,
) -> PermitRequest:
    """Grant permits on every named semaphore, or on none of them.

    A rate limit (a semaphore with a ``window``) among them is granted like
    any other, in the same transaction; its permits count against it until
    their window ends, released or not (docs/rates.md).

    Args:
        names: ``"exports"``, ``["exports", "network"]`` or ``{"exports": 2}``.
        external_id: the caller's idempotency key (job id, task id, UUID). A
            repeated call with the same key and demand returns the same request.
        owner: who holds the permits, for operators and liveness checkers;
            empty: ``module.qualname on host pid N started T`` of the caller.
        ttl: seconds (or a ``timedelta``) after which the permits may be
            reclaimed unless renewed; ``None`` never expires. Nothing renews
            it: hand the request to ``leases.hold`` to have this process's
            heartbeat do so, or use ``permit()``, which holds a lease itself.
        timeout: seconds to wait for room; 0 fails fast. A caller that waits
            waits in line, first come, first served: it takes a ticket, and
            nobody is granted ahead of an older live ticket on any of its
            semaphores (docs/fairness.md).
        priority: where a caller that waits stands in line: -100 to 100,
            higher first (Django's tasks' convention); a head start of
            ``PRIORITY_STEP`` per point over those that came before it.
        share: the share key of a caller that waits (a customer's id, a
            tenant): the keys waiting on a semaphore are served in turn, by
            their ``SHARE_WEIGHTS``, rather than first come, first served
            (docs/shares.md). ``None``: none; it waits by when it came.
        fair: deprecated, ignored: every call that waits waits in line.

    Returns:
        The ACQUIRED ``PermitRequest``; ``fencing_tokens`` maps each name to
        the token of its permit.

    Raises:
        InvalidRequest: a malformed argument (nothing is written);
            ``CrossShardRequest`` when the names live on different aliases;
            a family's pattern given as a name.
        SemaphoreNotFound: a name has no semaphore, and no family's pattern
            matches it (a name one matches is created on first use).
        FamilyFull: creating a member would exceed its family's ``max_members``.
        CapacityExceeded: a count larger than the capacity settings declare
            (beyond a capacity lowered since, or 0, it is refused for now).
        SemaphoreExhausted: no room now (``AcquireTimeout`` once ``timeout`` ran out);
            its ``retry_after`` says when a rate limit's next slot frees.
        IdempotencyConflict: the key was used with other names or counts.
        PermitAlreadyReleased: the key's request was released or expired.
        NestedTransactionError: called inside ``atomic()`` on the app's alias.
        LockContention, DatabaseUnavailable: retries did not get through.
        InconsistentData: the tables hold rows the engine did not write
            (run the orphan sweep); ``SchemaOutOfDate``: run ``migrate``.
    """
    demand = validate_demand(names)
    families.refuse_patterns(demand.names)
    key = validate_key(external_id)
    owner = validate_owner(owner) or caller_owner()
    ttl_seconds = validate_ttl(ttl)
    wait = validate_timeout(timeout)
    priority = validate_priority(priority)
    share = validate_share(share)
    warn_fair(fair)
    connection = connections[routing.alias_for_names(demand.names)]
    _refuse_outer_transaction(connection)

    deadline = time.monotonic() + wait
    ask = fairness.Ask(key, owner, demand, deadline if wait else None, priority, share)

    def attempt(ask: fairness.Ask, standing: fairness.Standing) -> PermitRequest | fairness.Refusal:
        lock_wait = app_settings.LOCK_WAIT_TIMEOUT
        if wait:
            # A waiter never sits in a lock queue past its own deadline.
            lock_wait = min(lock_wait, max(deadline - time.monotonic(), 1.0))
        return run_with_retries(
            connection,
            functools.partial(
                grant.acquire_once, connection, ask, standing, ttl_seconds, lock_wait
            ),
        )

    with _finish_signalled(connection, demand):
        outcome = attempt(ask, fairness.Standing())
        if isinstance(outcome, fairness.Refusal):
            if not wait:
                raise outcome.error
            # Its tickets, taken by the refusal, keep its place while it waits.
            outcome = waiting.wait_for_room(
                connection, attempt, ask, outcome.standing, wait, deadline, outcome.error
            )
    waiting.granted(connection.alias, key, demand.names)
    return outcome


@contextmanager
def _finish_signalled(connection: BaseDatabaseWrapper, demand: Demand) -> Iterator[None]:
    """Send ``acquire_finished`` when the call is answered: granted, or refused
    for want of room (other errors send nothing). Robust: a failing receiver
    is logged by Django, never raised into a caller who may hold the permit."""
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


def release(external_id: str) -> ReleaseOutcome:
    """End the request with this key -- on every alias that has one (a key
    used on two shards); safe to repeat.

    Returns:
        ``RELEASED`` if this call ended it (on any alias), ``ALREADY_RELEASED``
        if it had ended before (released, expired or revoked), ``NOT_FOUND``
        otherwise.
    """
    key = validate_key(external_id)
    return _over_aliases(
        [_release_on(connections[alias], key) for alias in routing.aliases_for_key(key)]
    )


def _over_aliases(outcomes: Iterable[ReleaseOutcome]) -> ReleaseOutcome:
    """A key's outcome over the aliases with a request under it: ``RELEASED``
    if one was ended now, else ``ALREADY_RELEASED`` if one had ended (the
    members' own order)."""
    return min(outcomes, key=list(ReleaseOutcome).index, default=ReleaseOutcome.NOT_FOUND)


def _release_on(connection: BaseDatabaseWrapper, key: str) -> ReleaseOutcome:
    outcome, freed = run_with_retries(
        connection,
        functools.partial(release_key, connection, key, parking.enabled()),
        persistence=RELEASE_PERSISTENCE,
    )
    if outcome is ReleaseOutcome.RELEASED:
        _woken(connection, key, freed)
    return outcome


def _woken(connection: BaseDatabaseWrapper, key: str, freed: dict[int, int]) -> None:
    """The one wake path of a committed release, in order: this process's
    waiters, the other processes' (NOTIFY on PostgreSQL), parked tasks."""
    waiting.released(connection, key)
    parking.room_made(connection.alias, freed)


def renew(external_id: str, ttl: int | float | timedelta | None = None) -> PermitRequest:
    """Push the request's expiry to now + ``ttl`` (default: its own ttl), on
    every alias that has a request with this key (a key used on two shards).

    Returns:
        The request renewed (of several, the one on the first alias, ``DATABASE`` first).

    Raises:
        PermitAlreadyReleased: it (or one of them) was released or had
            expired; the holder has lost permits and must stop.
            ``PermitNotFound`` (a subclass) when no request has this key.
    """
    key = validate_key(external_id)
    ttl_seconds = validate_ttl(ttl)
    renewed = [_renew_on(alias, key, ttl_seconds) for alias in routing.aliases_for_key(key)]
    return renewed[0]


def _renew_on(alias: str, key: str, ttl_seconds: int | None) -> PermitRequest:
    def attempt() -> PermitRequest:
        request = grant.find_request(alias, key)
        if request is None:
            raise PermitNotFound(f"No permit request has the key {key!r}.")
        grant.raise_if_not_held(alias, request)
        new_ttl = ttl_seconds or request.ttl
        if new_ttl is None:
            return request
        expires_at = request.db_now + timedelta(seconds=new_ttl)  # type: ignore[attr-defined]
        # Conditional on still being held and unexpired by the database's
        # clock: a lapsed permit is never silently revived.
        held = PermitRequest.objects.using(alias).filter(pk=request.pk, state=State.ACQUIRED)
        unexpired = held.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=DatabaseNow()))
        if not unexpired.update(ttl=new_ttl, expires_at=expires_at, updated_at=DatabaseNow()):
            raise PermitAlreadyReleased(f"Request {key!r} ended while being renewed.")
        request.ttl, request.expires_at = new_ttl, expires_at
        return request

    return run_with_retries(connections[alias], attempt)


# --- capacity ----------------------------------------------------------------


def set_capacity(
    name: str,
    capacity: int,
    *,
    window: int | timedelta | EllipsisType | None = ...,
    changed_by: AbstractBaseUser | None = None,
    reason: str = "",
) -> Semaphore:
    """Change a semaphore's capacity -- and its window, when one is given --
    under its row lock, in one transaction recorded as one change.

    Lowering below what is in use is allowed: the semaphore is over capacity
    and grants nothing until usage falls; held permits are never revoked.
    Runs in the caller's transaction if there is one (the admin's save).

    A family member changed this way keeps its own capacity from then on
    (the clean-up keeps it too). Changing a family's pattern changes the
    family default: once committed, the members that follow it are changed
    too, in batches, each recorded in their history.

    Args:
        window: left out, the window stays as it is; else as for
            ``set_window``, changed together with the capacity: no grant
            ever sees the new capacity with the old window (``"50/h"`` on a
            concurrency limit of 2 is never a concurrency limit of 50).

    Raises:
        InvalidRequest: a malformed name, capacity, window or reason, or a
            ``changed_by`` that is not a saved user; nothing is changed.
        SemaphoreNotFound: no semaphore has this name.
    """
    limits: Limits = {"capacity": validate_capacity(capacity)}
    if window is not ...:
        limits["window"] = validate_window(window)
    return _change(name, limits, changed_by, reason)


def set_window(
    name: str,
    window: int | timedelta | None,
    *,
    changed_by: AbstractBaseUser | None = None,
    reason: str = "",
) -> Semaphore:
    """Make a semaphore a rate limit -- at most ``capacity`` grants in any
    ``window`` seconds -- or, with ``None``, a concurrency limit again;
    under its row lock, recorded in its capacity history.

    A window set or changed counts the grants made from then on (each slot
    keeps the end it was granted with); removed, it ends every slot and
    the holders count again. Runs in the caller's transaction if there is
    one; family members and defaults as for ``set_capacity`` (which changes
    a capacity and a window together).

    Raises:
        InvalidRequest: a malformed name or reason, a window that is not
            whole seconds from 1 to a day (or ``None``), or a
            ``changed_by`` that is not a saved user; nothing is changed.
        SemaphoreNotFound: no semaphore has this name.
    """
    return _change(name, {"window": validate_window(window)}, changed_by, reason)


def _change(
    name: str, limits: Limits, changed_by: AbstractBaseUser | None, reason: Any
) -> Semaphore:
    from django.contrib.auth import get_user_model

    name = validate_name(name)
    reason = validate_owner(reason, field="reason")
    if changed_by is not None and not (
        isinstance(changed_by, get_user_model()) and changed_by.pk is not None
    ):
        raise InvalidRequest(f"changed_by must be a saved user or None, not {changed_by!r}.")
    connection = connections[routing.alias_for_name(name)]
    semaphore = run_with_retries(
        connection, lambda: change_limits(connection.alias, name, limits, changed_by, reason)
    )
    # A raise, or a window set or removed, may make room (what counts
    # against the capacity changes: holders, or grants in the window).
    parking.room_made(connection.alias, [semaphore.pk])
    if conf.is_family_default(name):
        changed_by_id = None if changed_by is None else changed_by.pk
        why = reason or f"family default of {name}"

        def follow() -> None:
            run_with_retries(
                connection,
                lambda: families.follow_default(connection.alias, name, changed_by_id, why),
            )

        # Members are changed after the default's own change is committed:
        # at once, or when the caller's transaction (the admin's) commits.
        transaction.on_commit(follow, using=connection.alias)
    return semaphore


def force_release(keys: Iterable[str], reason: str | None = None) -> dict[str, ReleaseOutcome]:
    """End the requests with these keys on an operator's behalf, whatever
    their holders do: the admin's action and ``manage.py semaphore_release``
    call it. Their holders find out at their next renew or release.

    Args:
        keys: ``external_id`` values, ended on every alias that has them.
        reason: a ``ReleaseReason`` value (default ``admin``).

    Returns:
        key -> ``RELEASED`` (this call ended it), ``ALREADY_RELEASED`` or ``NOT_FOUND``.

    Raises:
        InvalidRequest: a key that no request could have, ``keys`` given as
            one str, or a ``reason`` that is not a ``ReleaseReason``; nothing
            is released.
    """
    keys = list(dict.fromkeys(validate_keys(keys)))
    if reason is not None and reason not in ReleaseReason.values:
        raise InvalidRequest(
            f"reason must be one of {', '.join(ReleaseReason.values)}, not {reason!r}."
        )
    found = [
        _force_release_on(alias, keys, reason or ReleaseReason.ADMIN) for alias in routing.aliases()
    ]
    return {key: _over_aliases(each[key] for each in found) for key in keys}


def _force_release_on(alias: str, keys: list[str], reason: str) -> dict[str, ReleaseOutcome]:
    """One alias's part: each request released in a transaction of its own,
    retried as ``release`` is (a request ends once, so a retry is safe)."""
    connection = connections[alias]
    requests = PermitRequest.objects.using(alias).filter(external_id__in=keys)
    rows = requests.values_list("external_id", "pk", "state")
    found = run_with_retries(connection, lambda: {key: (pk, state) for key, pk, state in rows})
    outcomes = dict.fromkeys(keys, ReleaseOutcome.NOT_FOUND)
    for key in keys:
        if key not in found:
            continue
        pk, state = found[key]
        outcomes[key] = ReleaseOutcome.ALREADY_RELEASED
        if state != State.ACQUIRED:
            continue
        released = run_with_retries(
            connection,
            functools.partial(release_requests, alias, [pk], reason),
            persistence=RELEASE_PERSISTENCE,
        )
        if released.ended:
            outcomes[key] = ReleaseOutcome.RELEASED
            _woken(connection, key, released.freed)
    return outcomes
