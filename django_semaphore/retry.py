"""Retrying what is safe to retry, and translating what is not.

Deadlocks, lock wait timeouts, a busy SQLite file and lost connections are
normal events: the operation is run again. Anything else leaves as a typed
``SemaphoreError``, never as a raw driver exception.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import Error
from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore import backends, signals
from django_semaphore.backends import Failure
from django_semaphore.conf import app_settings
from django_semaphore.exceptions import DatabaseUnavailable, LockContention, PrelockTimeout
from django_semaphore.models import PermitRequest

T = TypeVar("T")


def run_with_retries(
    connection: BaseDatabaseWrapper, operation: Callable[[], T], *, persistence: int = 1
) -> T:
    """Run ``operation``, retrying deadlocks, lock waits and lost connections.

    Safe because every operation is idempotent by its key: a grant whose
    COMMIT succeeded but whose answer was lost is found again by the retry.
    Inside the caller's transaction nothing is retried (the failure may have
    rolled it back), but the error is still translated. ``persistence``
    multiplies ``RETRY_ATTEMPTS``, for operations worth insisting on.
    """
    attempts = (
        1 if connection.in_atomic_block else max(1, app_settings.RETRY_ATTEMPTS * persistence)
    )
    attempt, fallbacks = 0, 0
    while attempt < attempts:
        attempt += 1
        try:
            return operation()
        except PrelockTimeout:
            failure = Failure.CONTENTION
            cause: Exception = LockContention("Timed out waiting for this process's pre-lock.")
        # Error: InterfaceError (a connection the driver gave up on) is no
        # DatabaseError (PEP 249 makes them siblings).
        except Error as exc:
            failure_or_none = backends.classify(connection, exc)
            if failure_or_none is None or (
                failure_or_none is Failure.ROUTINE_MISSING and connection.in_atomic_block
            ):
                raise backends.translate(connection, exc) from exc
            failure, cause = failure_or_none, exc
        if failure is Failure.ROUTINE_MISSING and fallbacks < 2:
            # Code newer than the database's migrations (a deploy in
            # progress): the attempt wrote nothing, and the next one, not
            # counted, takes the general path (and, where the tickets'
            # ranking is missing too, a second does without it).
            backends.note_routines_missing(connection, cause)  # type: ignore[arg-type]
            attempt, fallbacks = attempt - 1, fallbacks + 1
            continue
        if failure is Failure.DISCONNECT and not connection.in_atomic_block:
            # The next statement reconnects. Closing a connection the driver
            # already gave up on fails (InterfaceError (0, '')), yet Django
            # has let go of it all the same.
            with contextlib.suppress(Error):
                connection.close()
        if attempt == attempts:
            break
        signals.database_retry.send_robust(
            sender=PermitRequest,
            kind=failure.value,
            attempt=attempt,
            error=cause,
            using=connection.alias,
        )
        time.sleep(random.uniform(0.01, 0.05) * attempt)
    if failure is Failure.DISCONNECT:
        raise DatabaseUnavailable(
            f"Database unavailable after {attempts} attempts: {cause}"
        ) from cause
    raise LockContention(f"Gave up after {attempts} attempts: {cause}") from cause
