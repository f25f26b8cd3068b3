"""One heartbeat per process: the leases this process holds, renewed together.

Every holder the library manages (``permit()``, ``@holds_permit``) holds a
lease: a TTL that the holder's process keeps pushing forward while it works.
A process killed with SIGKILL stops pushing, and its permits come back when
the lease runs out, inline at the next acquire of those semaphores.

One daemon thread per process renews every lease it holds, in one UPDATE
per database alias, every ``min(ttl) / 3`` seconds; it idles (and closes its
connections) while the process holds none. A holder registers with
:func:`hold` (or ``permit()``, which does it) and is told through
``Lease.lost`` when its permit was found gone, or could not be renewed for a
whole TTL. A forked child (a Celery prefork pool process) starts with an
empty registry and no thread.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections
from django.db.models import Case, DateTimeField, F, QuerySet, When
from django.db.models.functions import Greatest

from django_semaphore import process
from django_semaphore.backends import DatabaseNow
from django_semaphore.conf import app_settings
from django_semaphore.exceptions import InvalidRequest, SemaphoreError
from django_semaphore.models import PermitRequest
from django_semaphore.retry import run_with_retries
from django_semaphore.states import State
from django_semaphore.validation import validate_ttl

if TYPE_CHECKING:
    from collections.abc import Collection

logger = logging.getLogger("django_semaphore")


class DefaultLease(enum.Enum):
    """The type of :data:`LEASE`, the ``ttl`` default of ``permit()`` and
    ``@holds_permit``: "the ``LEASE`` setting, read when the permit is taken"."""

    SETTING = "the LEASE setting"


# ``ttl=LEASE``: the ``DJANGO_SEMAPHORE["LEASE"]`` setting (60 s by default).
LEASE = DefaultLease.SETTING


def lease_seconds(ttl: Any) -> int | None:
    """Whole seconds of a holder's ``ttl``: :data:`LEASE` reads the setting,
    ``None`` is no expiry, anything else is validated as ``acquire`` does.

    Raises:
        InvalidRequest: a malformed ``ttl``.
    """
    return validate_ttl(app_settings.LEASE if ttl is LEASE else ttl)


class Lease:
    """One held request whose expiry the process heartbeat pushes forward."""

    def __init__(self, key: str, ttl: int, alias: str) -> None:
        self.key = key
        self.ttl = ttl
        self.alias = alias
        # Set by the heartbeat: the permit was found released or expired, or
        # no renewal succeeded for a whole TTL (it may have been reclaimed).
        self.lost = False
        self.renewed_at = time.monotonic()

    def drop(self) -> None:
        """Stop renewing (before releasing, or when the work is done); safe to repeat."""
        HEARTBEAT.drop(self)

    def __repr__(self) -> str:
        return f"<Lease {self.key!r} ttl={self.ttl} on {self.alias!r}>"


def hold(request: PermitRequest) -> Lease:
    """Have this process's heartbeat renew ``request`` until ``lease.drop()``.

    For the raw ``acquire()``, whose ``ttl`` nothing renews (``permit()``
    does this itself)::

        request = acquire("exports", external_id=key, ttl=60)
        lease = leases.hold(request)
        try:
            ...  # check lease.lost before a write that needs the permit
        finally:
            lease.drop()
            release(key)

    Args:
        request: a held request with a ``ttl``, as ``acquire`` returns it.

    Returns:
        The ``Lease``: ``lost`` turns true when the permit was found gone.

    Raises:
        InvalidRequest: the request has no ``ttl`` (nothing to renew).
    """
    if request.ttl is None:
        raise InvalidRequest(
            f"Request {request.external_id!r} has no ttl: it never expires, there is "
            "no lease to renew. Acquire it with a ttl."
        )
    return HEARTBEAT.hold(request.external_id, request.ttl, str(request._state.db))


class Heartbeat(process.State):
    """The registry of this process's leases and the thread that renews them."""

    def reset(self) -> None:
        """Forget every lease and thread: in a forked child, the parent's are
        not this process's (and its thread did not survive the fork)."""
        self._changed = threading.Condition()
        self._leases: dict[str, dict[str, Lease]] = {}  # alias -> key -> lease
        self._due: float | None = None  # monotonic time of the next beat; None: idle
        self._thread: threading.Thread | None = None

    def hold(self, key: str, ttl: int, alias: str) -> Lease:
        lease = Lease(key, ttl, alias)
        with self._changed:
            self._leases.setdefault(alias, {})[key] = lease
            due = time.monotonic() + ttl / 3
            self._due = due if self._due is None else min(self._due, due)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="semaphore-heartbeat", daemon=True
                )
                self._thread.start()
            self._changed.notify()
        return lease

    def drop(self, lease: Lease) -> None:
        with self._changed:
            self._forget(lease)

    def _forget(self, lease: Lease) -> bool:
        """Remove ``lease`` (the lock held); whether it was registered."""
        held = self._leases.get(lease.alias, {})
        if held.get(lease.key) is not lease:
            return False
        del held[lease.key]
        if not held:
            del self._leases[lease.alias]
        if not self._leases:
            self._due = None
            self._changed.notify()  # to idle, closing its connections
        return True

    @property
    def holding(self) -> int:
        """How many leases this process holds."""
        with self._changed:
            return sum(len(held) for held in self._leases.values())

    def _run(self) -> None:
        while True:
            self._wait_until_due()
            self.beat()

    def _wait_until_due(self) -> None:
        with self._changed:
            while True:
                if self._due is None:
                    connections.close_all()  # this thread's own, not a holder's
                    self._changed.wait()
                    continue
                remaining = self._due - time.monotonic()
                if remaining <= 0:
                    return
                self._changed.wait(remaining)

    def beat(self) -> None:
        """Renew every lease held now: one statement per alias."""
        with self._changed:
            batches = {alias: list(held.values()) for alias, held in self._leases.items()}
            shortest = min((lease.ttl for held in batches.values() for lease in held), default=0)
            self._due = time.monotonic() + shortest / 3 if shortest else None
        for alias, held in batches.items():
            self._renew_on(alias, held)

    def _renew_on(self, alias: str, held: list[Lease]) -> None:
        connection = connections[alias]
        started = time.monotonic()
        try:
            renewed = run_with_retries(connection, functools.partial(_renew, alias, held))
            # Only a renewal that fell short reads which keys it missed.
            ttls = None
            if renewed < len(held):
                ttls = run_with_retries(connection, functools.partial(_held_ttls, alias, held))
        except SemaphoreError as exc:
            self._failed(held, exc)
            return
        with self._changed:
            for lease in held:
                if ttls is None or ttls.get(lease.key) == lease.ttl:
                    lease.renewed_at = started
                elif lease.key not in ttls:
                    self._lose(lease, "it was released or expired")
                else:
                    # Held, with a ttl ``renew()`` changed: renewed with it now.
                    lease.ttl = ttls[lease.key]
                    self._due = time.monotonic()

    def _failed(self, held: list[Lease], exc: SemaphoreError) -> None:
        """A beat that did not get through: tried again at the next one, but a
        lease not renewed for a whole TTL may have been reclaimed meanwhile."""
        now = time.monotonic()
        with self._changed:
            for lease in held:
                if now - lease.renewed_at >= lease.ttl:
                    self._lose(lease, f"no renewal succeeded for {lease.ttl}s ({exc})")
                else:
                    logger.info("Renewing %s failed, will retry: %s", lease.key, exc)

    def _lose(self, lease: Lease, why: str) -> None:
        # Only a lease still registered: one its holder dropped was released
        # by that holder, which is why the row is found gone.
        if self._forget(lease):
            lease.lost = True
            logger.warning("Permit %s lost while held: %s", lease.key, why)


