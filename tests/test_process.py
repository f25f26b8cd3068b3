"""A forked child (a Celery prefork pool process) starts with every piece of
this process's state new: no lock another thread held at the fork, no
waiter, lease, grant or stand-by of the parent's."""

from __future__ import annotations

import os
import threading
from contextlib import ExitStack
from typing import Any

import django_semaphore.api
import django_semaphore.parking.wake  # noqa: F401
from django_semaphore import process
from django_semaphore.engine import prelock
from django_semaphore.parking.wake import SCHEDULED
from django_semaphore.waiting import SEEN
from django_semaphore.waiting.standby import STANDBYS
from tests.conftest import forked_child_exit_code

LOCKS = (type(threading.Lock()), type(threading.RLock()), threading.Condition)


def locks_of(state: process.State) -> list[Any]:
    return [value for value in vars(state).values() if isinstance(value, LOCKS)]


def kept_as_new(state: process.State) -> bool:
    """Its locks free, its collections empty."""
    free = True
    for lock in locks_of(state):
        if lock.acquire(timeout=0.5):
            lock.release()
        else:
            free = False
    return free and not any(
        value for value in vars(state).values() if isinstance(value, (dict, list, set))
    )


def test_a_forked_child_renews_every_state_another_thread_held(settings):
    settings.DJANGO_SEMAPHORE = {"PRELOCK_TIMEOUT": 2}
    states = list(process.KEPT)
    assert {type(state).__name__ for state in states} >= {
        "Heartbeat",
        "Listener",
        "Prelocks",
        "Scheduled",
        "Seen",
        "Standbys",
        "Waiters",
    }
    held, done = threading.Event(), threading.Event()

    def hold_everything() -> None:
        with ExitStack() as stack:
            stack.enter_context(prelock.prelocked(["forked"]))
            for state in states:
                for lock in locks_of(state):
                    stack.enter_context(lock)
            held.set()
            done.wait(10)

    SEEN.grants[("default", "forked")] = (["forked"], 0.0)
    STANDBYS.names["forked"] += 1
    SCHEDULED.due[("default", 0)] = 0.0
    thread = threading.Thread(daemon=True, target=hold_everything)
    thread.start()
    try:
        assert held.wait(5)
        pid = os.fork()
        if pid == 0:  # the child: check, report, leave at once
            try:
                renewed = all(kept_as_new(state) for state in states)
                with prelock.prelocked(["forked"]):
                    os._exit(0 if renewed else 1)
            finally:
                os._exit(2)
        stuck = "the forked child waited for a lock held in its parent"
        assert forked_child_exit_code(pid, 10, stuck) == 0
    finally:
        done.set()
        thread.join(10)
        SEEN.grants.pop(("default", "forked"), None)
        STANDBYS.names.subtract(["forked"])
        SCHEDULED.due.pop(("default", 0), None)
