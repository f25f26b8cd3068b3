"""Spawned clients for the Galera tests, each connected to one node of the cluster.

Like ``tests.clients``, imported by spawned children before Django is set up,
so it imports nothing that needs the app registry at module level.
"""

from __future__ import annotations

import os
import random
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tests.children import SPAWN
from tests.clients import Oracle

URLS_VARIABLE = "SEMAPHORE_GALERA_URLS"


def node_addresses() -> list[tuple[str, int]]:
    """(host, port) of each node, from what ``scripts/servers.py start galera`` exports."""
    urls = [url for url in os.environ.get(URLS_VARIABLE, "").split(",") if url]
    if len(urls) < 3:
        raise RuntimeError(
            f"{URLS_VARIABLE} must list the 3 Galera nodes' URLs: run "
            '`eval "$(python3 scripts/servers.py start galera)"` first.'
        )
    return [(urlsplit(url).hostname or "127.0.0.1", urlsplit(url).port or 3306) for url in urls]


@dataclass
class Tally:
    """Counts summed over every client process."""

    attempts: Any
    grants: Any
    conflicts: Any  # grant transactions failed by a deadlock / certification failure
    gave_up: Any  # acquires that ended in LockContention after every retry

    @classmethod
    def create(cls) -> Tally:
        return cls(*(SPAWN.Value("q", 0) for _ in range(4)))

    def add(self, **counts: int) -> None:
        for name, count in counts.items():
            value = getattr(self, name)
            with value.get_lock():
                value.value += count


def hammer_node(
    oracle: Oracle,
    capacities: dict[str, int],
    duration: float,
    stop: Any,
    tally: Tally,
    fence_write: bool,
) -> None:
    """A spawned client on one node (``tests.children.spawn`` with the node's
    address): acquire, hold briefly, release, until ``duration`` is over or
    another client saw an over-grant (``stop``).

    ``fence_write=False`` removes the grant's write to the semaphore row, for
    the regression check that proves that write is what keeps Galera safe.
    """
    from django_semaphore import acquire, backends, release
    from django_semaphore.engine import statements
    from django_semaphore.exceptions import LockContention, SemaphoreExhausted
    from django_semaphore.models import Semaphore

    if not fence_write:
        _remove_semaphore_row_write(statements.Statements)
    counts = {"attempts": 0, "grants": 0, "conflicts": 0, "gave_up": 0}
    classify = backends.classify

    def counting_classify(connection: Any, exc: Any) -> Any:
        failure = classify(connection, exc)
        if failure is backends.Failure.CONTENTION:
            counts["conflicts"] += 1
        return failure

    backends.classify = counting_classify  # type: ignore[assignment]
    names = sorted(capacities)
    with _client(oracle, tally, counts):
        _wait_until_replicated(Semaphore, names)
        deadline = time.monotonic() + duration
        while time.monotonic() < deadline and not stop.is_set():
            demand = {random.choice(names): 1}
            key = uuid.uuid4().hex
            counts["attempts"] += 1
            try:
                request = acquire(demand, external_id=key, owner="galera")
            except SemaphoreExhausted:
                time.sleep(random.uniform(0, 0.003))
                continue
            except LockContention:
                counts["gave_up"] += 1
                continue
            counts["grants"] += 1
            oracle.enter(request, list(demand))
            if any(oracle.peak[name].value > capacities[name] for name in demand):
                stop.set()
            time.sleep(random.uniform(0.002, 0.01))  # long enough to overlap
            oracle.leave(list(demand))
            release(key)


@contextmanager
def _client(oracle: Oracle, tally: Tally, counts: dict[str, int]) -> Iterator[None]:
    """A client's run: its errors to the oracle, its counts to the tally, its
    connections closed. As docs/clusters.md advises for clients of one
    semaphore on several nodes, conflicts are retried from a larger budget,
    and so are those the client reads as a garbled answer (error 2000, a
    DatabaseUnavailable once three attempts in a row met one: seen once in a
    CI run)."""
    from django.conf import settings
    from django.db import connections
    from django.test import override_settings

    more_retries = override_settings(
        DJANGO_SEMAPHORE={**settings.DJANGO_SEMAPHORE, "RETRY_ATTEMPTS": 10}
    )
    more_retries.enable()
    try:
        yield
    except Exception as exc:
        oracle.errors.put(f"{type(exc).__name__}: {exc}")
    finally:
        more_retries.disable()
        tally.add(**counts)
        connections.close_all()


