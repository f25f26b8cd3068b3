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
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from django.db import connections
from django.db.models import QuerySet

from django_semaphore import routing
from django_semaphore.exceptions import (
    LiveDuplicate,
    PermitAlreadyReleased,
    SemaphoreError,
    TaskAlreadyRan,
)
from django_semaphore.owners import TaskOwner

if TYPE_CHECKING:
    from django_semaphore.models import PermitRequest

logger = logging.getLogger("django_semaphore")

# Owner pid of a permit kept between a task's retries: no process holds it,
# the next run of the task adopts it.
PARKED = 0
# A task whose permit was reclaimed (TTL, sweep) while it was parked or after
# its worker died takes a new one under the next key: <task id>~2, ~3, ...
MAX_GENERATIONS = 50


def claim(task: Any, demand: Any, ttl: int | None, *, rerun_finished: bool = True) -> str:
    """Acquire (or re-attach to) this task id's permit; returns the key held.

    ``rerun_finished=False`` (parked tasks, which may be published twice):
    a run whose task id's permit was released by its holder -- the task
    finished -- is a duplicate and does not run.

    Raises:
        SemaphoreExhausted: no room; ``LiveDuplicate`` when another live run
            holds the permit.
        TaskAlreadyRan: ``rerun_finished`` is false and the task finished.
    """
    from django_semaphore.api import acquire

    me = current_owner(task)
    for key in _keys(task.request.id):
        try:
            request = acquire(demand, external_id=key, owner=str(me), ttl=ttl)
        except PermitAlreadyReleased:
            if not rerun_finished and key == task.request.id:
                from django_semaphore import parking

                if parking.finished_before(key):
                    raise TaskAlreadyRan(f"Task {key} already ran; this copy is dropped.") from None
            continue
        if request.owner == str(me) or _take_over(request, me):
            return key
        raise LiveDuplicate(
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


def _take_over(request: PermitRequest, me: TaskOwner) -> bool:
    """Adopt the permit if its previous holder is parked or known dead; a live
    holder is a duplicate delivery of the same task, and keeps it."""
    previous = request.owner
    holder = TaskOwner.parse(previous)
    if holder is None or holder.task_id != me.task_id:
        return False
    if holder.pid != PARKED and not _is_dead(holder):
        return False
    # Conditional on the owner we judged: of two runs adopting at once, one wins.
    return bool(
        _update_owner(
            str(request._state.db),
            lambda held: held.filter(pk=request.pk, owner=previous),
            str(me),
        )
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


def _park(key: str, task: Any) -> None:
    """Mark the permit as held by no process: the task's next attempt adopts it."""
    parked = str(current_owner(task, pid=PARKED))
    _update_owner(routing.alias_for_key(key), lambda held: held.filter(external_id=key), parked)


def _update_owner(alias: str, select: Callable[[QuerySet[Any]], QuerySet[Any]], owner: str) -> int:
    """Set the owner of a held request, retrying transient database errors."""
    from django_semaphore.models import PermitRequest
    from django_semaphore.retry import run_with_retries
    from django_semaphore.states import State

    connection = connections[alias]
    held = PermitRequest.objects.using(alias).filter(state=State.ACQUIRED)
    return run_with_retries(connection, lambda: select(held).update(owner=owner))


def on_before_task_publish(headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
    """``before_task_publish`` receiver: a task calling ``retry()`` publishes
    its next attempt before ``task_postrun`` runs, and that attempt may start
    at once in another process. Park the permit first, so it is adopted
    rather than mistaken for a live duplicate's."""
    from celery import current_task

    from django_semaphore.decorators import TASK_KEY_ATTRIBUTE

    request: Any = getattr(current_task, "request", None)
    key = getattr(request, TASK_KEY_ATTRIBUTE, None)
    if key is None or (headers or {}).get("id") != request.id:
        return
    try:
        _park(key, current_task)
    except SemaphoreError:
        # The next attempt then defers until postrun parks the permit.
        logger.exception("Could not park the permit %s of task %s", key, request.id)


def on_task_postrun(sender: Any = None, task: Any = None, state: str = "", **kwargs: Any) -> None:
    """``task_postrun`` receiver: keep the permit across ``retry()``, release
    it once the task has finished for good (success, failure, revoked)."""
    from django_semaphore.api import release
    from django_semaphore.decorators import TASK_KEY_ATTRIBUTE

    key = getattr(getattr(task, "request", None), TASK_KEY_ATTRIBUTE, None)
    if key is None:
        return
    try:
        if state == "RETRY":
            _park(key, task)
        else:
            release(key)
    except SemaphoreError:
        # The sweep releases what could not be released here; never fail the worker.
        logger.exception("Could not settle the permit %s of task %s", key, task.request.id)
