"""Real concurrent clients (threads and processes, each with its own database
connection) checked against an independent oracle: a counter of holders kept
outside the database, never trusting the app's own bookkeeping."""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from django.db import connections

from django_semaphore import acquire, release
from django_semaphore.exceptions import SemaphoreExhausted
from django_semaphore.models import Permit, PermitRequest, Semaphore, State

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

FORK = multiprocessing.get_context("fork")
CLIENTS = 8
DURATION = 3.0


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
            guard=FORK.Lock(),
            holders={name: FORK.Value("i", 0, lock=False) for name in names},
            peak={name: FORK.Value("i", 0, lock=False) for name in names},
            entries=FORK.Queue(),
            errors=FORK.Queue(),
            sequence=FORK.Value("i", 0, lock=False),
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


def hammer(oracle: Oracle, demands: list[Any], duration: float) -> None:
    """Acquire, hold briefly, release, until ``duration`` is over."""
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


def run_clients(mode: str, target: Callable[..., None], args: tuple[Any, ...]) -> None:
    connections.close_all()  # a forked child must not share the parent's socket
    if mode == "threads":
        workers: list[Any] = [threading.Thread(target=target, args=args) for _ in range(CLIENTS)]
    else:
        workers = [FORK.Process(target=target, args=args) for _ in range(CLIENTS)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert not worker.is_alive(), "a client hung"
        if mode == "processes":
            assert worker.exitcode == 0


def held_now(name: str) -> int:
    return Semaphore.objects.with_usage().get(name=name).in_use


@pytest.mark.parametrize("mode", ["threads", "processes"])
@pytest.mark.parametrize("capacity", [1, 3])
def test_never_more_holders_than_capacity(make_semaphore, mode, capacity):
    name = make_semaphore(capacity=capacity).name
    oracle = Oracle.create([name])

    run_clients(mode, hammer, (oracle, [{name: 1}], DURATION))

    assert oracle.drain(oracle.errors) == []
    entries = oracle.drain(oracle.entries)
    assert len(entries) > 20, "too few grants to mean anything"
    assert 1 <= oracle.peak[name].value <= capacity
    tokens = [token for _, _, token in entries]
    assert len(set(tokens)) == len(tokens), "a fencing token was handed out twice"
    if capacity == 1:
        # With one holder at a time, entry order is grant order.
        assert tokens == sorted(tokens), "fencing tokens went backwards"
    assert held_now(name) == 0


@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_multi_semaphore_requests_in_opposite_orders(make_semaphore, mode):
    a, b = make_semaphore(capacity=2).name, make_semaphore(capacity=3).name
    oracle = Oracle.create([a, b])
    demands = [[a, b], [b, a], {b: 2, a: 1}, {a: 1}, {b: 1}]

    run_clients(mode, hammer, (oracle, demands, DURATION))

    assert oracle.drain(oracle.errors) == []  # no deadlock ever surfaced
    assert oracle.peak[a].value <= 2
    assert oracle.peak[b].value <= 3
    # All-or-nothing: every request spanning both holds a permit on each.
    both = PermitRequest.objects.filter(permits__semaphore__name=a).filter(
        permits__semaphore__name=b
    )
    assert both.exists()
    for request in PermitRequest.objects.filter(owner="hammer").prefetch_related("permits"):
        assert request.permits.all(), "a request without permits"
    assert held_now(a) == held_now(b) == 0


def race_one_key(name: str, key: str, barrier: Any, results: Any) -> None:
    try:
        barrier.wait(timeout=30)
        results.put(acquire(name, external_id=key).pk)
    except Exception as exc:
        results.put(f"{type(exc).__name__}: {exc}")
    finally:
        connections.close_all()


@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_racers_on_one_key_are_granted_once(make_semaphore, mode):
    name = make_semaphore(capacity=CLIENTS).name
    for _ in range(3):
        key = uuid.uuid4().hex
        barrier, results = FORK.Barrier(CLIENTS), FORK.Queue()

        run_clients(mode, race_one_key, (name, key, barrier, results))

        answers = [results.get(timeout=10) for _ in range(CLIENTS)]
        request = PermitRequest.objects.get(external_id=key)
        assert answers == [request.pk] * CLIENTS
        assert Permit.objects.filter(request=request).count() == 1
    assert held_now(name) == 3
    assert Permit.objects.filter(semaphore__name=name, state=State.ACQUIRED).count() == 3