def _wait_until_replicated(model: Any, names: list[str]) -> None:
    # Replication to the other nodes is asynchronous after the commit on the
    # first: a client on node 3 may start before the semaphores reach it.
    deadline = time.monotonic() + 30
    while model.objects.filter(name__in=names).count() < len(names):
        if time.monotonic() > deadline:
            raise RuntimeError(f"semaphores {names} never replicated to this node")
        time.sleep(0.05)


def _remove_semaphore_row_write(statements: Any) -> None:
    """The grant without its write to the semaphore row (the in-use count
    and the fencing counter), and fencing tokens that never collide (the seed used the permit's
    auto-increment id). Without the second part every grant after the first
    would fail on the unique (semaphore, token) index instead, which is a
    conflict Galera certifies too, and the check would prove nothing. Every
    grant goes the general way (the routine writes the row itself)."""
    from django_semaphore.engine.statements.one_trip import OneTripStatements

    OneTripStatements.applies = lambda self: False  # type: ignore[method-assign]
    insert_permits = statements.insert_permits

    def insert_uncoordinated(self: Any, cursor: Any, rows: Any) -> None:
        rows = [
            (semaphore, request, count, random.getrandbits(62), slot_ends)
            for semaphore, request, count, _, slot_ends in rows
        ]
        insert_permits(self, cursor, rows)

    statements.count_grant = lambda self, cursor, *counts: None
    statements.insert_permits = insert_uncoordinated


class _Sent:
    """What the oracle records of a send: it has no fencing token."""

    def token(self, name: str) -> int:
        return 0


def send_on_node(
    oracle: Oracle, name: str, duration: float, stop: Any, tally: Tally, guard_write: bool
) -> None:
    """A spawned client on one node: send a task of ``on_conflict="discard"``
    on the capacity-1 ``name`` (its publish replaced: no broker); when it is
    sent, run it here as a worker would (its permit claimed under its task
    id, its parked row ended, held a little, released), until ``duration``
    is over or another client saw two sent at once (``stop``).

    ``guard_write=False`` removes the send's write to the semaphore row, for
    the regression check that proves that write is what keeps Galera's sends
    one at a time.
    """
    from django_semaphore import acquire, parking, release
    from django_semaphore.engine.statements.tickets import TicketStatements
    from django_semaphore.exceptions import LockContention, SemaphoreExhausted
    from django_semaphore.models import Semaphore
    from django_semaphore.owners import TaskOwner
    from django_semaphore.parking import wake
    from tests import tasks

    wake.publish = lambda alias, ids: len(ids)  # type: ignore[assignment]
    if not guard_write:
        TicketStatements.queue_until = lambda self, *args: None  # type: ignore[method-assign]
    counts = {"attempts": 0, "grants": 0, "conflicts": 0, "gave_up": 0}
    with _client(oracle, tally, counts):
        _wait_until_replicated(Semaphore, [name])
        deadline = time.monotonic() + duration
        while time.monotonic() < deadline and not stop.is_set():
            task_id = uuid.uuid4().hex
            counts["attempts"] += 1
            try:
                result = tasks.once.apply_async(("galera", 0), task_id=task_id)
            except LockContention:
                counts["gave_up"] += 1
                continue
            if result.id != task_id:  # discarded: told the one sent
                time.sleep(random.uniform(0, 0.003))
                continue
            counts["grants"] += 1
            oracle.enter(_Sent(), [name])  # type: ignore[arg-type]
            if oracle.peak[name].value > 1:
                stop.set()
            me = TaskOwner(task_id, tasks.once.name, socket.gethostname(), os.getpid())
            try:
                acquire({name: 1}, external_id=task_id, owner=str(me))
            except SemaphoreExhausted:
                held = False  # two were sent at once: this run would wait
            else:
                held = True
            parking.started(task_id, {name: 1})
            time.sleep(random.uniform(0.002, 0.01))
            oracle.leave([name])
            if held:
                release(task_id)
