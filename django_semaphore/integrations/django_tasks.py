"""Django's own tasks (``django.tasks``; the ``django-tasks`` backport on
Django 5.2): a ``@holds_permit`` body that a task backend runs holds its
permit keyed by the task result's id, on any backend.

Every backend announces a run with ``task_started`` (its result, just before
the body is called) and its end with ``task_finished``; between the two,
this module keeps the running result in a context variable, so the
decorator tells a task's body from a plain call of the same function
(``ImmediateBackend``, ``django-tasks-db``'s worker, any other).

**Waiting.** Where the backend can defer a run (django-tasks-db's
``DatabaseBackend``), a run that finds no room stands by in its worker as a
Celery task does (``standby``), then is *deferred*: it ends with
``TaskDeferred``, which its worker records as the run's end, and once that
is recorded its result is ``READY`` again, parked (``parking.defer``,
``parking.deferred``) until a release makes room for it -- first in line
with the waiters and parked Celery tasks -- and then run again under
the same result id; a run refused by rate limits alone is deferred to
their next slot. Elsewhere (the immediate backend, any other) it waits in
its worker until room comes, as ``acquire(timeout=...)`` waits. Either
way it is never failed for want of room.

**Crash recovery.** The permit is held under a lease that the process's
heartbeat renews: a worker killed mid-run stops renewing, and the permit
is back within the lease. Its owner names the worker process as a Celery
task's does (``owners.TaskOwner``), so the orphan sweep finds it sooner on
the worker's own machine. A re-run of the same result (a backend's retry,
RQ's requeue) claims it as a redelivered Celery task does (``task_keys``):
it takes over a dead run's permit, takes a new one once the old was
released, and is refused (``LiveDuplicate``) while the first run lives.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from contextlib import suppress
from contextvars import ContextVar
from dataclasses import replace
from datetime import datetime, timedelta
from importlib.util import find_spec
from types import ModuleType
from typing import Any, NoReturn

from asgiref.sync import sync_to_async
from django.db import connections
from django.utils import timezone

from django_semaphore import api, parking, retry, routing
from django_semaphore.exceptions import (
    InvalidRequest,
    LiveDuplicate,
    PermitLost,
    SemaphoreError,
    SemaphoreExhausted,
    TaskDeferred,
    TaskReplaced,
)
from django_semaphore.integrations import task_keys
from django_semaphore.integrations.leases import Lease
from django_semaphore.integrations.options import OPTIONS_ATTRIBUTE, Options
from django_semaphore.owners import TaskOwner
from django_semaphore.parking import admission, deferred
from django_semaphore.parking.rows import Row
from django_semaphore.validation import MAX_TTL
from django_semaphore.waiting import standby

logger = logging.getLogger("django_semaphore")

FRAMEWORKS = ("django.tasks", "django_tasks")

# The task result whose body runs in this context (task_started to task_finished).
_running: ContextVar[Any] = ContextVar("django_semaphore_task_result", default=None)
# The run this context deferred (result id, and when it runs again; None:
# when woken), until its worker has recorded its end.
_deferring: ContextVar[tuple[str, datetime | None] | None] = ContextVar(
    "django_semaphore_deferring", default=None
)


def frameworks() -> list[ModuleType]:
    """The installed tasks frameworks: ``django.tasks`` (Django 6) and the
    ``django_tasks`` backport (a backend may use either)."""
    return [importlib.import_module(name) for name in FRAMEWORKS if find_spec(name) is not None]


def connect() -> None:
    """Follow the runs of the installed tasks frameworks (``apps``), and log
    a deferred run's end as what it is."""
    for tasks in frameworks():
        signals = importlib.import_module(f"{tasks.__name__}.signals")
        uid = f"django_semaphore.{tasks.__name__}"
        signals.task_started.connect(on_task_started, dispatch_uid=f"{uid}.started")
        signals.task_finished.connect(on_task_finished, dispatch_uid=f"{uid}.finished")
        # The framework's logger, which records every failed run's end as an
        # error with its traceback (error trackers pick those up). addFilter
        # adds a filter once, however often this runs.
        logging.getLogger(tasks.__name__).addFilter(deferred_runs)


