"""A send's decision made aside, when its caller holds a transaction open.

The decision locks its semaphores' rows, and a lock taken inside the
caller's transaction is held until the caller commits: a view under
``ATOMIC_REQUESTS`` that sends, then works, would hold every grant,
release and send on those semaphores for the rest of its request. So the
decision runs on a connection of its own (a thread of this process, whose
Django connection it is), commits at once, and leaves the task's row
marked ``SENDING``; the caller's transaction then confirms it
(``admission``), and the message is published once that committed. Rolled
back, the confirmation is undone with it: the row stays ``SENDING``,
unlocked, and is dropped (``drop_abandoned``) by the sending process
within about ``ABANDONED_AFTER`` (``watch``), by the next send that finds
no room on its semaphores, or by the parked sweep if that process died.

SQLite is left alone (one writer at a time: a second connection would wait
for the caller's), and so is a test case's transaction, whose rows another
connection cannot see.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import TypeVar

from django.db import close_old_connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore import process
from django_semaphore.backends import DatabaseNow
from django_semaphore.models import ParkedTask, Ticket
from django_semaphore.models.parked import SENDING
from django_semaphore.parking import wake
from django_semaphore.parking.rows import drop_parked

T = TypeVar("T")

logger = logging.getLogger("django_semaphore")

# A row still SENDING this long after it was written, and not locked by its
# sender's transaction (which confirms it first thing, and holds that lock
# until it ends), is a rolled-back send's. A sender that stalled longer
# between the two finds its row gone, and decides again.
ABANDONED_AFTER = timedelta(seconds=1)

# Decisions a process makes aside at once; more sends wait their turn (each
# is one short transaction).
DECIDERS = 4


class _Deciders(process.State):
    """The threads whose connections decide aside, and the rows of this
    process's sends whose sender's transaction has not been seen to end."""

    def reset(self) -> None:
        self.pool = ThreadPoolExecutor(DECIDERS, thread_name_prefix="django-semaphore-send")
        self.lock = threading.Lock()
        self.sending: set[tuple[str, int]] = set()  # (alias, parked id)
        self.watcher: threading.Thread | None = None


_DECIDERS = _Deciders()


def needed(connection: BaseDatabaseWrapper) -> bool:
    """Whether a decision on ``connection`` must be made aside: its caller
    holds a transaction of its own open there."""
    return (
        connection.vendor != "sqlite"
        and connection.in_atomic_block
        # Django marks a test case's own atomic blocks so (TestCase, pytest-django's db).
        and not any(getattr(block, "_from_testcase", False) for block in connection.atomic_blocks)
    )


def decide(operation: Callable[[], T]) -> T:
    """Run ``operation`` on a thread of its own, with that thread's
    connections; its answer, or its exception."""
    return _DECIDERS.pool.submit(_on_fresh_connections, operation).result()


def _on_fresh_connections(operation: Callable[[], T]) -> T:
    """``operation``, with this thread's connections treated as a request's
    are: closed after it unless ``CONN_MAX_AGE`` keeps them, and replaced
    before it when broken or past their age."""
    close_old_connections()
    try:
        return operation()
    finally:
        close_old_connections()


def watch(alias: str, parked_id: int) -> None:
    """Drop this row of a send made aside soon after its sender's
    transaction rolls back: a thread of this process looks every
    ``ABANDONED_AFTER`` while such rows are left, and forgets a row once it
    is confirmed (or gone)."""
    with _DECIDERS.lock:
        _DECIDERS.sending.add((alias, parked_id))
        if _DECIDERS.watcher is None:
            _DECIDERS.watcher = threading.Thread(
                target=_watching, name="django-semaphore-sends", daemon=True
            )
            _DECIDERS.watcher.start()


def _watching() -> None:
    while True:
        time.sleep(ABANDONED_AFTER.total_seconds())
        with _DECIDERS.lock:
            rows = set(_DECIDERS.sending)
            if not rows:
                _DECIDERS.watcher = None
                return
        for alias in {alias for alias, _ in rows}:
            ids = [id for each, id in rows if each == alias]
            try:
                ended = _on_fresh_connections(lambda: _look(alias, ids))  # noqa: B023 (called now)
            except Exception:  # the database's errors: the next look, or the sweep, drops it
                logger.warning("Could not look at the sends of %s", alias, exc_info=True)
                continue
            with _DECIDERS.lock:
                _DECIDERS.sending -= {(alias, id) for id in ended}


def _look(alias: str, ids: list[int]) -> set[int]:
    """Drop those of these rows whose sender rolled back; those that need
    no more looking at (dropped, confirmed or gone)."""
    with transaction.atomic(using=alias):
        _, freed = drop_abandoned(alias, parked_ids=ids)
        sending = ParkedTask.objects.using(alias).filter(id__in=ids, not_before=SENDING)
        left = set(sending.values_list("id", flat=True))
    wake.wake(alias, freed)
    return set(ids) - left


def drop_abandoned(
    alias: str,
    semaphore_ids: Collection[int] | None = None,
    parked_ids: Collection[int] | None = None,
) -> tuple[int, set[int]]:
    """In the caller's transaction: drop the rows and tickets of the sends
    whose transaction rolled back (those waiting on these semaphores, or
    among these rows, or all); how many, and the semaphores whose room
    they kept."""
    sending = ParkedTask.objects.using(alias).filter(not_before=SENDING)
    if parked_ids is not None:
        sending = sending.filter(id__in=parked_ids)
    if semaphore_ids is not None:
        tickets = Ticket.objects.using(alias).filter(semaphore_id__in=semaphore_ids)
        waiting = tickets.filter(parked__not_before=SENDING).values_list("external_id", flat=True)
        # Read first: a locking read through a subquery would lock its rows too.
        sending = sending.filter(key__in=set(waiting))
    written_before = DatabaseNow() - ABANDONED_AFTER
    abandoned = sending.filter(parked_at__lt=written_before).select_for_update(skip_locked=True)
    keys = list(abandoned.values_list("key", flat=True))
    tickets = Ticket.objects.using(alias).filter(external_id__in=keys)
    freed = set(tickets.values_list("semaphore_id", flat=True))
    return drop_parked(alias, keys), freed
