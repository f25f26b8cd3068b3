"""Liveness checkers: the interface, and the Celery checker against a real worker."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery.result import AsyncResult

from django_semaphore import set_capacity, sweep
from django_semaphore.liveness import (
    CeleryTaskChecker,
    Liveness,
    LivenessChecker,
    dead_owners,
    is_dead,
    load_checkers,
)
from django_semaphore.models import PermitRequest, Semaphore
from django_semaphore.owners import TaskOwner
from django_semaphore.states import ReleaseReason, State
from tests import tasks
from tests.celery_app import app
from tests.testapp.models import RunLog

GONE_HOST = "celery@gone-host"


def dead_on_gone_host(owner: str) -> Liveness:
    return Liveness.DEAD if f" on {GONE_HOST} " in owner else Liveness.UNKNOWN


class Counting(LivenessChecker):
    calls: list[list[str]] = []

    def check_owner(self, owner: str) -> Liveness:
        return Liveness.DEAD

    def check(self, owners: Any) -> Any:
        Counting.calls.append(list(owners))
        return super().check(owners)


# --- the interface ---------------------------------------------------------------


def test_dotted_paths_load_classes_and_functions(settings):
    settings.DJANGO_SEMAPHORE = {
        "LIVENESS_CHECKERS": [
            "django_semaphore.liveness.CeleryTaskChecker",
            "tests.test_liveness.dead_on_gone_host",
        ]
    }
    celery_checker, function_checker = load_checkers()
    assert isinstance(celery_checker, CeleryTaskChecker)
    owner = str(TaskOwner("t-1", "x", GONE_HOST, 12))
    assert function_checker.check([owner, "web-1"]) == {
        owner: Liveness.DEAD,
        "web-1": Liveness.UNKNOWN,
    }


def test_owners_are_asked_once_per_batch_and_empty_owners_never():
    Counting.calls = []
    assert dead_owners(["a", "b", "a", ""], [Counting()]) == {"a", "b"}
    assert Counting.calls == [["a", "b"]]
    assert dead_owners([""], [Counting()]) == set()
    assert Counting.calls == [["a", "b"]]


def test_answers_that_are_not_a_liveness_say_nothing():
    class Sloppy(LivenessChecker):
        def check(self, owners: Any) -> Any:
            return {"a": "dead", "b": True, "c": Liveness.DEAD}

    assert dead_owners(["a", "b"], [Sloppy()]) == set()


def test_non_task_owners_are_unknown_to_the_celery_checker():
    # No broadcast is made for owners that are not tasks.
    class NoNetwork(CeleryTaskChecker):
        def get_app(self) -> Any:
            raise AssertionError("asked the workers")

    assert NoNetwork().check(["web-1 pid 42", "", "task:broken"]) == dict.fromkeys(
        ["web-1 pid 42", "", "task:broken"], Liveness.UNKNOWN
    )


def test_a_re_attaching_task_asks_the_checkers_about_a_holder_on_another_machine(settings):
    here = os.uname().nodename
    on_gone_host = TaskOwner("t-1", "x", GONE_HOST, 12)
    on_other_host = TaskOwner("t-1", "x", "celery@other-host", 12)
    gone_here = TaskOwner("t-1", "x", f"celery@{here}", 2**22 + 1)  # above pid_max
    assert not is_dead(str(on_gone_host))  # no checkers configured
    assert is_dead(str(gone_here))  # the process table is always asked

    settings.DJANGO_SEMAPHORE = {"LIVENESS_CHECKERS": ["tests.test_liveness.dead_on_gone_host"]}
    assert is_dead(str(on_gone_host))
    assert not is_dead(str(on_other_host))


# --- the Celery checker and a real worker -----------------------------------------


class Checker(CeleryTaskChecker):
    timeout = 1.0

    def get_app(self) -> Any:
        return app


def ask(*owners: TaskOwner | str) -> list[Liveness]:
    answers = Checker().check([str(owner) for owner in owners])
    return [answers[str(owner)] for owner in owners]


def wait_until(condition: Any, worker: Any, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, worker.log_tail()
        time.sleep(0.1)
    return value


@pytest.fixture
def one(celery_worker: Any) -> Semaphore:
    return Semaphore.objects.create(name=tasks.ONE, capacity=1)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_running_task_is_alive_and_finished_one_is_dead(one, celery_worker):
    result = tasks.slow.delay("liveness", 3)
    wait_until(lambda: RunLog.objects.filter(label="liveness").exists(), celery_worker)
    owner = PermitRequest.objects.get(external_id=result.id).owner
    running = TaskOwner.parse(owner)
    assert running is not None
    assert running.hostname == celery_worker.nodename
    # The same task id, but a process that is not the one running it: the
    # worker knows the task, so it is not called dead (another run may adopt it).
    other_process = TaskOwner(result.id, running.task_name, running.hostname, running.pid + 1)

    assert ask(owner, other_process) == [Liveness.ALIVE, Liveness.UNKNOWN]

    result.get(timeout=60)
    # SUCCESS is stored before the worker hears that its pool process is done
    # (task_postrun runs in between): ALIVE until then, DEAD after.
    wait_until(lambda: ask(owner) == [Liveness.DEAD], celery_worker)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_unknown_owners_are_unknown_and_a_vanished_run_on_an_answering_worker_is_dead(
    celery_worker,
):
    never_seen = str(uuid.uuid4())
    on_silent_worker = TaskOwner(never_seen, "x", "celery@no-such-worker", 4242)
    vanished = TaskOwner(never_seen, "x", celery_worker.nodename, 4242)

    assert ask("web-1 pid 7", on_silent_worker, vanished) == [
        Liveness.UNKNOWN,  # not a task
        Liveness.UNKNOWN,  # its worker did not answer: it may be busy, not dead
        Liveness.DEAD,  # its worker answered and runs no such task
    ]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_task_waiting_for_its_countdown_is_not_dead(celery_worker):
    result = tasks.naps.apply_async(args=[0], countdown=60)
    try:
        wait_until(
            lambda: app.control.inspect(timeout=0.5).query_task(result.id),
            celery_worker,
        )
        # Received but not started: whatever process its owner names, not dead.
        assert ask(TaskOwner(result.id, tasks.naps.name, celery_worker.nodename, 4242)) == [
            Liveness.UNKNOWN
        ]
    finally:
        result.revoke()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_parked_permit_between_retries_is_kept_until_the_task_is_ready(one, celery_worker):
    result = tasks.retries_much_later.delay()
    wait_until(lambda: AsyncResult(result.id, app=app).state == "RETRY", celery_worker)
    request = wait_until(
        lambda: PermitRequest.objects.filter(
            external_id=result.id, owner__endswith=" pid 0", state=State.ACQUIRED
        ).first(),
        celery_worker,
    )
    finished = tasks.naps.delay(0)
    finished.get(timeout=30)
    parked_after_success = TaskOwner(finished.id, tasks.naps.name, celery_worker.nodename, 0)
    # SUCCESS is stored before its worker stops listing it: UNKNOWN until then.
    wait_until(lambda: ask(parked_after_success) == [Liveness.DEAD], celery_worker)
    parked_unknown = TaskOwner(str(uuid.uuid4()), "x", celery_worker.nodename, 0)
    try:
        assert ask(request.owner, parked_after_success, parked_unknown) == [
            Liveness.UNKNOWN,  # RETRY, its retry message held by the worker
            Liveness.DEAD,  # the task finished for good
            Liveness.UNKNOWN,  # its retry message may be in the broker
        ]
        report = sweep.release_orphans(checkers=[Checker()])
        assert report.owner_dead == 0
        request.refresh_from_db()
        assert request.state == State.ACQUIRED
    finally:
        result.revoke()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_sweep_with_the_celery_checker_releases_only_the_dead(one, celery_worker):
    set_capacity(one.name, 5)
    result = tasks.slow.delay("sweep-liveness", 4)
    wait_until(lambda: RunLog.objects.filter(label="sweep-liveness").exists(), celery_worker)
    vanished = TaskOwner(str(uuid.uuid4()), "x", celery_worker.nodename, 4242)
    silent = TaskOwner(str(uuid.uuid4()), "x", "celery@no-such-worker", 4242)
    from django_semaphore import acquire

    dead = acquire(tasks.ONE, external_id="dead-run", owner=str(vanished))
    unsure = acquire(tasks.ONE, external_id="unsure-run", owner=str(silent))

    report = sweep.release_orphans(checkers=[Checker()])

    assert report.owner_dead == 1
    dead.refresh_from_db()
    unsure.refresh_from_db()
    assert (dead.state, dead.release_reason) == (State.RELEASED, ReleaseReason.OWNER_DEAD)
    assert unsure.state == State.ACQUIRED
    assert PermitRequest.objects.get(external_id=result.id).state == State.ACQUIRED
    assert result.get(timeout=60)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_killed_pool_child_s_task_permit_is_back_at_the_next_sweep(one, celery_worker):
    """No liveness checker configured, the lease (60 s) far from over: the
    sweep on the worker's machine sees the pool child gone."""
    result = tasks.held_until_killed.delay("killed-swept", 120)
    pid = celery_worker.started("killed-swept").pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists():  # until the worker reaps it
        assert time.monotonic() < deadline, celery_worker.log_tail()
        time.sleep(0.05)

    assert sweep.release_orphans().owner_dead == 1
    request = PermitRequest.objects.get(external_id=result.id)
    assert (request.state, request.release_reason) == (State.RELEASED, ReleaseReason.OWNER_DEAD)
