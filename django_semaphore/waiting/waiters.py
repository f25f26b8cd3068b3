"""This process's waiters for room, in one queue per alias and semaphore:
whose turn it is to poll, and whom a release wakes.

A process's waiters on a semaphore are in their tickets' order in line
(every waiter's refusal took its tickets): by where they rank, priority
included, then first come, first served. A waiter wants the
semaphores its last refusal named and holds back the waiters behind it only
on those, so one short on its own tenant's cap never keeps a neighbour from
a shared semaphore that has room. A waiter whose turn it is (nobody ahead of
it wants what it wants) is its semaphores' poller (``waiting``); the others
sleep until their turn. No database here: only memory and a condition.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from django_semaphore import process
from django_semaphore.engine.fairness import Ask, Standing


@dataclass(eq=False)
class Waiter:
    """One acquire call of this process waiting for room."""

    alias: str
    ask: Ask
    # Where its last attempt (or probe) left it in its semaphores' lines.
    standing: Standing
    wants: set[str]  # the names its last refusal named
    # Set to attempt at once: a release made room, or its poller left; with
    # ``probe_now``, to probe at once: a release in another process (NOTIFY).
    woken: threading.Event = field(default_factory=threading.Event)
    probe_now: bool = False
    # Its last attempt came because a probe saw room for it (and the tickets
    # ahead of it): refused all the same, it does not probe again at once.
    expected_room: bool = False
    every: float | None = None  # its probes' interval, kept between pauses
    grants: int | None = None  # the grants its last probe counted
    changed: float = field(default_factory=time.monotonic)  # when that last changed
    renewed: float = field(default_factory=time.monotonic)  # its tickets, last

    def order(self) -> tuple[float, int]:
        """Its place in the queues: its tickets' in line (``Standing.rank``,
        then ``seq``, taken with them in their transaction)."""
        return self.standing.rank, self.standing.seq


class Waiters(process.State):
    """This process's queues: (alias, semaphore name) -> its waiters."""

    def reset(self) -> None:
        """Forget every waiter: in a forked child, the parent's are not its own."""
        self.changed = threading.Condition()
        self.queues: dict[tuple[str, str], list[Waiter]] = {}

    @contextmanager
    def queued(
        self, alias: str, ask: Ask, standing: Standing, wants: Iterable[str]
    ) -> Iterator[Waiter]:
        """The call's waiter in the queue of each of its semaphores."""
        with self.changed:
            waiter = Waiter(alias, ask, standing, set(wants))
            for name in ask.demand.names:
                self.queues.setdefault((alias, name), []).append(waiter)
            self.changed.notify_all()
        granted_here = False
        try:
            yield waiter
            granted_here = True
        finally:
            with self.changed:
                for name in ask.demand.names:
                    queue = self.queues[(alias, name)]
                    queue.remove(waiter)
                    if not queue:
                        del self.queues[(alias, name)]
                if not granted_here:
                    # It may have been a poller: its successors attempt at once.
                    self._wake_pollers(alias, ask.demand.names)
                self.changed.notify_all()

    def has_turn(self, waiter: Waiter) -> bool:
        """Whether nobody ahead of ``waiter`` wants what it wants (the lock held)."""
        mine = waiter.order()
        return not any(
            other is not waiter and name in other.wants and other.order() < mine
            for name in waiter.wants
            for other in self.queues.get((waiter.alias, name), ())
        )

    def wait_turn(self, waiter: Waiter, timeout: float) -> bool:
        """Block until it is ``waiter``'s turn; ``False`` if ``timeout`` ran out first."""
        with self.changed:
            return self.changed.wait_for(lambda: self.has_turn(waiter), timeout=timeout)

    def refused(self, waiter: Waiter, names: Iterable[str]) -> None:
        """Its attempt was refused for want of ``names``: whom it holds back now."""
        with self.changed:
            waiter.wants = set(names) & set(waiter.ask.demand.names) or waiter.wants
            self.changed.notify_all()

    def renewals_due(self, alias: str, every: float) -> list[Waiter]:
        """The ticketed waiters on ``alias``, all renewed now, when one of
        them was renewed ``every`` seconds ago or more (else none): one
        renewal for all."""
        now = time.monotonic()
        with self.changed:
            waiters = {
                waiter
                for (on, _), queue in self.queues.items()
                if on == alias
                for waiter in queue
                if waiter.standing.ticketed
            }
            if all(now < waiter.renewed + every for waiter in waiters):
                return []
            for waiter in waiters:
                waiter.renewed = now
        return list(waiters)

    def waiting_on(self, alias: str) -> bool:
        """Whether this process waits on ``alias`` (the lock held)."""
        return any(key[0] == alias for key in self.queues)

    def room_made(self, alias: str, names: Iterable[str] | None, *, here: bool = True) -> None:
        """A release made room on ``names`` (None: on any of the alias): in
        this process (``here``: its poller attempts at once), or in another
        (a notification: its poller probes, unless it has tickets a
        capacity's worth ahead -- every process hears it, and those would
        only add a herd of reads)."""
        with self.changed:
            self._wake_pollers(alias, names, here=here)

    def notified(self, waiter: Waiter) -> bool:
        """Whether ``waiter`` was woken by a notification only (then it is
        not any more: it probes)."""
        with self.changed:
            if not waiter.probe_now:
                return False
            waiter.probe_now = False
            waiter.woken.clear()
            return True

    def _wake_pollers(self, alias: str, names: Iterable[str] | None, *, here: bool = True) -> None:
        """Wake the first waiter wanting each of ``names``, when it is its turn."""
        if names is None:
            names = [name for key_alias, name in self.queues if key_alias == alias]
        for name in names:
            wanting = [w for w in self.queues.get((alias, name), ()) if name in w.wants]
            if not wanting:
                continue
            first = min(wanting, key=Waiter.order)
            if not self.has_turn(first):
                continue
            if here:
                first.probe_now = False
                first.woken.set()
            elif not first.standing.rounds and not first.woken.is_set():
                first.probe_now = True
                first.woken.set()


WAITERS = Waiters()
