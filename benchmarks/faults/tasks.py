"""Tasks of the redelivery scenario: one per semaphore, each holding a permit
(key = task id) while it works, recording what it was granted."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from celery import shared_task
from celery.signals import task_prerun

from benchmarks.faults.history import Recorder
from django_semaphore import holds_permit
from django_semaphore.integrations.celery_tasks import TASK_KEY_ATTRIBUTE

NAMES = ["hot-3", *[f"spread-{i:02d}" for i in range(6)]]
_recorder: Recorder | None = None


def record(event: str, **fields: Any) -> None:
    global _recorder
    if _recorder is None:
        directory = Path(os.environ["FAULTS_CELERY_HISTORY"])
        _recorder = Recorder(directory / f"task-{os.getpid()}.jsonl")
    _recorder(event, **fields)


@task_prerun.connect
def _attempt(task_id: str = "", task: Any = None, **kwargs: Any) -> None:
    # Every run of a task (first, redelivered, retried) is one acquire attempt.
    if task is not None and task.name.startswith("faults."):
        record("inv", k=task_id, d={task.name.partition(".")[2]: 1}, task=task_id)


def _work(task: Any, name: str, hold: float) -> str:
    from django_semaphore.models import PermitRequest

    key = getattr(task.request, TASK_KEY_ATTRIBUTE)
    request = PermitRequest.objects.get(external_id=key)
    record(
        "ok",
        k=key,
        id=request.pk,
        tok=request.fencing_tokens,
        d={name: 1},
        task=task.request.id,
        pid=os.getpid(),
    )
    time.sleep(hold * random.uniform(0.5, 1.5))
    record("rel", k=key, task=task.request.id)
    return key


def _make(name: str) -> Any:
    @shared_task(name=f"faults.{name}", bind=True, max_retries=1000, acks_late=True)
    @holds_permit(name, ttl=4)
    def work(self: Any, hold: float) -> str:
        return _work(self, name, hold)

    return work


TASKS = {name: _make(name) for name in NAMES}
