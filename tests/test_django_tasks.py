"""Django's own tasks (``django.tasks``, or the backport on Django 5.2) under
``@holds_permit``: the permit keyed by the task result's id, on the
immediate backend and with real workers of django-tasks-db's database
backend."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from io import StringIO
from pathlib import Path
from typing import Any

import django_rq
import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import InterfaceError, OperationalError, connection
from django.utils import timezone

from django_semaphore import acquire, parking, release, sweep
from django_semaphore.exceptions import DatabaseUnavailable, TaskDeferred
from django_semaphore.models import ParkedTask, PermitRequest, Semaphore, Ticket
from django_semaphore.owners import TaskOwner, process_start
from django_semaphore.parking.deferred import DEFERRED
from django_semaphore.states import ReleaseReason, State
from tests import own_tasks
from tests.conftest import behind_the_engine
from tests.testapp.models import RunLog

pytestmark = pytest.mark.django_db(transaction=True)

# Seconds a test waits for the database workers before it fails.
WORKERS_DEADLINE = 120


@pytest.fixture
def limited() -> Semaphore:
    return Semaphore.objects.create(name=own_tasks.LIMITED, capacity=2)


def test_a_task_holds_its_permit_keyed_by_its_result_id(limited):
    result = own_tasks.holding.enqueue("immediate")

    assert result.status == "SUCCESSFUL", result.errors
    # The owner names the run and the process, as a Celery task's does.
    assert result.return_value.startswith(f"task:{result.id} tests.own_tasks.holding on ")
    request = PermitRequest.objects.get(external_id=result.id)
    assert (request.state, request.release_reason) == (State.RELEASED, ReleaseReason.RELEASED)
    assert Semaphore.objects.get(pk=limited.pk).in_use == 0


def test_a_demand_declared_on_task_holds_the_permit_as_the_decorator_does(limited):
    """``@task(semaphores=...)`` on a backend whose task class allows it:
    the same permit, keyed by the result's id, once per run (a copy by
    ``using()`` is not wrapped twice)."""
    results = [
        own_tasks.declared.enqueue("declared"),
        own_tasks.declared.using(priority=5).enqueue("copied"),
    ]

    for result in results:
        assert result.status == "SUCCESSFUL", result.errors
        assert result.return_value.startswith(f"task:{result.id} tests.own_tasks.declared on ")
    requests = PermitRequest.objects.values_list("external_id", "state")
    assert sorted(requests) == sorted((result.id, State.RELEASED) for result in results)
    assert Semaphore.objects.get(pk=limited.pk).in_use == 0


def test_a_failed_task_gives_its_permit_back(limited):
    result = own_tasks.failing.enqueue()

    assert result.status == "FAILED"
    assert "the task's own failure" in result.errors[0].traceback
    assert PermitRequest.objects.get(external_id=result.id).state == State.RELEASED
    assert Semaphore.objects.get(pk=limited.pk).in_use == 0


def test_computed_names_get_the_task_arguments():
    Semaphore.objects.create(name="django-tasks-customer:acme", capacity=1)

    result = own_tasks.per_customer.enqueue("acme")

    assert result.return_value == ["django-tasks-customer:acme"]


def test_a_call_outside_a_backend_holds_a_permit_of_its_own():
    Semaphore.objects.create(name="django-tasks-customer:acme", capacity=1)

    # The body called directly, as a function: a fresh key, not a task's.
    assert own_tasks.per_customer.func("acme") == ["django-tasks-customer:acme"]
    assert not PermitRequest.objects.filter(owner__startswith="task:").exists()


def test_a_deferred_runs_end_is_logged_as_deferred_not_as_a_failure(caplog):
    """The framework logs a failed run's end as an error with its traceback
    (inside its except block); a deferred one is logged at INFO instead."""
    logger = logging.getLogger(own_tasks.framework)
    with caplog.at_level(logging.INFO, logger=own_tasks.framework):
        try:
            raise TaskDeferred("Task r-1 deferred: no room on exports; it runs when room comes.")
        except TaskDeferred:
            logger.exception("Task id=%s path=%s state=%s", "r-1", "tests.own_tasks.x", "FAILED")
        try:
            raise ValueError("the task's own failure")
        except ValueError:
            logger.exception("Task id=%s path=%s state=%s", "r-2", "tests.own_tasks.x", "FAILED")

    deferral, failure = caplog.records
    assert (deferral.levelno, deferral.exc_info) == (logging.INFO, None)
    assert deferral.getMessage() == (
        "Task id=r-1 path=tests.own_tasks.x deferred: "
        "Task r-1 deferred: no room on exports; it runs when room comes."
    )
    assert failure.levelno == logging.ERROR
    assert failure.exc_info is not None


def test_a_deferred_run_left_failed_is_resumed_by_its_wake_up():
    """Its worker recorded the deferred run's end, and the rewrite to READY
    never came (the database failed then): the wake-up's resume still finds
    the row and runs it again; a real failure is never resumed."""
    from django_tasks_db.models import DBTaskResult

    from django_semaphore.parking import deferred

    task = own_tasks.holding.using(backend="database")
    left, failed = (task.enqueue(label) for label in ("left", "failed"))
    DBTaskResult.objects.filter(id=left.id).update(
        status="FAILED", exception_class_path=deferred.DEFERRED
    )
    DBTaskResult.objects.filter(id=failed.id).update(
        status="FAILED", exception_class_path="builtins.ValueError"
    )

    assert deferred.resume(left.id)
    assert not deferred.resume(failed.id)
    left.refresh()
    assert (left.status, left.errors) == ("READY", [])


def transient_error() -> Exception:
    """What this database's driver raises for a lost connection or a lock
    conflict, as Django wraps it: worth a retry (``backends.classify``)."""
    if connection.vendor == "sqlite":
        return OperationalError("database is locked")
    return InterfaceError("connection already closed")


def test_a_deferral_whose_rewrite_fails_once_is_retried(monkeypatch, caplog):
    """A rate limit's deferral parks nothing, so no wake-up would find a run
    whose rewrite to READY was lost: a lost connection or a lock conflict
    there is retried, and the run waits for its next slot."""
    from django_semaphore.parking import deferred

    Semaphore.objects.create(name=own_tasks.RATED, capacity=1, window=60)
    acquire(own_tasks.RATED, external_id="the-window's-one")
    result = own_tasks.rated.using(backend="database").enqueue("refused")
    hold, calls = deferred.hold, []

    def lost_once(*args: Any) -> None:
        calls.append(args)
        if len(calls) == 1:
            raise transient_error()
        hold(*args)

    monkeypatch.setattr(deferred, "hold", lost_once)
    with caplog.at_level(logging.ERROR, logger="django_semaphore"):
        run_here(result)

    assert len(calls) == 2
    assert result.status == "READY"
    assert not caplog.records
    assert not ParkedTask.objects.exists()


def test_the_sweep_command_resumes_a_parked_task_no_release_woke(limited, wakes_nobody):
    """Without Celery beat, ``semaphore_sweep --parked`` from cron is the
    backstop: a release in a process that wakes nobody left room, and the
    parked task's result waits until the sweep resumes it."""
    from django_tasks_db.models import DBTaskResult

    from django_semaphore.parking import deferred

    acquire({own_tasks.LIMITED: 2}, external_id="holder")
    result = own_tasks.holding.using(backend="database").enqueue("missed")
    parking.defer(
        result.id, result.id, "tests.own_tasks.holding", "database", {own_tasks.LIMITED: 1}
    )
    deferred.hold(result.id)  # as when its worker recorded the deferred run's end
    release("holder")
    row = DBTaskResult.objects.filter(id=result.id)
    assert row.values_list("run_after", flat=True).get() == deferred.PARKED_UNTIL

    call_command("semaphore_sweep", "--parked", stdout=StringIO())

    assert row.values_list("run_after", flat=True).get() <= timezone.now()
    assert ParkedTask.objects.get(task_id=result.id).woken_at is not None


