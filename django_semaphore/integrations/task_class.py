"""``@task(semaphores=...)``: the demand of a Django task declared on
``@task`` itself, where the framework passes ``@task``'s extra keywords to
its backend's task class (Django 6.1, the django-tasks backport 0.12).

A backend opts in with the task class this module makes; the option then
applies ``@holds_permit`` to the task's function, so both spellings run one
implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async

from django_semaphore.integrations import django_tasks
from django_semaphore.integrations.decorators import holds_permit

# Set on a function this module wrapped: a task copied by ``using()`` or
# rebuilt by a worker keeps its function, and must not wrap it twice.
_DEMAND = "django_semaphore_task_demand"


def permit_task_class(base: Any) -> Any:
    """The task class ``base`` (a backend's ``task_class``) with a
    ``semaphores`` option: ``@task(semaphores="exports")`` holds a permit
    on ``exports`` while the task runs, as ``@holds_permit("exports")``
    under ``@task`` does. Where the framework passes ``@task``'s extra
    keywords to its backend's task class (Django 6.1, the django-tasks
    backport 0.12), set as the ``task_class`` of a backend of your own::

        from django_tasks_db import DatabaseBackend

        class LimitedDatabaseBackend(DatabaseBackend):
            task_class = permit_task_class(DatabaseBackend.task_class)

    Its ``enqueue`` applies ``@holds_permit``'s ``on_conflict``,
    ``max_waiting`` and ``debounce`` when the task is sent, on a backend
    that can defer runs (django-tasks-db's): ``docs/policies.md``.

    Args:
        base: the task class to extend (``django.tasks.Task``, the
            backport's, or a backend's own subclass).

    Returns:
        A subclass of ``base`` whose ``semaphores`` takes what
        ``holds_permit``'s ``names`` takes; the other options of
        ``holds_permit`` are its defaults (use the decorator for those).
    """

    @dataclass(frozen=True, slots=True, kw_only=True)
    class PermitTask(base):  # type: ignore[misc]
        semaphores: Any = None
        # What a run checks: options decided when it is sent need this class.
        decides_when_sent = True

        def enqueue(self, *args: Any, **kwargs: Any) -> Any:
            return django_tasks.send(self, base.enqueue, args, kwargs)

        async def aenqueue(self, *args: Any, **kwargs: Any) -> Any:
            return await sync_to_async(self.enqueue)(*args, **kwargs)

        def __post_init__(self) -> None:
            if self.semaphores is not None and not hasattr(self.func, _DEMAND):
                held = holds_permit(self.semaphores)(self.func)
                setattr(held, _DEMAND, self.semaphores)
                object.__setattr__(self, "func", held)
            base.__post_init__(self)

    PermitTask.__qualname__ = PermitTask.__name__ = f"Permit{base.__name__}"
    return PermitTask