def deferred_runs(record: logging.LogRecord) -> bool:
    """The framework's record of a run that ended deferred, logged at INFO
    as deferred, without the traceback, instead of as a failed run."""
    exception = record.exc_info[1] if record.exc_info else None
    if isinstance(exception, TaskDeferred) and isinstance(record.args, tuple):
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        record.msg, record.args = "Task id=%s path=%s deferred: %s", (*record.args[:2], exception)
        record.exc_info = record.exc_text = None
    return True


def on_task_started(sender: Any, task_result: Any, **kwargs: Any) -> None:
    _running.set(task_result)


def on_task_finished(sender: Any, task_result: Any, **kwargs: Any) -> None:
    if _running.get() is task_result:
        _running.set(None)
    pending = _deferring.get()
    if pending is not None and pending[0] == task_result.id:
        # Its worker recorded the deferred run's end: now it waits again.
        _deferring.set(None)
        hold = functools.partial(deferred.hold, task_result.id, pending[1])
        try:
            # Retried: a rate limit's deferral parks nothing, so no wake-up's
            # resume() would find the row if this rewrite were lost.
            retry.run_with_retries(connections[routing.current_alias()], hold)
        except SemaphoreError:  # never into the worker's loop
            logger.exception("Could not defer the run of task %s", task_result.id)


def task_classes() -> list[type]:
    """The task classes of the installed frameworks: what a decorator
    placed above ``@task`` would wrap."""
    return [importlib.import_module(f"{tasks.__name__}.base").Task for tasks in frameworks()]


def inline_backends() -> tuple[type, ...]:
    """The frameworks' own backends, which run a task where it is enqueued
    (immediate) or never (dummy): nothing to defer there."""
    return tuple(
        getattr(importlib.import_module(f"{tasks.__name__}.backends.{module}"), name)
        for tasks in frameworks()
        for module, name in (("immediate", "ImmediateBackend"), ("dummy", "DummyBackend"))
    )


def running_result_of(body: Callable[..., Any]) -> Any:
    """The task result whose body ``body`` is, if a backend is running it now."""
    result = _running.get()
    return result if result is not None and getattr(result.task, "func", None) is body else None