def _renew(alias: str, held: Collection[Lease]) -> int:
    """``expires_at = now + ttl`` for every lease in ``held``, in one UPDATE:
    how many rows it renewed.

    Conditional on still being held and unexpired by the database's clock (a
    lapsed permit is never revived), and never shortening an expiry pushed
    further by someone else (a task's permit kept across its retry).
    """
    ttls = sorted({lease.ttl for lease in held})
    renewed = Case(
        *(When(ttl=ttl, then=DatabaseNow() + timedelta(seconds=ttl)) for ttl in ttls),
        output_field=DateTimeField(),
    )
    return (
        _still_held(alias, held)
        .filter(ttl__in=ttls)
        .update(expires_at=Greatest(F("expires_at"), renewed), updated_at=DatabaseNow())
    )


def _held_ttls(alias: str, held: Collection[Lease]) -> dict[str, int]:
    """Key -> ttl of the rows of ``held`` still held, read when a renewal fell
    short: a key missing from it was lost."""
    still = _still_held(alias, held).values_list("external_id", "ttl")
    return {key: ttl for key, ttl in still if ttl is not None}


def _still_held(alias: str, held: Collection[Lease]) -> QuerySet[PermitRequest]:
    """The rows of ``held`` still held and unexpired by the database's clock."""
    return PermitRequest.objects.using(alias).filter(
        external_id__in=[lease.key for lease in held],
        state=State.ACQUIRED,
        expires_at__gt=DatabaseNow(),
    )


HEARTBEAT = Heartbeat()
# A Celery prefork child (any fork) starts with no leases and no thread.
