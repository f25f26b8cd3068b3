"""The permit of a task run, Celery's or Django's own: keyed by the task's
id, so a redelivered, retried or re-run task finds the permit its task
already holds instead of taking a second one.

The owner column says which process holds it (``TaskOwner``): a second run
of the same task id that is *alive at the same time* (a broker's
visibility timeout redelivering a long task) must not share the permit, so
a run only takes over a permit whose previous holder is parked (between
retries) or dead. A task whose permit was released (it finished, or its
holder died and the sweep reclaimed it) and that runs again takes a new one
under the next key: ``<task id>~2``, ``~3``, ...
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from django.db import connections
from django.db.models import QuerySet

from django_semaphore import liveness, parking, routing
from django_semaphore.exceptions import (
    LiveDuplicate,
    PermitAlreadyReleased,
    SemaphoreError,
    TaskAlreadyRan,
)
from django_semaphore.integrations.options import Options
from django_semaphore.models import PermitRequest
from django_semaphore.owners import NO_PROCESS, TaskOwner, own_start
from django_semaphore.retry import run_with_retries
from django_semaphore.states import State

MAX_GENERATIONS = 50


def claim(
    me: TaskOwner, options: Options, timeout: float | timedelta = 0, *, rerun_finished: bool = True
) -> str:
    """Acquire (or re-attach to) the permit of ``me``'s task id, as
    ``options`` say, waiting up to ``timeout`` seconds for room; returns
    the key held.

    ``rerun_finished=False`` (parked Celery tasks, which may be published
    twice): a run whose task id's permit was released by its holder -- the
    task finished -- is a duplicate and does not run.

    Raises:
        SemaphoreExhausted: no room; ``LiveDuplicate`` when another live run
            holds the permit.
        TaskAlreadyRan: ``rerun_finished`` is false and the task finished.
    """
    for key in keys(me.task_id):
        try:
            request = options.acquire(key, str(me), timeout)
        except PermitAlreadyReleased:
            if not rerun_finished and key == me.task_id and parking.finished_before(key):
                raise TaskAlreadyRan(f"Task {key} already ran; this copy is dropped.") from None
            continue
        if request.owner == str(me) or take_over(request, me):
            return key
        raise LiveDuplicate(
            list(request.fencing_tokens),
            f"Another live run holds the permit of task {me.task_id}: {request.owner}",
        )
    raise SemaphoreError(f"Task {me.task_id} lost its permit {MAX_GENERATIONS} times.")


def owner(task_id: str, task_name: str, hostname: str = "", pid: int | None = None) -> TaskOwner:
    """The run of ``task_id`` in this process (``pid``: another), on this
    machine unless a worker's node name is given."""
    return TaskOwner(
        task_id=task_id,
        task_name=task_name,
        hostname=hostname or socket.gethostname(),
        pid=os.getpid() if pid is None else pid,
        started=own_start(os.getpid()) if pid is None else None,
    )


def next_key(task_id: str) -> str:
    """The key this task's next run claims its permit with: the first of its
    keys whose permit its holder has not released (``claim``)."""
    candidates = list(keys(task_id))
    released = set(
        PermitRequest.objects.using(routing.alias_for_key(task_id))
        .filter(external_id__in=candidates, state=State.RELEASED)
        .values_list("external_id", flat=True)
    )
    return next((key for key in candidates if key not in released), candidates[-1])


def keys(task_id: str) -> Iterator[str]:
    yield task_id
    for generation in range(2, MAX_GENERATIONS + 1):
        yield f"{task_id}~{generation}"


def take_over(request: PermitRequest, me: TaskOwner) -> bool:
    """Adopt the permit if its previous holder is parked or known dead; a live
    holder is a duplicate delivery of the same task, and keeps it."""
    previous = request.owner
    holder = TaskOwner.parse(previous)
    if holder is None or holder.task_id != me.task_id:
        return False
    # Gone from this machine's process table, or reported dead by the
    # configured liveness checkers (an unknown answer is not dead).
    if holder.pid != NO_PROCESS and not liveness.is_dead(previous):
        return False
    # Conditional on the owner we judged: of two runs adopting at once, one wins.
    return bool(
        update_held(
            str(request._state.db),
            lambda held: held.filter(pk=request.pk, owner=previous),
            owner=str(me),
        )
    )


def update_held(alias: str, select: Callable[[QuerySet[Any]], QuerySet[Any]], **values: Any) -> int:
    """Update a held request, retrying transient database errors."""
    connection = connections[alias]
    held = PermitRequest.objects.using(alias).filter(state=State.ACQUIRED)
    return run_with_retries(connection, lambda: select(held).update(**values))
