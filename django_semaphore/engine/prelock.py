"""The in-process pre-lock: one database connection per semaphore waits in a
lock queue, however many threads of this process want it.

N threads of one process waiting on one semaphore then hold one connection
in a row-lock wait, not N. Correctness never depends on it: the row lock
decides.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from django_semaphore import process
from django_semaphore.conf import app_settings
from django_semaphore.exceptions import PrelockTimeout


class Prelocks(process.State):
    """One lock per semaphore name this process has used."""

    def reset(self) -> None:
        self.guard = threading.Lock()
        self.by_name: dict[str, threading.Lock] = {}


PRELOCKS = Prelocks()


@contextmanager
def prelocked(names: Sequence[str]) -> Iterator[None]:
    """Hold the per-name in-process locks around a grant transaction.

    Locks are kept for the life of the process (one per semaphore name this
    process has used), taken in sorted order, as the rows are.
    """
    timeout = app_settings.PRELOCK_TIMEOUT
    held: list[threading.Lock] = []
    try:
        for name in names:
            with PRELOCKS.guard:
                lock = PRELOCKS.by_name.setdefault(name, threading.Lock())
            if not lock.acquire(timeout=timeout):
                raise PrelockTimeout(name)
            held.append(lock)
        yield
    finally:
        for lock in reversed(held):
            lock.release()