def send(task: Any, enqueue: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Enqueue ``task`` by ``enqueue`` (its class's own), under its
    ``@holds_permit``'s policies (``on_conflict``, ``max_waiting``,
    ``debounce``) where the backend can defer its runs: the result is
    written in the decision's transaction (``parking.admission``), rolled
    back when discarded. Returns its result, or the existing task's.

    Raises:
        InvalidRequest: ``on_conflict`` or ``debounce`` on a backend that
            cannot defer a run (only django-tasks-db's can).
        LineFull: ``max_waiting`` tasks already wait on one of its semaphores.
        SemaphoreExhausted: discarded, and no result of this backend holds
            or waits where it found no room.
    """
    options = getattr(task.func, OPTIONS_ATTRIBUTE, None)
    backend = type(task.get_backend())
    if options is None or not options.has_send_policy or issubclass(backend, inline_backends()):
        return enqueue(task, *args, **kwargs)
    if not deferred.can_defer(backend):
        if options.needs_a_deciding_class:
            raise InvalidRequest(
                f"Task {task.module_path}: on_conflict and debounce need a backend that can "
                f"defer a run (django-tasks-db's DatabaseBackend), not {backend.__name__}."
            )
        return enqueue(task, *args, **kwargs)  # max_waiting applies when it runs
    call = options.for_call(*args, **kwargs)
    sent: list[Any] = []

    def row_of() -> Row:
        sent.append(enqueue(task, *args, **kwargs))  # again on a retried transaction
        result = sent[-1]
        return Row(
            result.id, result.id, task.module_path, backend=result.backend,
            priority=call.priority_or(task.priority), share=call.share_key,
        )  # fmt: skip

    admitted = admission.enqueue(row_of, call.demand, call.policy, also=deferred.alias())
    if admitted.existing:
        return _existing(task, admitted.existing, call.demand)
    if admitted.replaced:
        deferred.drop(admitted.replaced, TaskReplaced)
    return sent[-1]


def _existing(task: Any, task_ids: list[str], demand: dict[str, int]) -> Any:
    """The result of the first of these tasks that is one of this backend's."""
    for task_id in task_ids:
        with suppress(Exception):  # the framework's TaskResultDoesNotExist, or a bad id
            return task.get_result(task_id)
    raise SemaphoreExhausted(sorted(demand), f"Discarded: {', '.join(task_ids)} hold or wait.")


def run(func: Callable[..., Any], options: Options, result: Any, args: Any, kwargs: Any) -> Any:
    """Run the task's body holding its permit, claimed under its result's
    id (``options``: its decorator's, computed here for this run's
    arguments): when refused, defer it where its backend can, else wait
    for room.

    Raises:
        TaskDeferred: the run was deferred (its worker records that).
        LiveDuplicate: another live run of the same result holds its permit.
        InvalidRequest: its options are decided when it is sent, and its
            task class does not (``permit_task_class``).
    """
    options = _run_options(result, options, args, kwargs)
    key = _claim_or_defer(result, options)
    lease = options.hold_lease(key)
    try:
        return func(*args, **kwargs)
    finally:
        _settle(result, key, lease)


async def run_async(
    func: Callable[..., Any], options: Options, result: Any, args: Any, kwargs: Any
) -> Any:
    """``run`` for an ``async def`` task: it waits for room, never deferred."""
    options = _run_options(result, options, args, kwargs)
    key = await sync_to_async(task_keys.claim)(_owner(result), options, options.timeout or MAX_TTL)
    lease = options.hold_lease(key)
    try:
        return await func(*args, **kwargs)
    finally:
        await sync_to_async(_settle)(result, key, lease)


def _run_options(result: Any, options: Options, args: Any, kwargs: Any) -> Options:
    """The options of this run, computed from the task's own arguments
    (without the ``TaskContext`` a task that ``takes_context`` gets first):
    refused where they are decided when the task is sent and its class
    does not; its task's priority by default."""
    own = args[1:] if result.task.takes_context else args
    call = options.for_call(*own, **kwargs)
    fix = "make its backend's task_class permit_task_class(...)"
    call.refuse_undecided(result.task, result.task.module_path, fix)
    return replace(call, priority=call.priority_or(result.task.priority))


def _claim_or_defer(result: Any, options: Options) -> str:
    """The key of the run's permit, claimed at once, after standing by, or
    after waiting in the worker where the backend cannot defer."""
    claim = functools.partial(task_keys.claim, _owner(result), options)
    backend = type(result.task.get_backend())
    if options.timeout or not options.parks or not deferred.can_defer(backend):
        return claim(options.timeout or MAX_TTL)
    parking.enable()  # this process's releases resume the tasks parked for their room
    try:
        key = claim(0)
    except LiveDuplicate:
        raise
    except SemaphoreExhausted as refused:
        if refused.retry_after is not None:  # only rate limits: their next slot
            _defer(result, options, timezone.now() + timedelta(seconds=refused.retry_after))
        if (stood_by := standby.stand_by(result.id, options.demand, claim)) is None:
            key = task_keys.next_key(result.id)
            task = (result.id, key, result.task.module_path, result.backend)
            parking.defer(
                *task,
                options.demand,
                options.max_waiting,
                options.priority_or(0),
                options.share_key,
            )
            _defer(result, options, None)
        key = stood_by
    parking.started(result.id, options.demand)
    return key


def _settle(result: Any, key: str, lease: Lease | None) -> None:
    """Give the run's permit back, its body ended (failed or not). A release
    the database refuses is logged, not the run's failure: the lease, or the
    sweep asking its backend (``DjangoTaskChecker``), gives it back."""
    if lease is not None:
        lease.drop()  # first: a renewal would find it released
    try:
        api.release(key)
    except SemaphoreError:
        logger.exception("Could not release the permit %s of task %s", key, result.id)
    if lease is not None and lease.lost:
        raise PermitLost(f"Task {result.id} lost its permit while it ran.")


def _owner(result: Any) -> TaskOwner:
    return task_keys.owner(result.id, result.task.module_path)


def _defer(result: Any, options: Options, until: datetime | None) -> NoReturn:
    """End this run deferred: its result waits in its backend until
    ``until``, or, ``None``, until a wake-up (``on_task_finished``)."""
    _deferring.set((result.id, until))
    names = ", ".join(sorted(options.demand))
    raise TaskDeferred(f"Task {result.id} deferred: no room on {names}; it runs when room comes.")
