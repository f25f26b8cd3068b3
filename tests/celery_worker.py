"""A real Celery worker process for the tests: real Redis broker, the test
database, and a queue of its own so parallel runs never steal its tasks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from tests.celery_app import app


@dataclass
class Worker:
    process: subprocess.Popen[bytes]
    nodename: str
    queue: str
    log: Path

    def child_pids(self) -> list[int]:
        """The pool processes that run tasks (children of the worker)."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in children.read_text().split()]

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])

    def started(self, label: str, timeout: float = 30) -> Any:
        """The ``RunLog`` of the first run labelled ``label``, once a task
        of this worker wrote it (the test fails with the log past ``timeout``)."""
        from tests.testapp.models import RunLog

        deadline = time.monotonic() + timeout
        while not (run := RunLog.objects.filter(label=label).first()):
            assert time.monotonic() < deadline, self.log_tail()
            time.sleep(0.1)
        return run


def _wait_until_ready(worker: Worker, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.process.poll() is not None:
            pytest.fail(f"The Celery worker exited at start:\n{worker.log_tail()}")
        if app.control.ping(destination=[worker.nodename], timeout=0.5):
            return
    pytest.fail(f"The Celery worker never answered a ping:\n{worker.log_tail()}")


@contextmanager
def celery_process(
    arguments: list[str], *, test_database: str, queue: str, log: Path, **env: str
) -> Iterator[subprocess.Popen[bytes]]:
    """``celery -A tests.celery_app <arguments>`` on the test database and
    ``queue``, logging to ``log``; stopped (TERM, then KILL) on exit."""
    environment = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "SEMAPHORE_TEST_DATABASE_NAME": test_database,
        "SEMAPHORE_CELERY_QUEUE": queue,
        "C_FORCE_ROOT": "1",  # CI runs as root
        **env,
    }
    command = [sys.executable, "-m", "celery", "-A", "tests.celery_app", *arguments]
    with log.open("wb") as output:
        process = subprocess.Popen(
            command, env=environment, stdout=output, stderr=subprocess.STDOUT
        )
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def celery_worker(
    django_db_setup: None,
    django_db_blocker: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Worker]:
    """Start a worker (prefork, 3 processes) for the tests of one module."""
    with running_worker(django_db_blocker, tmp_path_factory) as worker:
        yield worker


@pytest.fixture(scope="module")
def short_lease_worker(
    django_db_setup: None,
    django_db_blocker: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Worker]:
    """A worker whose ``LEASE`` setting is 2 s (tests/settings.py reads it)."""
    with running_worker(django_db_blocker, tmp_path_factory, SEMAPHORE_TEST_LEASE="2") as worker:
        yield worker


@contextmanager
def running_worker(
    django_db_blocker: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, **env: str
) -> Iterator[Worker]:
    queue = f"tests-{uuid.uuid4().hex[:8]}"
    nodename = f"{queue}@{os.uname().nodename}"
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        test_database = str(connection.settings_dict["NAME"])
    log = tmp_path_factory.mktemp("celery") / "worker.log"
    arguments = [
        "worker", "--pool=prefork", "--concurrency=3", f"--queues={queue}",
        f"--hostname={nodename}", "--without-gossip", "--without-mingle", "--loglevel=INFO",
    ]  # fmt: skip
    previous_queue = app.conf.task_default_queue
    app.conf.task_default_queue = queue
    try:
        with celery_process(
            arguments, test_database=test_database, queue=queue, log=log, **env
        ) as process:
            worker = Worker(process, nodename, queue, log)
            _wait_until_ready(worker)
            yield worker
    finally:
        app.conf.task_default_queue = previous_queue
