"""``permit()``: hold permits for a block of code, sync or async, renewing a
TTL in the background so long work can keep a short one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from django.db import connections

from django_semaphore import api
from django_semaphore.exceptions import PermitAlreadyReleased, PermitLost, SemaphoreError
from django_semaphore.validation import validate_flag, validate_key, validate_ttl

if TYPE_CHECKING:
    from django_semaphore.models import PermitRequest

logger = logging.getLogger("django_semaphore")


class Heartbeat:
    """Renews a request's TTL about every ttl/3 until stopped.

    Marks the grant lost when a renewal finds it released or expired, or when
    no renewal has succeeded for a whole TTL (the database was unreachable, so
    the permit may have been reclaimed meanwhile): the holder must not assume
    it still holds what it cannot prove it holds.
    """

    def __init__(self, external_id: str, ttl: int) -> None:
        self.external_id = external_id
        self.ttl = ttl
        self.interval = max(ttl / 3, 0.05)
        self.lost = False
        self._renewed_at = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None

    def beat(self) -> bool:
        """One renewal; returns whether to keep going."""
        try:
            api.renew(self.external_id, self.ttl)
        except PermitAlreadyReleased:
            self._mark_lost("it was released or expired")
            return False
        except SemaphoreError as exc:
            if time.monotonic() - self._renewed_at >= self.ttl:
                self._mark_lost(f"no renewal succeeded for {self.ttl}s ({exc})")
                return False
            logger.info("Renewing %s failed, will retry: %s", self.external_id, exc)
            return True
        self._renewed_at = time.monotonic()
        return True

    def _mark_lost(self, why: str) -> None:
        self.lost = True
        logger.warning("Permit %s lost while held: %s", self.external_id, why)

    # --- in a thread, for sync code ---

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"semaphore-heartbeat-{self.external_id}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval) and self.beat():
                pass
        finally:
            connections.close_all()  # this thread's own connection, not the caller's

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    # --- as a task, for async code ---

    def start_async(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run_async())

    async def _run_async(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if not await sync_to_async(self._beat_and_close, thread_sensitive=False)():
                return

    def _beat_and_close(self) -> bool:
        try:
            return self.beat()
        finally:
            connections.close_all()

    async def stop_async(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class HeldPermit:
    """What ``with permit(...) as grant`` yields: the request, its fencing
    tokens, and whether the permit was lost while the block ran."""

    def __init__(
        self,
        names: Any,
        *,
        external_id: str | None,
        owner: str,
        ttl: int | float | timedelta | None,
        timeout: int | float | timedelta,
        heartbeat: bool,
        fair: bool = False,
    ) -> None:
        self._acquire_args: dict[str, Any] = {
            "names": names,
            "external_id": uuid.uuid4().hex if external_id is None else validate_key(external_id),
            "owner": owner,
            "ttl": ttl,
            "timeout": timeout,
            "fair": fair,
        }
        ttl_seconds = validate_ttl(ttl)
        self._heartbeat = (
            Heartbeat(self._acquire_args["external_id"], ttl_seconds)
            if validate_flag(heartbeat, "heartbeat") and ttl_seconds is not None
            else None
        )
        self.request: PermitRequest | None = None

    @property
    def external_id(self) -> str:
        return str(self._acquire_args["external_id"])

    @property
    def lost(self) -> bool:
        return self._heartbeat is not None and self._heartbeat.lost

    def token(self, name: str) -> int:
        """The fencing token of the permit on ``name``."""
        if self.request is None:
            raise RuntimeError("The permit is not held: use it inside its with block.")
        return self.request.token(name)

    def _acquire(self) -> None:
        self.request = api.acquire(**self._acquire_args)

    def _release(self) -> None:
        api.release(self.external_id)

    def _raise_if_lost(self) -> None:
        if self.lost:
            raise PermitLost(
                f"The permit {self.external_id!r} was lost (expired or revoked) while held; "
                "work done under it may have overlapped another holder's."
            )

    def __enter__(self) -> HeldPermit:
        self._acquire()
        if self._heartbeat is not None:
            self._heartbeat.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if self._heartbeat is not None:
                self._heartbeat.stop()
        finally:
            self._release()
        self._raise_if_lost()

    async def __aenter__(self) -> HeldPermit:
        await sync_to_async(self._acquire)()
        if self._heartbeat is not None:
            self._heartbeat.start_async()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if self._heartbeat is not None:
                await self._heartbeat.stop_async()
        finally:
            await sync_to_async(self._release)()
        self._raise_if_lost()


def permit(
    names: Any,
    *,
    external_id: str | None = None,
    owner: str = "",
    ttl: int | float | timedelta | None = None,
    timeout: int | float | timedelta = 0,
    heartbeat: bool = True,
    fair: bool = False,
) -> HeldPermit:
    """Hold permits for a ``with`` (or ``async with``) block.

    Acquires on entry and releases on exit, also when the block raises. With a
    ``ttl`` and ``heartbeat=True`` the TTL is renewed about every ttl/3 from a
    background thread (a task under ``async with``) with its own connection;
    if the permit is lost meanwhile, leaving the block raises ``PermitLost``.

    ``names``, ``owner``, ``ttl``, ``timeout`` and ``fair`` are as for
    [`acquire`][django_semaphore.acquire], and so is every error raised on entry
    (the block does not run then).

    Args:
        names: the semaphores, and how many permits of each.
        external_id: the idempotency key; a fresh UUID by default.
        owner: who holds the permits, for the admin and the liveness sweep.
        ttl: the lease; renewed in the background while ``heartbeat`` is on.
        timeout: how long to wait for room on entry.
        heartbeat: renew the TTL while the block runs.
        fair: wait in line, first come first served.

    Returns:
        A [`HeldPermit`][django_semaphore.context.HeldPermit], entered by ``with``.

    Raises:
        PermitLost: on exit, when the permit was lost while the block ran.
    """
    return HeldPermit(
        names,
        external_id=external_id,
        owner=owner,
        ttl=ttl,
        timeout=timeout,
        heartbeat=heartbeat,
        fair=fair,
    )