def test_a_parked_task_whose_semaphore_is_gone_fails_with_the_reason(limited, wakes_nobody):
    from django_tasks_db.models import DBTaskResult

    from django_semaphore.parking import deferred

    acquire({own_tasks.LIMITED: 2}, external_id="holder")
    result = own_tasks.holding.using(backend="database").enqueue("orphaned")
    parking.defer(
        result.id, result.id, "tests.own_tasks.holding", "database", {own_tasks.LIMITED: 1}
    )
    deferred.hold(result.id)
    with behind_the_engine():  # a delete no guard saw: raw SQL, an older version
        Semaphore.objects.filter(pk=limited.pk).delete()

    assert sweep.sweep_parked().orphaned == 1

    assert not ParkedTask.objects.exists()
    row = DBTaskResult.objects.get(id=result.id)
    assert (row.status, row.exception_class_path) == (
        "FAILED",
        "django_semaphore.exceptions.SemaphoreNotFound",
    )


# --- re-runs of the same result ---------------------------------------------------------


def run_here(result: Any) -> Any:
    """Run a ready result of the database backend in this process, as its
    worker does (claim the row, run it, record its end); the result after."""
    from django_tasks_db.management.commands.db_worker import Worker
    from django_tasks_db.models import DBTaskResult

    row = DBTaskResult.objects.get(id=result.id)
    row.claim("test-worker")
    worker = Worker(
        queue_names=["default"], interval=0, batch=True, backend_name="database",
        startup_delay=False, max_tasks=None, worker_id="test-worker", excluded_queue_names=[],
    )  # fmt: skip
    worker.run_task(row)
    result.refresh()
    return result


