"""Who may take over a task's permit: the rules, on real rows, without timing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from django_semaphore import acquire
from django_semaphore.models import PermitRequest
from django_semaphore.owners import NO_PROCESS, TaskOwner
from django_semaphore.task_runs import _take_over
from tests.conftest import unique

pytestmark = pytest.mark.django_db(transaction=True)

HERE = f"celery@{socket.gethostname()}"


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.mark.parametrize(
    ("holder", "taken_over"),
    [
        ({"pid": NO_PROCESS}, True),  # between the task's own retries
        ({"pid": "dead"}, True),  # its process is gone from this machine
        ({"pid": os.getpid()}, False),  # alive: a duplicate delivery keeps out
        ({"pid": 4242, "hostname": "celery@elsewhere"}, False),  # unknowable from here
        ({"pid": NO_PROCESS, "task_id": "another-task"}, False),
    ],
)
def test_take_over_rules(make_semaphore, holder, taken_over):
    sem = make_semaphore()
    task_id = unique("task")
    previous = TaskOwner(
        task_id=holder.get("task_id", task_id),
        task_name="app.tasks.job",
        hostname=holder.get("hostname", HERE),
        pid=dead_pid() if holder["pid"] == "dead" else holder["pid"],
    )
    request = acquire(sem.name, external_id=task_id, owner=str(previous))
    me = TaskOwner(task_id, "app.tasks.job", HERE, os.getpid() + 1)

    assert _take_over(request, me) is taken_over

    expected = str(me) if taken_over else str(previous)
    assert PermitRequest.objects.get(pk=request.pk).owner == expected


def test_two_runs_taking_over_at_once_one_wins(make_semaphore):
    sem = make_semaphore()
    task_id = unique("task")
    parked = str(TaskOwner(task_id, "app.tasks.job", HERE, NO_PROCESS))
    request = acquire(sem.name, external_id=task_id, owner=parked)
    first = TaskOwner(task_id, "app.tasks.job", HERE, 1001)
    second = TaskOwner(task_id, "app.tasks.job", HERE, 1002)

    assert _take_over(request, first)
    assert not _take_over(request, second)  # the owner it judged (parked) is gone
