"""Django's own tasks for tests/test_django_tasks.py, under ``django.tasks``
(Django 6) or the django-tasks backport's ``@task`` (Django 5.2), at module
level as task backends want them."""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

from django.conf import settings
from django.utils import timezone
from django_tasks_db import DatabaseBackend

from django_semaphore import holds_permit
from django_semaphore.integrations.task_class import permit_task_class
from django_semaphore.models import PermitRequest
from django_semaphore.states import State
from tests.testapp.models import RunLog

framework = settings.TASKS["default"]["BACKEND"].split(".backends.")[0]
task = importlib.import_module(framework).task
ImmediateBackend = importlib.import_module(f"{framework}.backends.immediate").ImmediateBackend


class PermitImmediateBackend(ImmediateBackend):  # type: ignore[misc,valid-type]
    """The immediate backend, with ``@task(semaphores=...)`` (settings: "permits")."""

    task_class = permit_task_class(ImmediateBackend.task_class)


class PermitDatabaseBackend(DatabaseBackend):  # type: ignore[misc]
    """django-tasks-db's backend, its sends deciding who may wait
    (settings: "permits-database")."""

    task_class = permit_task_class(DatabaseBackend.task_class)


LIMITED = "django-tasks-limited"


RATED = "django-tasks-rated"


@task(takes_context=True)
@holds_permit(LIMITED)
def holding(context: Any, label: str, hold: float = 0.0) -> str:
    """Hold ``LIMITED`` for ``hold`` seconds, logged; returns the owner of
    the permit this run holds."""
    return _logged(context, label, hold)


@task(takes_context=True)
@holds_permit(RATED)
def rated(context: Any, label: str) -> str:
    """Take a slot of the rate limit ``RATED``, logged."""
    return _logged(context, label, 0.0)


def _logged(context: Any, label: str, hold: float) -> str:
    run = RunLog.objects.create(
        label=label, task_id=context.task_result.id, pid=os.getpid(), started_at=timezone.now()
    )
    time.sleep(hold)
    # Under the result's id, or ``id~2``... for a re-run after its release.
    held = PermitRequest.objects.filter(
        external_id__startswith=context.task_result.id, state=State.ACQUIRED
    )
    run.ended_at = timezone.now()
    run.save(update_fields=["ended_at"])
    return str(held.values_list("owner", flat=True).get())


@task()
@holds_permit(lambda customer: f"django-tasks-customer:{customer}")
def per_customer(customer: str) -> list[str]:
    """The semaphores held while it runs."""
    held = PermitRequest.objects.filter(state=State.ACQUIRED)
    return list(held.values_list("permits__semaphore__name", flat=True))


@task(backend="permits", semaphores=LIMITED, takes_context=True)
def declared(context: Any, label: str, hold: float = 0.0) -> str:
    """``holding``, its demand declared on ``@task``."""
    return _logged(context, label, hold)


@task()
@holds_permit(LIMITED)
def failing() -> None:
    raise ValueError("the task's own failure")


# --- who may wait: decided when the task is sent (test_policies) ------------------

ONCE = "django-tasks-once"  # capacity 1, created by each test


@task(backend="permits-database", takes_context=True)
@holds_permit(ONCE, on_conflict="discard")
def once(context: Any, label: str, hold: float = 0.0) -> str:
    return _logged(context, label, hold)


@task(backend="permits-database", takes_context=True)
@holds_permit(ONCE, on_conflict="replace")
def latest(context: Any, label: str, hold: float = 0.0) -> str:
    return _logged(context, label, hold)


@task(backend="permits-database", takes_context=True)
@holds_permit(ONCE, debounce=1)
def debounced(context: Any, label: str, hold: float = 0.0) -> str:
    return _logged(context, label, hold)


@task(backend="permits-database", takes_context=True)
@holds_permit(ONCE, max_waiting=5, share=lambda label, hold=0.0: label[0])
def shared_by_customers(context: Any, label: str, hold: float = 0.0) -> str:
    return _logged(context, label, hold)


@task(backend="database")
@holds_permit(ONCE, on_conflict="discard")
def discards_without_its_class() -> None:
    """``on_conflict`` on a task class that does not decide it: its run fails."""
