"""The orphan sweep and its own machine's process table: the permit of a
process killed there is back at the next sweep, lease or not, whatever
kind of holder it was; a live process keeps its permit, and a later process
given the same pid is not taken for the one that held it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from django_semaphore import acquire, sweep
from django_semaphore.models import PermitRequest
from django_semaphore.owners import NO_PROCESS, TaskOwner, process_start, this_process
from django_semaphore.states import ReleaseReason, State
from tests.children import Outbox, spawn, stop
from tests.clients import hold_until_killed
from tests.conftest import unique

pytestmark = pytest.mark.django_db(transaction=True)

HOST = socket.gethostname()
# Far longer than any test: only the process table can give the permit back.
LEASE = 600


@contextmanager
def holding(name: str) -> Iterator[tuple[object, str]]:
    """A spawned child holding ``name`` in a ``permit()`` block (``LEASE``
    seconds), and its key; stopped, whatever happens, when the block ends."""
    outbox = Outbox.create()
    child = spawn(hold_until_killed, name, LEASE, outbox, bound=90)
    try:
        deadline = time.monotonic() + 60
        while not outbox.items():
            if time.monotonic() > deadline or not child.is_alive():
                pytest.fail(f"The holder never held:\n{stop([child])}")
            time.sleep(0.05)
        (key,) = outbox.items()
        yield child, key
    finally:
        stop([child])


def released_by_one_sweep() -> int:
    return sweep.release_orphans().owner_dead


def test_a_killed_holder_s_permit_is_back_at_the_next_sweep(make_semaphore):
    sem = make_semaphore(capacity=1)
    with holding(sem.name) as (child, key):
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)

        assert released_by_one_sweep() == 1

    request = PermitRequest.objects.get(external_id=key)
    assert (request.state, request.release_reason) == (State.RELEASED, ReleaseReason.OWNER_DEAD)
    acquire(sem.name, external_id=unique("after"))  # the room is back


def test_a_live_holder_keeps_its_permit(make_semaphore):
    sem = make_semaphore(capacity=1)
    with holding(sem.name) as (child, key):
        assert released_by_one_sweep() == 0

        assert PermitRequest.objects.get(external_id=key).state == State.ACQUIRED
        assert child.is_alive()


@contextmanager
def running_child() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield child
    finally:
        child.kill()
        child.wait(timeout=10)


def ended_process() -> tuple[int, int]:
    """The pid and start of a process that has ended (and been reaped)."""
    with running_child() as child:
        started = process_start(child.pid)
    assert started is not None
    return child.pid, started


def wait_for_zombie(pid: int) -> None:
    deadline = time.monotonic() + 10
    with open(f"/proc/{pid}/stat") as stat:
        while stat.read().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.01)
            stat.seek(0)


def test_every_kind_of_owner_of_a_process_gone_from_this_machine_is_released(make_semaphore):
    sem = make_semaphore(capacity=20)
    dead, started = ended_process()
    me, my_start = os.getpid(), process_start(os.getpid())
    assert my_start is not None
    process = f"{HOST} pid {dead} started {started}"
    gone = {
        "permit": f"app.jobs.run on {process}",
        "view": f"view app.views.export for bob from 10.0.0.7 on {process}",
        "celery-task": str(TaskOwner("t-1", "app.tasks.job", f"celery@{HOST}", dead, started)),
        "django-task": str(TaskOwner("r-1", "app.tasks.job", HOST, dead, started)),
        "before-start-times": f"app.jobs.run on {HOST} pid {dead}",
        # This process's pid, but another process's start: the pid was reused.
        "pid-reused": f"app.jobs.run on {HOST} pid {me} started {my_start + 1}",
    }
    kept = {
        "this-process": f"app.jobs.run on {this_process()}",
        "this-pid-before-start-times": f"app.jobs.run on {HOST} pid {me}",
        "parked-task": str(TaskOwner("t-2", "app.tasks.job", f"celery@{HOST}", NO_PROCESS)),
        "another-machine": f"app.jobs.run on elsewhere-{process}",
        "free-text": "the nightly batch",
    }
    with running_child() as zombie:
        zombie_start = process_start(zombie.pid)
        os.kill(zombie.pid, signal.SIGKILL)  # not reaped yet: a zombie
        wait_for_zombie(zombie.pid)
        gone["zombie"] = f"app.jobs.run on {HOST} pid {zombie.pid} started {zombie_start}"
        for key, owner in {**gone, **kept}.items():
            acquire(sem.name, external_id=key, owner=owner, ttl=LEASE)

        assert released_by_one_sweep() == len(gone)

    still_held = PermitRequest.objects.filter(state=State.ACQUIRED)
    assert set(still_held.values_list("external_id", flat=True)) == set(kept)
