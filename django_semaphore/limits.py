"""A semaphore's limit, one object for both kinds: at most ``capacity``
holders at once (a concurrency limit), or at most ``capacity`` grants in
any ``window`` seconds, released or not (a rate limit, docs/rates.md).

What counts against the capacity, whether a holder's release (or its
lease running out) frees room, when a grant's slot ends and when ended
slots are closed are the limit's to say: the engine, the probes and the
console ask it instead of testing for a window each on their own."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

# A rate's units, largest first, as ``__str__`` writes them.
UNITS = (("h", 3600), ("min", 60), ("s", 1))


@dataclass(frozen=True)
class Limit:
    """A value: two semaphores with equal limits compare equal (``save()``
    and ``semaphore_sync`` compare what is stored with what is asked)."""

    capacity: int
    window: int | None = None  # seconds: a rate limit

    @property
    def is_rate(self) -> bool:
        """Grants count until their window ends: a release, or an expired
        holder reclaimed, frees no room; the next slot can be foretold."""
        return self.window is not None

    def in_use(self, held: int, slots_open: int, slots_ended: int = 0) -> int:
        """What counts against the capacity: the permits held, or on a rate
        limit the slots open less those that ended and are not closed yet.
        The grant and the probes count so; ``managers.in_use`` is the same
        for the ORM."""
        return held if self.window is None else slots_open - slots_ended

    def slot_ends(self, now: datetime, closed_until: datetime | None) -> datetime | None:
        """The end of the slot a grant at ``now`` takes: a window later, and
        after the last close of the slots whatever the clock did (a slot
        ending before it would never be closed). ``None``: no slot."""
        if self.window is None:
            return None
        ends = now + timedelta(seconds=self.window)
        return ends if closed_until is None else max(ends, closed_until + timedelta(microseconds=1))

    def closing_due(self, now: datetime, closed_until: datetime | None) -> bool:
        """Whether a grant closes the ended slots though it has room: once a
        window at least, so that reading ``in_use`` (which subtracts the
        slots ended and not closed yet) never reads more than about a
        window's grants."""
        if self.window is None:
            return False
        return closed_until is None or closed_until + timedelta(seconds=self.window) <= now

    def __str__(self) -> str:
        """As people write it (and ``validation.parse_limit`` reads it): the
        capacity, or a rate in its window's largest whole unit: "3",
        "100/s", "5/min", "3/10s", "1000/2h"."""
        if self.window is None:
            return str(self.capacity)
        unit, seconds = next((u, s) for u, s in UNITS if self.window % s == 0)
        multiple = self.window // seconds
        return f"{self.capacity}/{multiple if multiple > 1 else ''}{unit}"
