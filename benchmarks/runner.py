"""Client processes (or threads) that run one cell for a fixed duration.

A pool of spawned worker processes is started once, each with Django set up
on the benchmark database. For each cell every worker gets its clients,
connects them, reports ready; the driver then gives all of them one common
start and end time, so connecting and process start-up are never measured.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any

from benchmarks import roundtrips
from benchmarks.systems import APP_NO_PRELOCK, Client, ClientSpec, make_client

# Spawned, not forked: a forked child of a threaded parent can deadlock.
SPAWN = multiprocessing.get_context("spawn")
READY_TIMEOUT = 180.0
WARM_UP = 0.5  # seconds of unrecorded cycles before each cell's clock starts


@dataclass
class ClientResult:
    index: int
    cycles: int = 0
    rejections: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)  # seconds, granted acquires
    elapsed: float = 0.0
    cpu: float = 0.0  # this client's thread's CPU seconds over the measured window
    round_trips: int = 0  # statements this client's thread sent over the measured window


def client_loop(client: Client, warm: float, start: float, end: float) -> ClientResult:
    """acquire (timed) then release, until ``end``; a rejection is retried at once.

    From ``warm`` to ``start`` the same loop runs unrecorded: caches, the
    server's buffer pool and the lock queue reach their steady state first.
    """
    while time.time() < warm:
        time.sleep(0.001)
    while time.time() < start:
        try:
            if client.acquire():
                client.release()
        except Exception:
            pass  # counted only in the measured window
    result = ClientResult(index=client.spec.index)
    errors: Counter[str] = Counter()
    began, cpu, sent = time.perf_counter(), time.thread_time(), roundtrips.count()
    # One attempt at least, even by a client that reaches its window late (a
    # loaded machine): a cell whose clients all came late would measure nothing.
    while True:
        _attempt(client, result, errors)
        if time.time() >= end:
            break
    result.elapsed = time.perf_counter() - began
    result.cpu = time.thread_time() - cpu
    result.round_trips = roundtrips.count() - sent
    result.errors = dict(errors)
    return result


def _attempt(client: Client, result: ClientResult, errors: Counter[str]) -> None:
    """One timed acquire and, when granted, its release."""
    t0 = time.perf_counter()
    try:
        granted = client.acquire()
    except Exception as exc:
        errors[_describe(exc)] += 1
        return
    t1 = time.perf_counter()
    if not granted:
        result.rejections += 1
        return
    try:
        client.release()
    except Exception as exc:
        errors[_describe(exc)] += 1
        return
    result.latencies.append(t1 - t0)
    result.cycles += 1


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:120]}"


# --- inside a worker process -------------------------------------------------


def worker_main(url: str, worker: int, inbox: Any, outbox: Any) -> None:
    os.environ["BENCH_DATABASE_URL"] = url
    os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.settings"
    import django

    django.setup()
    roundtrips.install()
    while (specs := inbox.get()) is not None:
        outbox.put(("done", worker, run_clients(specs, worker, inbox, outbox)))


def run_clients(specs: list[ClientSpec], worker: int, inbox: Any, outbox: Any) -> list[Any]:
    """Run this worker's clients of one cell, one thread each."""
    clients = [make_client(spec) for spec in specs]
    results: list[ClientResult | None] = [None] * len(clients)
    ready = threading.Barrier(len(clients) + 1)
    go = threading.Event()
    window: dict[str, float] = {}

    def body(i: int) -> None:
        client = clients[i]
        try:
            client.setup()
        except Exception as exc:
            results[i] = ClientResult(index=client.spec.index, errors={_describe(exc): 1})
        ready.wait()
        go.wait()
        try:
            if results[i] is None:
                results[i] = client_loop(client, window["warm"], window["start"], window["end"])
        finally:
            with suppress(Exception):
                client.close()

    with _prelock_switched_off(any(spec.system == APP_NO_PRELOCK for spec in specs)):
        threads = [threading.Thread(target=body, args=(i,)) for i in range(len(clients))]
        for thread in threads:
            thread.start()
        ready.wait()
        outbox.put(("ready", worker, None))
        _, window["warm"], window["start"], window["end"] = inbox.get()
        go.set()
        for thread in threads:
            thread.join()
    return [result.__dict__ for result in results if result is not None]


def _prelock_switched_off(off: bool) -> Any:
    """For the waiting scenario's baseline: the app without its in-process pre-lock."""
    if not off:
        return nullcontext()
    from django_semaphore.engine import prelock

    class Switch:
        def __enter__(self) -> None:
            self.saved = prelock.prelocked
            prelock.prelocked = lambda names: nullcontext()  # type: ignore[assignment,misc]

        def __exit__(self, *exc: object) -> None:
            prelock.prelocked = self.saved  # type: ignore[method-assign]

    return Switch()


# --- the driver's side -------------------------------------------------------


class Pool:
    """``size`` worker processes, each able to run any number of client threads."""

    def __init__(self, url: str, size: int) -> None:
        self.outbox = SPAWN.Queue()
        self.inboxes = [SPAWN.Queue() for _ in range(size)]
        self.processes = [
            SPAWN.Process(target=worker_main, args=(url, worker, inbox, self.outbox), daemon=True)
            for worker, inbox in enumerate(self.inboxes)
        ]
        for process in self.processes:
            process.start()

    def run(
        self,
        assignment: list[list[ClientSpec]],
        duration: float,
        alongside: Callable[[float, float], dict[str, Any]] | None = None,
    ) -> tuple[list[ClientResult], dict[str, Any]]:
        """Run one cell: ``assignment[w]`` are worker w's clients. ``alongside``
        runs in a driver thread over the same window (monitor, clean-up)."""
        busy = [w for w, specs in enumerate(assignment) if specs]
        for w in busy:
            self.inboxes[w].put(assignment[w])
        for _ in busy:
            self._expect("ready", READY_TIMEOUT)
        warm = time.time() + 0.05
        start = warm + min(WARM_UP, duration / 2)
        end = start + duration
        extra: dict[str, Any] = {}
        side = None
        if alongside is not None:
            side = threading.Thread(target=lambda: extra.update(alongside(start, end)))
            side.start()
        for w in busy:
            self.inboxes[w].put(("go", warm, start, end))
        results = []
        for _ in busy:
            results.extend(ClientResult(**r) for r in self._expect("done", duration + 120))
        if side is not None:
            side.join()
        return results, extra

    def _expect(self, kind: str, timeout: float) -> Any:
        got, _, payload = self.outbox.get(timeout=timeout)
        if got != kind:
            raise RuntimeError(f"worker said {got!r}, expected {kind!r}")
        return payload

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
