"""``permit()``: hold permits for a block of code, sync or async, under a
lease that the process's heartbeat (``leases``) renews while the block runs."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async

from django_semaphore import api
from django_semaphore.exceptions import PermitLost, PermitNotEntered
from django_semaphore.integrations.leases import LEASE, DefaultLease, Lease, hold, lease_seconds
from django_semaphore.owners import caller_owner
from django_semaphore.validation import validate_flag, validate_key, warn_fair

if TYPE_CHECKING:
    from django_semaphore.models import PermitRequest


class HeldPermit:
    """What ``with permit(...) as grant`` yields: the request, its fencing
    tokens, and whether the permit was lost while the block ran."""

    def __init__(self, acquire_args: dict[str, Any], renews: bool) -> None:
        self._acquire_args = acquire_args  # api.acquire's, as permit() checked them
        self._renews = renews
        self._lease: Lease | None = None
        self.request: PermitRequest | None = None

    @property
    def external_id(self) -> str:
        return str(self._acquire_args["external_id"])

    @property
    def lost(self) -> bool:
        return self._lease is not None and self._lease.lost

    def token(self, name: str) -> int:
        """The fencing token of the permit on ``name``.

        Raises:
            NameNotHeld: no permit on ``name`` is held (also a ``KeyError``).
            PermitNotEntered: called before the ``with`` block was entered.
        """
        if self.request is None:
            raise PermitNotEntered("The permit is not held: use it inside its with block.")
        return self.request.token(name)

    def _acquire(self) -> None:
        self.request = api.acquire(**self._acquire_args)
        if self._renews and self.request.ttl is not None:
            # Registering is a dict write under a lock: no database, no
            # thread or task of its own, in sync and async code alike.
            self._lease = hold(self.request)

    def _release(self) -> None:
        try:
            if self._lease is not None:
                self._lease.drop()  # first: a renewal would find it released
        finally:
            api.release(self.external_id)

    def _raise_if_lost(self) -> None:
        if self.lost:
            raise PermitLost(
                f"The permit {self.external_id!r} was lost (expired or revoked) while held; "
                "work done under it may have overlapped another holder's."
            )

    def __enter__(self) -> HeldPermit:
        self._acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._release()
        self._raise_if_lost()

    async def __aenter__(self) -> HeldPermit:
        await sync_to_async(self._acquire)()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await sync_to_async(self._release)()
        self._raise_if_lost()


def permit(
    names: Any,
    *,
    external_id: str | None = None,
    owner: str = "",
    ttl: int | float | timedelta | DefaultLease | None = LEASE,
    timeout: int | float | timedelta = 0,
    heartbeat: bool = True,
    priority: int = 0,
    share: str | int | None = None,
    fair: bool | None = None,
) -> HeldPermit:
    """Hold permits for a ``with`` (or ``async with``) block.

    Acquires on entry and releases on exit, also when the block raises. The
    permits are held under a lease (``ttl``, the ``LEASE`` setting by
    default) that this process's one heartbeat renews about every ttl/3
    while the block runs (``leases``; no thread or task per permit), so a
    process killed mid-block gives them back when the lease runs out. If the
    permit is lost meanwhile, leaving the block raises ``PermitLost``.

    ``names``, ``owner``, ``ttl``, ``timeout``, ``priority`` and ``share`` are as for
    [`acquire`][django_semaphore.acquire], and so is every error raised on entry
    (the block does not run then).

    Args:
        names: the semaphores, and how many permits of each.
        external_id: the idempotency key; a fresh UUID by default.
        owner: who holds the permits, for the admin and the liveness sweep;
            empty: ``module.qualname on host pid N started T`` of the caller.
        ttl: the lease, renewed while ``heartbeat`` is on: ``LEASE`` (the
            setting, 60 s by default), seconds or a ``timedelta``; ``None``
            never expires.
        timeout: how long to wait for room on entry.
        heartbeat: renew the TTL while the block runs.
        priority: where it stands in line while it waits, -100 to 100.
        share: its share key while it waits (docs/shares.md).
        fair: deprecated, ignored: every call that waits waits in line.

    Returns:
        A [`HeldPermit`][django_semaphore.integrations.context.HeldPermit], entered by ``with``.

    Raises:
        PermitLost: on exit, when the permit was lost while the block ran.
    """
    warn_fair(fair)
    acquire_args = {
        "names": names,
        "external_id": uuid.uuid4().hex if external_id is None else validate_key(external_id),
        "owner": caller_owner() if owner == "" else owner,
        "ttl": lease_seconds(ttl),
        "timeout": timeout,
        "priority": priority,
        "share": share,
    }
    return HeldPermit(acquire_args, validate_flag(heartbeat, "heartbeat"))
