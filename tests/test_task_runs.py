"""Who may take over a task's permit, and when a refused run parks: the
rules, on real rows, without timing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from django.db import DatabaseError

from django_semaphore import acquire, parking
from django_semaphore.exceptions import (
    DatabaseUnavailable,
    FamilyFull,
    LineFull,
    LiveDuplicate,
    LockContention,
    SemaphoreError,
    SemaphoreExhausted,
    SemaphoreNotFound,
)
from django_semaphore.integrations.celery_tasks import _park_task, _parks_for, _retry
from django_semaphore.integrations.options import Options
from django_semaphore.integrations.task_keys import take_over
from django_semaphore.models import PermitRequest
from django_semaphore.owners import NO_PROCESS, TaskOwner
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

    assert take_over(request, me) is taken_over

    expected = str(me) if taken_over else str(previous)
    assert PermitRequest.objects.get(pk=request.pk).owner == expected


def test_two_runs_taking_over_at_once_one_wins(make_semaphore):
    sem = make_semaphore()
    task_id = unique("task")
    parked = str(TaskOwner(task_id, "app.tasks.job", HERE, NO_PROCESS))
    request = acquire(sem.name, external_id=task_id, owner=parked)
    first = TaskOwner(task_id, "app.tasks.job", HERE, 1001)
    second = TaskOwner(task_id, "app.tasks.job", HERE, 1002)

    assert take_over(request, first)
    assert not take_over(request, second)  # the owner it judged (parked) is gone


class Refused:
    """Just what parking reads of a Celery task, for the rules below."""

    name = "app.tasks.job"

    def __init__(self) -> None:
        self.request = type("Request", (), {"id": unique("task")})()


@pytest.mark.parametrize(
    ("refusal", "parks"),
    [
        (SemaphoreExhausted(["s"]), True),  # a want of room: waits
        (LiveDuplicate(["s"]), False),  # held by its own other run: retried
        (FamilyFull(["f:1"]), False),  # no member to wait on: retried
    ],
)
def test_a_parking_run_parks_for_want_of_room_only(refusal, parks):
    assert _parks_for(refusal) is parks


@pytest.mark.parametrize(
    "failure",
    [
        LockContention("gave up"),
        DatabaseUnavailable("gone"),
        SemaphoreError("unexpected"),  # a driver's error, translated (below)
    ],
)
def test_a_park_the_database_failed_falls_back_to_a_retry(failure, monkeypatch):
    if type(failure) is SemaphoreError:
        failure.__cause__ = DatabaseError("driver")
    monkeypatch.setattr(parking, "park", lambda *args: _raise(failure))

    assert _park_task(Refused(), _options()) is None  # the caller retries the task


@pytest.mark.parametrize("refusal", [SemaphoreNotFound(["s"]), LineFull(["s"])])
def test_a_park_refused_for_anything_else_fails_the_run(refusal, monkeypatch):
    monkeypatch.setattr(parking, "park", lambda *args: _raise(refusal))

    with pytest.raises(type(refusal)):
        _park_task(Refused(), _options())


def _raise(error: Exception) -> None:
    raise error


def _options() -> Options:
    return Options({"s": 1}, None, 0, 1, "app.tasks.job", False, None, 1, None)


@pytest.mark.parametrize(("retry_after", "least"), [(None, 0), (30.0, 30)])
def test_a_retry_without_parking_comes_no_sooner_than_the_next_slot(retry_after, least):
    task = Refused()
    task.request.retries = 0
    asked: list[float] = []
    task.retry = lambda exc, countdown: asked.append(countdown) or exc

    _retry(task, SemaphoreExhausted(["stripe"], retry_after=retry_after))

    assert least <= asked[0] <= max(least * 1.1 + 1, 2)
