"""Client processes and threads for the concurrency tests, and their oracle.

Spawned children unpickle their target by importing this module before
Django is set up, so it imports nothing that needs the app registry.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import connection, connections

from django_semaphore import acquire, release, releasing
from django_semaphore.exceptions import SemaphoreExhausted

if TYPE_CHECKING:
    from django_semaphore.models import PermitRequest

# Spawned, not forked: forking a process that runs threads (queue feeders,
# Django's) can deadlock the child. Each child sets Django up on its own.
SPAWN = multiprocessing.get_context("spawn")
CLIENTS = 8


@dataclass
class Oracle:
    """Shared across threads and forked processes alike."""

    guard: Any
    holders: dict[str, Any]  # semaphore name -> holders right now
    peak: dict[str, Any]  # semaphore name -> most holders ever seen at once
    entries: Any  # queue of (semaphore, entry sequence, fencing token)
    errors: Any  # queue of unexpected exceptions, as text
    sequence: Any

    @classmethod
    def create(cls, names: list[str]) -> Oracle:
        return cls(
            guard=SPAWN.Lock(),
            holders={name: SPAWN.Value("i", 0, lock=False) for name in names},
            peak={name: SPAWN.Value("i", 0, lock=False) for name in names},
            entries=SPAWN.Queue(),
            errors=SPAWN.Queue(),
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

    def drain(self, queue: Any) -> list[Any]:
        items = []
        while not queue.empty():
            items.append(queue.get())
        return items


def nobody_wants_released_ids() -> bool:
    """In place of ``releasing.released_ids_wanted``: release takes its one
    statement (MariaDB, PostgreSQL) although the test settings' metrics app
    listens."""
    return False


def hammer(
    oracle: Oracle, demands: list[Any], duration: float, one_statement_release: bool = False
) -> None:
    """Acquire, hold briefly, release, until ``duration`` is over."""
    if one_statement_release:
        releasing.released_ids_wanted = nobody_wants_released_ids
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
            release(key)
    except Exception as exc:
        oracle.errors.put(f"{type(exc).__name__}: {exc}")
    finally:
        connections.close_all()


def in_child_process(database: dict[str, Any], target: Callable[..., None], *args: Any) -> None:
    """Entry point of a spawned client: Django on the test database, then work."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    connections["default"].settings_dict.update(database)
    target(*args)


def run_clients(mode: str, target: Callable[..., None], args: tuple[Any, ...]) -> None:
    if mode == "threads":
        workers: list[Any] = [threading.Thread(target=target, args=args) for _ in range(CLIENTS)]
    else:
        database = {"NAME": connection.settings_dict["NAME"]}
        workers = [
            SPAWN.Process(target=in_child_process, args=(database, target, *args))
            for _ in range(CLIENTS)
        ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert not worker.is_alive(), "a client hung"
        if mode == "processes":
            assert worker.exitcode == 0


def race_one_key(name: str, key: str, barrier: Any, results: Any) -> None:
    try:
        barrier.wait(timeout=30)
        results.put(acquire(name, external_id=key).pk)
    except Exception as exc:
        results.put(f"{type(exc).__name__}: {exc}")
    finally:
        connections.close_all()
