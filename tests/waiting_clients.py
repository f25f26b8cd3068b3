"""Spawned clients of the waiting tests, and what they report."""

from __future__ import annotations

import time
import uuid
from typing import Any

from django.db import connections

from django_semaphore import acquire, release, waiting
from django_semaphore.exceptions import AcquireTimeout
from django_semaphore.waiting import listening, waiters
from tests.children import Outbox

# Probes and attempts so slow that only a wake-up can grant within a test.
SLOW = 60.0


def cycle(name: str, start: Any, seconds: float, hold: float, grants: Outbox) -> None:
    """Acquire (waiting), hold, release, again, for ``seconds``
    from when every client is ready (``start``, a barrier); report
    (grants, timeouts, the longest wait) of this process."""
    start.wait(timeout=60)
    granted = timeouts = 0
    longest = 0.0
    stop_at = time.monotonic() + seconds
    try:
        while time.monotonic() < stop_at:
            key = uuid.uuid4().hex
            asked = time.monotonic()
            try:
                acquire(name, external_id=key, owner="cycle", timeout=10)
            except AcquireTimeout:
                timeouts += 1
                continue
            finally:
                longest = max(longest, time.monotonic() - asked)
            time.sleep(hold)
            release(key)
            granted += 1
    finally:
        grants.put((granted, timeouts, longest))
        connections.close_all()


def wait_slowly(name: str, ready: Any, waited: Outbox) -> None:
    """Wait for ``name`` with probes and attempts ``SLOW`` apart, so that
    only a notification can grant it in time; report how long it waited."""
    for constant in ("PROBE_EVERY", "NEXT_IN_LINE_ATTEMPT", "POLL_CAP"):
        setattr(waiting, constant, SLOW)
    waiting.PROBE_BOUNDS = (SLOW, SLOW)
    key = uuid.uuid4().hex
    started = time.monotonic()

    def queued() -> None:
        # Told once this process waits and listens.
        deadline = time.monotonic() + 30
        while not listening.LISTENER.listening("default") and time.monotonic() < deadline:
            time.sleep(0.01)
        ready.set()

    real = waiters.WAITERS.wait_turn

    def turn(waiter: Any, timeout: float) -> bool:
        queued()
        return real(waiter, timeout)

    waiters.WAITERS.wait_turn = turn  # type: ignore[method-assign]
    try:
        acquire(name, external_id=key, owner="slow", timeout=30)
        waited.put(time.monotonic() - started)
        release(key)
    except AcquireTimeout:
        waited.put(None)
    finally:
        connections.close_all()


# The application_name of the listener's direct connection, in pg_stat_activity.
DIRECT = "semaphore-direct"


def wait_listening_directly(name: str, ready: Any, waited: Outbox) -> None:
    """``wait_slowly`` with ``default`` behind a transaction pooler, as far as
    the app can tell, and ``semaphores`` (the same test database, its
    connection named ``DIRECT``) named for listening."""
    from django.test.utils import override_settings

    default = connections["default"].settings_dict
    default["DISABLE_SERVER_SIDE_CURSORS"] = True
    connections["semaphores"].settings_dict.update(
        NAME=default["NAME"], OPTIONS={**default["OPTIONS"], "application_name": DIRECT}
    )
    with override_settings(DJANGO_SEMAPHORE={"LISTEN_DATABASES": {"default": "semaphores"}}):
        wait_slowly(name, ready, waited)