def owner_in(pid: int, result: Any) -> str:
    started = process_start(pid)
    return str(TaskOwner(result.id, "tests.own_tasks.holding", socket.gethostname(), pid, started))


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_rerun_takes_over_the_permit_its_dead_run_held(limited):
    """Its first run's worker died holding the permit (lease not yet out):
    the re-run adopts it, owned by the re-run's process, and releases it."""
    result = own_tasks.holding.using(backend="database").enqueue("rerun")
    acquire(own_tasks.LIMITED, external_id=result.id, owner=owner_in(dead_pid(), result), ttl=60)

    run_here(result)

    assert result.status == "SUCCESSFUL", result.errors
    assert result.return_value == owner_in(os.getpid(), result)
    assert PermitRequest.objects.get(external_id=result.id).state == State.RELEASED
    assert Semaphore.objects.get(pk=limited.pk).in_use == 0


def test_a_rerun_after_its_permit_was_released_takes_the_next_key(limited):
    """A finished (or reclaimed) run released the permit under the result's
    id: a re-run of the same result (a requeue) takes one under ``id~2``."""
    from django_tasks_db.models import DBTaskResult

    result = own_tasks.holding.using(backend="database").enqueue("again")
    assert run_here(result).status == "SUCCESSFUL"
    DBTaskResult.objects.filter(id=result.id).update(status="READY", finished_at=None)

    assert run_here(result).status == "SUCCESSFUL", result.errors

    keys = PermitRequest.objects.filter(state=State.RELEASED).values_list("external_id", flat=True)
    assert sorted(keys) == [result.id, f"{result.id}~2"]
    assert Semaphore.objects.get(pk=limited.pk).in_use == 0


def test_a_rerun_while_its_first_run_lives_is_refused(limited):
    """Two live runs of one result never share its permit: the second
    fails with ``LiveDuplicate``, and the first keeps the permit."""
    result = own_tasks.holding.using(backend="database").enqueue("twice")
    alive = owner_in(os.getppid(), result)
    acquire(own_tasks.LIMITED, external_id=result.id, owner=alive, ttl=60)

    run_here(result)

    assert result.status == "FAILED"
    assert result.errors[0].exception_class_path.endswith("LiveDuplicate")
    request = PermitRequest.objects.get(external_id=result.id)
    assert (request.state, request.owner) == (State.ACQUIRED, alive)


