"""What the grant's reads return: the locked rows, and why there is no room."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from django_semaphore.limits import Limit


@dataclass
class LockedSemaphore:
    """A semaphore row as the grant's locking read returned it."""

    id: int
    name: str
    capacity: int
    in_use_counter: int
    released_folded: int
    fencing_counter: int
    queued_until: Any  # as the driver returns it; fairness converts it if it is set
    queue_live: Any  # queued_until is ahead of the database's clock (true, false or NULL)
    window: int | None  # seconds: a rate limit (see ``limit``)
    slots_open: int
    slots_closed_until: datetime | None  # when the slots that ended were last closed
    # Its ReleaseCounter's total, as read with the lock (MariaDB reads it
    # once the lock is granted; PostgreSQL: 0, see ``_released_with_the_lock``)
    # or again by ``read_released``.
    released: int = 0

    @property
    def held(self) -> int:
        """The permits held, or more (see ``held``)."""
        return held(self.in_use_counter, self.released_folded, self.released)

    @property
    def limit(self) -> Limit:
        return Limit(self.capacity, self.window)

    @property
    def in_use(self) -> int:
        """What counts against the capacity, or more: the grant closes a rate
        limit's ended slots when it finds no room, and once a window."""
        return self.limit.in_use(self.held, self.slots_open)

    @property
    def folded(self) -> int:
        """What ``released_folded`` becomes when the grant writes the row."""
        return max(self.released, self.released_folded)


@dataclass
class Usage:
    """What the grant reads, only when there is no room, to say why."""

    now: datetime  # the database's clock
    key_taken: bool  # a request has the key (or one the collation calls equal)
    expired: bool  # an expired request holds one of the semaphores


# The locking read's columns: ``LockedSemaphore``'s fields in their order,
# but the release total (``Statements._released_with_the_lock``).
LOCKED_COLUMNS = tuple(field.name for field in fields(LockedSemaphore) if field.name != "released")


def held(counted: int, folded: int, released: int) -> int:
    """The permits held on a semaphore: its ``in_use_counter`` less the
    releases its ``ReleaseCounter`` counted since the last fold (a release
    total read before that fold counts nothing), never below zero. The one
    formula: the routines (``grant_routine.py``), the ORM's ``in_use``
    (``managers.held``) and the verifier say the same."""
    return max(counted - max(released - folded, 0), 0)
