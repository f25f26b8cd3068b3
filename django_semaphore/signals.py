"""Signals: the figures of every grant, wait, release and retry, for any
metrics system (``django_semaphore.metrics`` feeds Prometheus from them).

Every signal's sender is ``PermitRequest`` (``counter_drift``'s: ``Semaphore``);
``using`` is the database alias.
Signals about writes are sent only after the transaction that made them true
commits; the others are sent at once, when no transaction of the app is open.
Receivers run in the caller's thread: keep them quick, and never raise.
Each signal's keyword arguments are described below it.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.dispatch import Signal


@dataclass(frozen=True)
class Hold:
    """One released permit: which request, on which semaphore, how long."""

    request_id: int
    semaphore: str
    count: int
    seconds: float  # grant to release, both read from the database's clock


@dataclass(frozen=True)
class Drift:
    """A counter that differed from the permits it counts."""

    semaphore: str
    recorded: int  # what the counter said
    actual: int  # the sum of the permits' counts it counts, now the counter's value
    # "in_use": the permits held; "slots": a rate limit's slots not closed yet.
    counter: str = "in_use"

    def __str__(self) -> str:
        counted = "permits held" if self.counter == "in_use" else "slots granted"
        return f"{self.semaphore}: {self.counter} was {self.recorded}, {counted} {self.actual}"


# The signals; the payload types above are what two of them carry.

permit_acquired = Signal(use_caching=True)
"""A request was granted, once committed. ``request``: the new ACQUIRED
request, with ``fencing_tokens`` mapping each semaphore name to its token
(not sent for an idempotent repeat that granted nothing).
"""

acquire_finished = Signal(use_caching=True)
"""Once per ``acquire()`` call that ends in a grant or for want of room (not
for invalid arguments or database errors). ``names``: the semaphores
asked for, sorted; ``granted``: whether the call returned a held request
(new, or an idempotent repeat's); ``lacking``: the semaphores without room
when it was refused (empty when granted); ``waited``: seconds from the
call to its answer, on the monotonic clock.
"""

permit_released = Signal(use_caching=True)
"""Held requests ended, once committed. ``request_ids``: the requests that
were held and are now RELEASED; ``reason``: a ``ReleaseReason`` value
(``released``, ``expired``, ``owner_dead``, ``stale``, ``admin``). One
signal per release call or sweep batch.
"""

hold_ended = Signal(use_caching=True)
"""After ``permit_released``, only while a receiver is connected (it costs
one query on the released rows). ``holds``: a list of
``Hold`` (``request_id``, ``semaphore``, ``count``,
``seconds`` from grant to release by the database's clock), one per
released permit; ``reason``: as for ``permit_released``.
"""

database_retry = Signal(use_caching=True)
"""A transient database error is about to be retried. ``kind``: a
``backends.Failure`` value (``contention``: deadlock, lock wait timeout,
busy database, or this process's pre-lock; ``disconnect``: the connection
was lost); ``attempt``: the attempt that failed, from 1; ``error``: the
exception. The last attempt's error is raised, not signalled.
"""

counter_drift = Signal(use_caching=True)
"""The verifier found a semaphore's ``in_use`` counter differing from the
permits it counts (a bug, or rows changed outside the app). Sender:
``Semaphore`` (every other signal's is ``PermitRequest``). ``drift``: a
``Drift`` (``semaphore``, ``recorded``,
``actual``); ``corrected``: whether the counter was set to ``actual``.
"""

data_repaired = Signal(use_caching=True)
"""The orphan sweep repaired a state the engine did not write (a manual
edit, a restore from backup, a crash, foreign key checks switched off).
``kind``: ``partly_released`` (held requests with released permits,
completed; ``ids`` are request ids), ``stray_permits`` (held permits of
released requests, released; permit ids), ``orphan_permits`` (held
permits with no request row, released; permit ids) or
``fencing_counters`` (counters below a token already issued, raised;
semaphore ids); ``count``: how many were repaired. Sent after the repair
commits, one per sweep batch; the same is logged at WARNING.
"""