def test_the_sweep_releases_the_permit_of_a_finished_task_its_run_did_not_release(limited):
    """``DjangoTaskChecker`` asks the task backends: a result recorded
    finished whose permit is still held (its release failed) is DEAD, and
    the sweep releases it; a running result's permit (its worker may be
    alive elsewhere) and other owners are left alone."""
    from django_tasks_db.models import DBTaskResult

    from django_semaphore.liveness import DjangoTaskChecker, Liveness

    task = own_tasks.holding.using(backend="database")
    done, running = task.enqueue("done"), task.enqueue("running")
    owners = {
        result.id: str(TaskOwner(result.id, "tests.own_tasks.holding", "elsewhere", 4242))
        for result in (done, running)
    }
    for key, owner in owners.items():
        acquire(own_tasks.LIMITED, external_id=key, owner=owner, ttl=600)
    DBTaskResult.objects.filter(id=done.id).update(status="SUCCESSFUL")
    DBTaskResult.objects.filter(id=running.id).update(status="RUNNING")
    other = str(TaskOwner("not-a-result", "tests.own_tasks.holding", "elsewhere", 4242))

    answers = DjangoTaskChecker().check([*owners.values(), other, "web-1 pid 7"])
    assert [answers[owner] for owner in (owners[done.id], owners[running.id], other)] == [
        Liveness.DEAD,
        Liveness.UNKNOWN,
        Liveness.UNKNOWN,
    ]
    assert answers["web-1 pid 7"] == Liveness.UNKNOWN

    report = sweep.release_orphans(checkers=[DjangoTaskChecker()])

    assert report.owner_dead == 1
    held = PermitRequest.objects.filter(state=State.ACQUIRED)
    assert list(held.values_list("external_id", flat=True)) == [running.id]


def test_a_release_the_database_refuses_leaves_the_task_successful(limited, monkeypatch, caplog):
    """The body's work is done: a failed release is logged, not the task's
    failure, and the sweep asking the backend gives the permit back."""
    from django_semaphore.liveness import DjangoTaskChecker

    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise DatabaseUnavailable("connection refused")

    monkeypatch.setattr("django_semaphore.api.release", unreachable)
    result = own_tasks.holding.using(backend="database").enqueue("unreleased")
    run_here(result)
    monkeypatch.undo()

    assert result.status == "SUCCESSFUL", result.errors
    assert f"Could not release the permit {result.id} of task {result.id}" in caplog.text
    assert PermitRequest.objects.get(external_id=result.id).state == State.ACQUIRED
    assert sweep.release_orphans(checkers=[DjangoTaskChecker()]).owner_dead == 1
    assert Semaphore.objects.get(pk=limited.pk).in_use == 0


def test_a_backend_that_cannot_defer_is_named_by_a_check():
    from django_semaphore.checks import check_task_backends

    # The immediate and database backends are not named; RQ's is.
    [info] = check_task_backends()
    assert info.id == "django_semaphore.I001"
    assert "'rq'" in info.msg


# --- real workers: the database backend and RQ -----------------------------------------


