"""Client processes and threads for the concurrency tests, and their oracle.

Spawned children import this module once Django is set up
(``tests.children.ChildStart``).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import connections

from django_semaphore import acquire, release
from django_semaphore.engine import releasing
from django_semaphore.exceptions import SemaphoreExhausted
from tests.children import SPAWN, Outbox, join, spawn, start_threads

if TYPE_CHECKING:
    from django_semaphore.models import PermitRequest

CLIENTS = 8
# A client works for seconds; one still running after this has hung.
CLIENT_BOUND = 120.0


@dataclass
class Oracle:
    """Shared across threads and forked processes alike."""

    guard: Any
    holders: dict[str, Any]  # semaphore name -> holders right now
    peak: dict[str, Any]  # semaphore name -> most holders ever seen at once
    entries: Outbox  # (semaphore, entry sequence, fencing token) of every grant
    errors: Outbox  # unexpected exceptions, as text
    sequence: Any

    @classmethod
    def create(cls, names: list[str]) -> Oracle:
        return cls(
            guard=SPAWN.Lock(),
            holders={name: SPAWN.Value("i", 0, lock=False) for name in names},
            peak={name: SPAWN.Value("i", 0, lock=False) for name in names},
            entries=Outbox.create(),
            errors=Outbox.create(),
            sequence=SPAWN.Value("i", 0, lock=False),
        )

    def enter(self, request: PermitRequest, names: list[str]) -> None:
        with self.guard:
            for name in names:
                self.holders[name].value += 1
                self.peak[name].value = max(self.peak[name].value, self.holders[name].value)
                self.sequence.value += 1
                self.entries.put((name, self.sequence.value, request.token(name)))

    def leave(self, names: list[str]) -> None:
        with self.guard:
            for name in names:
                self.holders[name].value -= 1


def hammer(oracle: Oracle, demands: list[Any], duration: float, by_key: bool = True) -> None:
    """Acquire, hold briefly, release, until ``duration`` is over: by key
    (MariaDB's and PostgreSQL's one statement), or by request id (the
    general path of the sweeps and force releases)."""
    deadline = time.monotonic() + duration
    try:
        while time.monotonic() < deadline:
            demand = random.choice(demands)
            names = sorted(demand)
            key = uuid.uuid4().hex
            try:
                request = acquire(demand, external_id=key, owner="hammer")
            except SemaphoreExhausted:
                time.sleep(random.uniform(0, 0.003))
                continue
            oracle.enter(request, names)
            time.sleep(random.uniform(0.002, 0.01))  # long enough to overlap
            oracle.leave(names)
            if by_key:
                release(key)
            else:
                releasing.release_requests(request._state.db, [request.pk], "released")
    except Exception as exc:
        oracle.errors.put(f"{type(exc).__name__}: {exc}")
    finally:
        connections.close_all()


def never_refused(oracle: Oracle, demand: dict[str, int], duration: float) -> None:
    """Acquire without waiting and release at once, until ``duration`` is
    over: each client holds at most one request, so with a capacity of at
    least the number of clients every refusal is an error."""
    deadline = time.monotonic() + duration
    try:
        while time.monotonic() < deadline:
            key = uuid.uuid4().hex
            request = acquire(demand, external_id=key, owner="never-refused")
            oracle.enter(request, sorted(demand))
            oracle.leave(sorted(demand))
            release(key)
    except Exception as exc:
        oracle.errors.put(f"{type(exc).__name__}: {exc}")
    finally:
        connections.close_all()


def take_slots(demand: dict[str, int], duration: float, errors: Outbox) -> None:
    """Take and release at once, waiting up to half a second for room,
    until ``duration`` is over: a rate limit's clients (its grants are
    checked afterwards, by their requests' stamps)."""
    deadline = time.monotonic() + duration
    try:
        while time.monotonic() < deadline:
            try:
                key = uuid.uuid4().hex
                acquire(demand, external_id=key, owner="take-slots", timeout=0.5)
                release(key)
            except SemaphoreExhausted:
                pass
    except Exception as exc:
        errors.put(f"{type(exc).__name__}: {exc}")
    finally:
        connections.close_all()


def run_clients(mode: str, target: Callable[..., None], args: tuple[Any, ...]) -> None:
    """``CLIENTS`` threads or spawned processes running ``target(*args)``, until
    all are done (a hung one fails the test)."""
    if mode == "threads":
        workers = start_threads(target, args, CLIENTS)
    else:
        workers = [spawn(target, *args, bound=CLIENT_BOUND) for _ in range(CLIENTS)]
    join(workers, within=CLIENT_BOUND + 10)


def race_one_key(name: str, key: str, barrier: Any, results: Outbox) -> None:
    try:
        barrier.wait(timeout=30)
        results.put(acquire(name, external_id=key).pk)
    except Exception as exc:
        results.put(f"{type(exc).__name__}: {exc}")
    finally:
        connections.close_all()


def hold_until_killed(name: str, lease: int, outbox: Outbox) -> None:
    """Holds ``name`` in a ``permit()`` block under a ``lease``-second lease,
    says which key, and sleeps until it is killed."""
    from django.test import override_settings

    from django_semaphore import permit

    with override_settings(DJANGO_SEMAPHORE={"LEASE": lease}), permit(name) as grant:
        outbox.put(grant.external_id)
        time.sleep(CLIENT_BOUND)
