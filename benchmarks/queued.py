"""Scenario 7: what waiting costs the database.

Threads of one process (this one, the driver) wait with ``timeout=`` on a
semaphore that the driver keeps full for the whole window, so none is ever
granted: every statement they issue is the price of waiting. Counted on the
client side, through Django's ``execute_wrapper``, per thread connection;
attempts (each one grant transaction, so one COMMIT more than its statements)
are counted at ``grant.acquire_once``. The window opens once every waiter has
made its first attempt, or queued behind this process's waiters without
one (connecting and compiling are not waiting), and closes before the first
gives up.

"lines off" has every waiter poll as if alone in its queue: the herd the
shared poller replaces.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# Seconds allowed for every waiter's first attempt: a base, and per waiter.
# The base covers a process's first grant (its statements compiled, its
# connection opened): 8 threads on SQLite, on a busy 2-core machine, once
# took 2.6 s to queue.
WARM_UP, WARM_UP_PER_THREAD = 3.0, 0.08


def measure_waiting(name: str, threads: int, seconds: float, *, lines: bool) -> dict[str, Any]:
    """``threads`` waiters on ``name`` (capacity 1): statements and attempts
    per second once all of them wait, for about ``seconds``."""
    from django.db import connection, connections

    from django_semaphore import acquire, release, waiting
    from django_semaphore.engine import grant
    from django_semaphore.exceptions import AcquireTimeout

    warm_up = WARM_UP + WARM_UP_PER_THREAD * threads
    holder = uuid.uuid4().hex
    acquire(name, external_id=holder, owner="bench holder")
    stamps: list[float] = []  # list.append is atomic: one list for all threads
    attempts: list[float] = []
    queued: list[float] = []  # when each waiter's first attempt ended
    errors: list[str] = []
    ready = threading.Barrier(threads + 1)
    local = threading.local()

    def count(execute: Callable[..., Any], *args: Any) -> Any:
        stamps.append(time.monotonic())
        return execute(*args)

    def waiter() -> None:
        connection.execute_wrappers.append(count)
        try:
            ready.wait()
            acquire(name, external_id=uuid.uuid4().hex, timeout=warm_up + seconds)
            errors.append("granted a permit that was never free")
        except AcquireTimeout:
            pass
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            connections.close_all()

    attempt, wait_for_room = grant.acquire_once, waiting.wait_for_room

    def mark_queued() -> None:
        if not getattr(local, "queued", False):
            local.queued = True
            queued.append(time.monotonic())

    def counted_attempt(*args: Any) -> Any:
        attempts.append(time.monotonic())
        try:
            return attempt(*args)
        finally:
            mark_queued()

    def counted_wait(*args: Any) -> Any:
        # A newcomer that finds this process's waiters ahead of it queues
        # behind them with no attempt of its own: it waits from here.
        mark_queued()
        return wait_for_room(*args)

    with (
        _patched(grant, "acquire_once", counted_attempt),
        _patched(waiting, "wait_for_room", counted_wait),
        _lines(waiting, lines),
    ):
        workers = [threading.Thread(target=waiter) for _ in range(threads)]
        for worker in workers:
            worker.start()
        ready.wait()
        start = time.monotonic()
        for worker in workers:
            worker.join()
    release(holder)
    steady = max(queued, default=start)
    end = start + warm_up + seconds - 0.1
    if end - steady < seconds / 2:
        errors.append(f"the waiters took {steady - start:.1f}s to queue: no window left")
    window = max(end - steady, 1e-9)
    return {
        "statements_per_s": round(sum(steady <= t < end for t in stamps) / window, 1),
        "attempts_per_s": round(sum(steady <= t < end for t in attempts) / window, 1),
        "window_s": round(window, 2),
        "queueing_statements": sum(t < steady for t in stamps),
        "errors": errors[:3],
    }


@contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


@contextmanager
def _lines(waiting: Any, shared: bool) -> Iterator[None]:
    """With ``shared=False`` every waiter polls as if alone in its queue."""
    if shared:
        yield
        return
    queues = _queues(waiting)
    if queues is not None:
        with _patched(queues, "has_turn", lambda waiter: True):
            yield
        return

    @contextmanager
    def alone(place: Any) -> Iterator[_AlwaysFirst]:
        yield _AlwaysFirst()

    # Before issue 26 (an A/B against an older checkout): one line per demand.
    with _patched(waiting, "waiting_line", alone):
        yield


def _queues(waiting: Any) -> Any:
    """This process's queues of waiters: in ``waiters``, in ``waiting``
    before it was split, None before issue 26 (one line per demand)."""
    try:
        from django_semaphore.waiting.waiters import WAITERS
    except ImportError:
        return getattr(waiting, "WAITERS", None)
    return WAITERS


class _AlwaysFirst:
    """A waiter's turn in a line of its own (before issue 26)."""

    def is_first(self) -> bool:
        return True

    def wait(self, timeout: float) -> bool:
        return True