@contextmanager
def workers_running(
    command: list[str], count: int, log_dir: Path, name: str, **env: str
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` processes of ``python -m django <command>`` on the test
    database, each logging to ``<name>-<n>.log``; killed on exit."""
    environment = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "SEMAPHORE_TEST_DATABASE_NAME": str(connection.settings_dict["NAME"]),
        **env,
    }
    workers = []
    try:
        for n in range(count):
            with (log_dir / f"{name}-{n}.log").open("wb") as log:
                workers.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "django", *command],
                        env=environment,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        yield workers
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()


def db_workers(
    count: int, log_dir: Path, *, batch: bool = True, backend: str = "database", **env: str
) -> AbstractContextManager[list[subprocess.Popen[bytes]]]:
    """``count`` workers of django-tasks-db (of the TASKS alias ``backend``);
    with ``batch``, each exits once no task is ready (a deferred one is not)."""
    command = [
        "db_worker", "--backend", backend, "--no-startup-delay", "--interval", "0.1",
        *(["--batch"] if batch else []),
    ]  # fmt: skip
    return workers_running(command, count, log_dir, "worker", **env)


def rq_workers(
    count: int, log_dir: Path, **env: str
) -> AbstractContextManager[list[subprocess.Popen[bytes]]]:
    """``count`` RQ workers on this run's queue, each running a job in a
    work horse it forks."""
    command = ["rqworker", "--job-class", "django_tasks_rq.Job", settings.RQ_QUEUE]
    return workers_running(
        command, count, log_dir, "rq-worker", SEMAPHORE_RQ_QUEUE=settings.RQ_QUEUE, **env
    )


def on_database(task: Any) -> Any:
    return task.using(backend="database")


def on_rq(task: Any) -> Any:
    return task.using(backend="rq", queue_name=settings.RQ_QUEUE)


def finished(results: list[Any], workers: list[subprocess.Popen[bytes]], log_dir: Path) -> None:
    """Wait until every result is final, or fail with the workers' logs."""
    deadline = time.monotonic() + WORKERS_DEADLINE
    while True:
        for result in results:
            result.refresh()
        if all(final(result) for result in results):
            return
        logs = "\n".join(path.read_text(errors="replace")[-2000:] for path in log_dir.iterdir())
        assert time.monotonic() < deadline, logs
        assert any(worker.poll() is None for worker in workers), logs
        time.sleep(0.1)


def final(result: Any) -> bool:
    """Finished, and not a run that just ended deferred: its worker records
    that end as a failure, which the app turns back into READY a moment
    later (``parking.deferred.hold``); a test reading in between must wait."""
    deferring = result.errors and result.errors[-1].exception_class_path == DEFERRED
    return result.is_finished and not (result.status == "FAILED" and deferring)


def most_at_once(runs: list[RunLog]) -> int:
    """The most runs that overlapped in time, from their logged starts and ends."""
    starts = ((run.started_at, 1) for run in runs)
    ends = ((run.ended_at, -1) for run in runs)
    # An end sorts before a start at the same instant: they did not overlap.
    events = sorted(itertools.chain(starts, ends))
    return max(itertools.accumulate(change for _, change in events))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["database", "rq"])
def test_real_workers_run_no_more_than_capacity_and_none_fails(limited, tmp_path, backend):
    """Four workers of each backend, capacity 2: a refused run waits (the
    database backend's stands by or is deferred, RQ's waits in its work
    horse), never failing, and never more than two run at once; half of the
    tasks declare their demand on ``@task`` (``permit_task_class``)."""
    on, workers = {"database": (on_database, db_workers), "rq": (on_rq, rq_workers)}[backend]
    kinds = itertools.cycle([on(own_tasks.holding), on(own_tasks.declared)])
    results = [next(kinds).enqueue(f"{backend}-{n}", 0.3) for n in range(12)]

    with workers(4, tmp_path) as running:
        finished(results, running, tmp_path)

    assert [result.status for result in results] == ["SUCCESSFUL"] * 12, [r.errors for r in results]
    runs = list(RunLog.objects.filter(label__startswith=f"{backend}-"))
    assert len(runs) == 12
    assert most_at_once(runs) <= 2
    keys = set(PermitRequest.objects.values_list("external_id", flat=True))
    assert keys == {result.id for result in results}
    assert Semaphore.objects.get(pk=limited.pk).in_use == 0


@pytest.mark.slow
def test_a_refused_run_is_deferred_and_runs_again_under_its_result_id(tmp_path):
    """Capacity 1, holds of 1.2 s (longer than a stand-by is worth): a worker
    that learned them defers a refused run, and moves on; the release that
    makes room resumes it, and it runs under the same result id. None fails,
    never two at once, and nothing is left parked."""
    one = Semaphore.objects.create(name=own_tasks.LIMITED, capacity=1)
    tasks = own_tasks.holding.using(backend="database")
    results = [tasks.enqueue(f"deferred-{n}", 1.2) for n in range(4)]

    with db_workers(2, tmp_path, batch=False) as workers:
        finished(results, workers, tmp_path)

    assert [result.status for result in results] == ["SUCCESSFUL"] * 4, [r.errors for r in results]
    runs = list(RunLog.objects.filter(label__startswith="deferred-"))
    assert len(runs) == 4  # each body ran once: a deferred run never reached it
    assert most_at_once(runs) <= 1
    # A deferred result was taken by a worker twice: once deferred, once run.
    assert max(len(result.worker_ids) for result in results) >= 2
    # No worker logged a deferral as a failed run's traceback.
    logs = "".join(path.read_text(errors="replace") for path in tmp_path.iterdir())
    assert "Traceback" not in logs
    assert not ParkedTask.objects.exists()
    assert not Ticket.objects.exists()
    assert Semaphore.objects.get(pk=one.pk).in_use == 0


@pytest.mark.slow
def test_a_run_refused_by_a_rate_limit_is_deferred_to_its_next_slot(tmp_path):
    """One run a 2 s window: the refused runs wait in their backend for the next
    slot (no wake-up needed, none parked), none fails, and no two start
    within a window."""
    Semaphore.objects.create(name=own_tasks.RATED, capacity=1, window=2)
    tasks = own_tasks.rated.using(backend="database")
    results = [tasks.enqueue(f"rated-{n}") for n in range(3)]

    with db_workers(2, tmp_path, batch=False) as workers:
        finished(results, workers, tmp_path)

    assert [result.status for result in results] == ["SUCCESSFUL"] * 3, [r.errors for r in results]
    grants = sorted(PermitRequest.objects.values_list("created_at", flat=True))
    assert len(grants) == 3
    gaps = [(later - earlier).total_seconds() for earlier, later in itertools.pairwise(grants)]
    assert all(gap >= 2 for gap in gaps), gaps
    assert not ParkedTask.objects.exists()


@pytest.mark.slow
def test_a_killed_worker_permit_is_back_within_its_lease(limited, tmp_path):
    """SIGKILL a worker mid-task: its heartbeat stops, and once the lease
    (2 s here) has run out the orphan sweep releases its permit."""
    result = own_tasks.holding.using(backend="database").enqueue("killed", 60)

    with db_workers(1, tmp_path, SEMAPHORE_TEST_LEASE="2") as workers:
        deadline = time.monotonic() + WORKERS_DEADLINE
        while not RunLog.objects.filter(label="killed").exists():
            assert time.monotonic() < deadline
            assert workers[0].poll() is None
            time.sleep(0.1)
        workers[0].send_signal(signal.SIGKILL)
        workers[0].wait()

    request = PermitRequest.objects.get(external_id=result.id)
    assert request.state == State.ACQUIRED
    time.sleep(2.5)
    sweep.release_orphans()
    request.refresh_from_db()
    assert request.state == State.RELEASED
    assert Semaphore.objects.get(pk=limited.pk).in_use == 0


@pytest.mark.slow
def test_an_rq_run_killed_holding_its_permit_is_requeued_and_takes_it_over(limited, tmp_path):
    """SIGKILL the work horse mid-run: RQ records the job failed, and its
    permit stays held by the dead horse until its lease runs out. Requeued
    under the same id, the re-run takes that permit over (no second one),
    and releases it when it ends."""
    from rq.registry import FailedJobRegistry

    result = on_rq(own_tasks.holding).enqueue("killed", 1.5)

    with rq_workers(1, tmp_path) as workers:
        deadline = time.monotonic() + WORKERS_DEADLINE
        while not (first := RunLog.objects.filter(label="killed").first()):
            assert time.monotonic() < deadline, (tmp_path / "rq-worker-0.log").read_text()
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)
        while result.status != "FAILED":
            assert time.monotonic() < deadline, (tmp_path / "rq-worker-0.log").read_text()
            time.sleep(0.1)
            result.refresh()
        assert PermitRequest.objects.get(external_id=result.id).state == State.ACQUIRED

        FailedJobRegistry(queue=django_rq.get_queue(settings.RQ_QUEUE)).requeue(result.id)
        finished([result], workers, tmp_path)

    assert result.status == "SUCCESSFUL", result.errors
    second = RunLog.objects.exclude(pk=first.pk).get(label="killed")
    request = PermitRequest.objects.get()  # the one permit, under the result's id
    assert (request.external_id, request.state) == (result.id, State.RELEASED)
    # Taken over by the re-run, whose process (and so its start) is gone now.
    holder = TaskOwner(result.id, "tests.own_tasks.holding", socket.gethostname(), second.pid)
    assert request.owner.startswith(f"{holder} started ")
    assert Semaphore.objects.get(pk=limited.pk).in_use == 0
