"""Django's own tasks (``django.tasks``; the ``django-tasks`` backport on
Django 5.2): a ``@holds_permit`` body that a task backend runs holds its
permit keyed by the task result's id, on any backend.

Every backend announces a run with ``task_started`` (its result, just before
the body is called) and its end with ``task_finished``; between the two,
this module keeps the running result in a context variable, so the
decorator tells a task's body from a plain call of the same function
(``ImmediateBackend``, ``django-tasks-db``'s worker, any other).

**Waiting.** A run that finds no room waits in its worker until room comes,
as ``acquire(timeout=...)`` waits (the poller; no transaction open, no
row locked): it is never failed for want of room. It keeps its worker busy
meanwhile.

**Crash recovery.** The permit is held under a lease that the process's
heartbeat renews: a worker killed mid-run stops renewing, and the permit
is back within the lease. Its owner names the worker process as a Celery
task's does (``owners.TaskOwner``), so the orphan sweep finds it sooner on
the worker's own machine.
"""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Callable
from contextvars import ContextVar
from importlib.util import find_spec
from types import ModuleType
from typing import Any

from django_semaphore.integrations.context import HeldPermit, permit
from django_semaphore.integrations.options import Options
from django_semaphore.owners import TaskOwner
from django_semaphore.validation import MAX_TTL

FRAMEWORKS = ("django.tasks", "django_tasks")

# The task result whose body runs in this context (task_started to task_finished).
_running: ContextVar[Any] = ContextVar("django_semaphore_task_result", default=None)


def frameworks() -> list[ModuleType]:
    """The installed tasks frameworks: ``django.tasks`` (Django 6) and the
    ``django_tasks`` backport (a backend may use either)."""
    return [importlib.import_module(name) for name in FRAMEWORKS if find_spec(name) is not None]


def connect() -> None:
    """Follow the runs of the installed tasks frameworks (``apps``)."""
    for tasks in frameworks():
        signals = importlib.import_module(f"{tasks.__name__}.signals")
        uid = f"django_semaphore.{tasks.__name__}"
        signals.task_started.connect(on_task_started, dispatch_uid=f"{uid}.started")
        signals.task_finished.connect(on_task_finished, dispatch_uid=f"{uid}.finished")


def on_task_started(sender: Any, task_result: Any, **kwargs: Any) -> None:
    _running.set(task_result)


def on_task_finished(sender: Any, task_result: Any, **kwargs: Any) -> None:
    if _running.get() is task_result:
        _running.set(None)


def task_classes() -> list[type]:
    """The task classes of the installed frameworks: what a decorator
    placed above ``@task`` would wrap."""
    return [importlib.import_module(f"{tasks.__name__}.base").Task for tasks in frameworks()]


def running_result_of(body: Callable[..., Any]) -> Any:
    """The task result whose body ``body`` is, if a backend is running it now."""
    result = _running.get()
    if result is None or getattr(result.task, "func", None) is not body:
        return None
    return result


def own_arguments(result: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The task's own arguments: without the ``TaskContext`` a task that
    ``takes_context`` gets first (computed names never see it)."""
    return args[1:] if result.task.takes_context else args


def held_for(result: Any, options: Options) -> HeldPermit:
    """The permit of this run, keyed by its result's id: ``with`` it around
    the body. Waits for room without a deadline unless the decorator gave a
    ``timeout``."""
    owner = TaskOwner(result.id, result.task.module_path, socket.gethostname(), os.getpid())
    return permit(
        options.demand,
        external_id=result.id,
        owner=str(owner),
        ttl=options.ttl,
        timeout=options.timeout or MAX_TTL,
        fair=options.fair,
    )
