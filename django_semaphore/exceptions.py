"""Every error the app raises; driver errors are translated into these at the
boundary and never reach callers.

An error's ``args`` are its constructor's arguments, and its message comes
from ``__str__``: pickle and Celery's JSON result backend rebuild an error as
``cls(*args)``, so one that travels comes back with its message and fields.
"""

from __future__ import annotations

from collections.abc import Iterable


class SemaphoreError(Exception):
    """Base class of every error raised by django-semaphore."""


class InvalidRequest(SemaphoreError, ValueError):
    """An argument is malformed; raised before anything is written."""


class SemaphoreNotFound(SemaphoreError, LookupError):
    """One or more semaphore names do not exist."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = sorted(names)
        super().__init__(self.names)

    def __str__(self) -> str:
        return f"No such semaphore: {', '.join(self.names)}"


class SemaphoreExhausted(SemaphoreError):
    """No room right now; ``names`` lists the semaphores lacking capacity.

    ``retry_after``: seconds until the next slot of the rate limits
    (windowed semaphores) that refused frees, when that is all that was
    lacking and known (``None`` otherwise: a concurrency limit frees room
    when its holders release, which nobody can tell in advance).
    """

    def __init__(
        self, names: Iterable[str], message: str = "", retry_after: float | None = None
    ) -> None:
        self.names = sorted(names)
        self.retry_after = retry_after
        self.message = message or f"No capacity left on: {', '.join(self.names)}"
        if retry_after is not None and not message:
            self.message += f" (the next slot frees in {retry_after:.3g}s)"
        super().__init__()
        # Set, not passed up: OSError, a base of AcquireTimeout, would take two
        # arguments for errno and strerror.
        self.args = (self.names, message)

    def __str__(self) -> str:
        return self.message


class AcquireTimeout(SemaphoreExhausted, TimeoutError):
    """Still no room when the caller's ``timeout`` ran out."""


class FamilyFull(SemaphoreExhausted):
    """A family has its maximum number of live members: ``names`` were not
    created (idle members are deleted by the clean-up, making room)."""


class LineFull(SemaphoreExhausted):
    """A task found no room, and ``max_waiting`` tasks already wait parked
    on ``names``: it was refused, not parked (``holds_permit(max_waiting=...)``)."""


class PermitRefused(SemaphoreError):
    """A view's request got no permit: what ``DJANGO_SEMAPHORE["REFUSED_VIEW"]``
    is called with, ``view(request, exception)``, to render the answer. Never
    raised; its ``__cause__`` is the error that refused it.

    ``status``: ``VIEW_STATUS_CODE`` (429) when ``names`` lacked room, 503
    when the database could not be reached or stayed locked (``names`` empty).
    ``retry_after``: whole seconds the client is told to wait.
    """

    def __init__(self, status: int, retry_after: int, names: Iterable[str] = ()) -> None:
        self.status = status
        self.retry_after = retry_after
        self.names = sorted(names)
        super().__init__(status, retry_after, self.names)

    def __str__(self) -> str:
        if self.names:
            return f"No room on {', '.join(self.names)}: retry after {self.retry_after}s"
        return f"The semaphores could not be reached: retry after {self.retry_after}s"


class CrossShardRequest(InvalidRequest):
    """A request names semaphores placed on different database aliases."""


class CapacityExceeded(InvalidRequest):
    """A count asks for more than the semaphore could ever grant."""


class IdempotencyConflict(SemaphoreError):
    """An ``external_id`` was reused with other names or counts."""


class PermitAlreadyReleased(SemaphoreError):
    """The request is released (done, expired or revoked): the holder must stop."""


class PermitNotFound(PermitAlreadyReleased, LookupError):
    """No request has this ``external_id`` (never acquired, or long cleaned up)."""


class PermitLost(SemaphoreError):
    """A held permit was expired or revoked while its holder worked."""


class StaleFencingToken(SemaphoreError):
    """A fencing token lower than one already seen for the resource."""

    def __init__(self, resource: str, token: int, highest: int) -> None:
        self.resource = resource
        self.token = token
        self.highest = highest
        super().__init__(resource, token, highest)

    def __str__(self) -> str:
        return (
            f"Fencing token {self.token} for {self.resource!r} is stale: {self.highest} was seen."
        )


class NestedTransactionError(SemaphoreError, RuntimeError):
    """``acquire`` was called inside an open ``atomic()`` block on its alias."""


class LockContention(SemaphoreError, TimeoutError):
    """Deadlocks or lock-wait timeouts persisted through every retry."""


class DatabaseUnavailable(SemaphoreError, ConnectionError):
    """The database connection kept failing through every retry."""


class UnsafeWrite(SemaphoreError, ValueError):
    """An ORM write that would corrupt a semaphore; the message names the call to use."""


class PermitHeld(UnsafeWrite):
    """A delete that would end held permits behind their holders' backs."""


class WaitersInLine(UnsafeWrite):
    """A delete of a semaphore that waiters or parked tasks wait on:
    they would wait for a semaphore that is gone."""


class InconsistentData(SemaphoreError):
    """The app's own rows contradict each other (a manual edit, a restore): run the sweep."""


class SchemaOutOfDate(SemaphoreError):
    """The app's tables or columns are missing: its migrations are not applied."""


class MissingPrivilege(SemaphoreError, PermissionError):
    """The database user may not run the app's routines: the message names
    the GRANT to run."""


class LiveDuplicate(SemaphoreExhausted):
    """Another run of the same Celery task id, alive, holds its permit."""


class TaskAlreadyRan(SemaphoreError):
    """A copy of a Celery task that already finished for good (a parked task
    published twice): it is dropped, not run again."""


class TaskReplaced(SemaphoreError):
    """A waiting Django task dropped for a newer send of the same task
    (``holds_permit(on_conflict="replace")``): recorded as its result's
    failure, never run."""


class TaskDeferred(SemaphoreError):
    """A Django task's run found no room and was deferred in its backend:
    recorded by the worker as the run's end, then its result is ``READY``
    again and runs once room comes (``docs/django-tasks.md``). Not a
    failure of the task."""


class PrelockTimeout(Exception):
    """This process's pre-lock was not had in time. Never reaches callers:
    ``retry`` retries it as contention and raises ``LockContention`` at the
    end, which is why it is not a ``SemaphoreError``."""


class NameNotHeld(SemaphoreError, KeyError):
    """``token(name)`` of a name the request holds no permit on; ``held``
    lists the names it does hold."""

    def __init__(self, external_id: str, name: str, held: Iterable[str]) -> None:
        self.external_id = external_id
        self.name = name
        self.held = sorted(held)
        super().__init__(external_id, name, self.held)

    def __str__(self) -> str:
        held = ", ".join(repr(name) for name in self.held) or "nothing"
        return f"Request {self.external_id!r} holds no permit on {self.name!r}; it holds {held}."


class PermitNotEntered(SemaphoreError, RuntimeError):
    """A ``permit()`` used outside its ``with`` block: nothing is held yet."""
