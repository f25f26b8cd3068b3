"""How a Celery task run holds permits.

The key is the task id, so a redelivered message or a ``self.retry()`` finds
the permit its task already holds instead of taking a second one. The owner
column says which process holds it (``TaskOwner``): a second run of the same
task id that is *alive at the same time* (a broker's visibility timeout
redelivering a long task) must not share the permit, so a run only takes
over a permit whose previous holder is parked (between retries) or dead.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

from django_semaphore.conf import app_settings
from django_semaphore.exceptions import PermitAlreadyReleased, SemaphoreError, SemaphoreExhausted
from django_semaphore.owners import TaskOwner

logger = logging.getLogger("django_semaphore")

# Owner pid of a permit kept between a task's retries: no process holds it,
# the next run of the task adopts it.
PARKED = 0
# A task whose permit was reclaimed (TTL, sweep) while it was parked or after
# its worker died takes a new one under the next key: <task id>~2, ~3, ...
MAX_GENERATIONS = 50


def claim(task: Any, demand: Any, ttl: int | None) -> str:
    """Acquire (or re-attach to) this task id's permit; returns the key held.

    Raises:
        SemaphoreExhausted: no room, or another live run holds the permit.
    """
    from django_semaphore.core import acquire

    me = current_owner(task)
    for key in _keys(task.request.id):
        try:
            request = acquire(demand, external_id=key, owner=str(me), ttl=ttl)
        except PermitAlreadyReleased:
            continue
        if request.owner == str(me) or _take_over(request.pk, request.owner, me):
            return key
        raise SemaphoreExhausted(
            list(request.fencing_tokens),
            f"Another live run holds the permit of task {task.request.id}: {request.owner}",
        )
    raise SemaphoreError(f"Task {task.request.id} lost its permit {MAX_GENERATIONS} times.")


def current_owner(task: Any, pid: int | None = None) -> TaskOwner:
    return TaskOwner(
        task_id=task.request.id,
        task_name=task.name,
        hostname=task.request.hostname or socket.gethostname(),
        pid=os.getpid() if pid is None else pid,
    )


def _keys(task_id: str) -> Iterator[str]:
    yield task_id
    for generation in range(2, MAX_GENERATIONS + 1):
        yield f"{task_id}~{generation}"


def _take_over(request_id: int, previous: str, me: TaskOwner) -> bool:
    """Adopt the permit if its previous holder is parked or known dead."""
    from django_semaphore.models import PermitRequest, State

    holder = TaskOwner.parse(previous)
    if holder is None or (holder.pid != PARKED and not _is_dead(holder)):
        return False
    # Conditional on the owner we judged: of two runs adopting at once, one wins.
    return bool(
        PermitRequest.objects.using(app_settings.DATABASE)
        .filter(pk=request_id, state=State.ACQUIRED, owner=previous)
        .update(owner=str(me))
    )


def _is_dead(holder: TaskOwner) -> bool:
    """Gone from this machine's process table, or reported dead by the
    configured liveness checkers (an unknown answer is not dead)."""
    from django_semaphore import liveness

    return _gone_from_this_machine(holder) or liveness.is_dead(str(holder))


def _gone_from_this_machine(holder: TaskOwner) -> bool:
    machine = holder.hostname.partition("@")[2] or holder.hostname
    if machine != socket.gethostname():
        return False
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def on_task_postrun(sender: Any = None, task: Any = None, state: str = "", **kwargs: Any) -> None:
    """``task_postrun`` receiver: keep the permit across ``retry()``, release
    it once the task has finished for good (success, failure, revoked)."""
    from django_semaphore.core import release
    from django_semaphore.decorators import TASK_KEY_ATTRIBUTE
    from django_semaphore.models import PermitRequest, State

    key = getattr(getattr(task, "request", None), TASK_KEY_ATTRIBUTE, None)
    if key is None:
        return
    try:
        if state == "RETRY":
            PermitRequest.objects.using(app_settings.DATABASE).filter(
                external_id=key, state=State.ACQUIRED
            ).update(owner=str(current_owner(task, pid=PARKED)))
        else:
            release(key)
    except SemaphoreError:
        # The sweep releases what could not be released here; never fail the worker.
        logger.exception("Could not settle the permit %s of task %s", key, task.request.id)
