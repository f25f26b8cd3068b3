"""How a Celery task run holds permits (``@holds_permit`` on a task).

The key is the task id (``task_keys``), so a redelivered message or a
``self.retry()`` finds the permit its task already holds instead of taking a
second one, and a second *live* run of the same task id does not share it.

A run that finds no room waits without spending its retries: it stands by
in its worker, then is parked in the database until a release makes room
for it (``parking``; the default, ``PARK_TASKS``). With ``park=False`` it
retries later (jittered countdown) and fails once its retries are spent.
Even a parking run retries in two cases, neither a want of room: another
live run of its task id holds the permit (``LiveDuplicate``), or the
database failed while it wrote its parked row (the retry keeps the task
from being lost). The permit is kept across the task's own retries and
released when the task finishes for good (``on_task_postrun``).
"""

from __future__ import annotations

import functools
import logging
import math
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from django.db import Error
from django.db.models import F
from django.db.models.functions import Greatest

from django_semaphore import api, parking, routing
from django_semaphore.backends import DatabaseNow
from django_semaphore.exceptions import (
    DatabaseUnavailable,
    FamilyFull,
    LiveDuplicate,
    LockContention,
    PermitLost,
    SemaphoreError,
    SemaphoreExhausted,
    TaskAlreadyRan,
)
from django_semaphore.integrations import task_keys
from django_semaphore.integrations.leases import Lease
from django_semaphore.integrations.options import Options
from django_semaphore.owners import NO_PROCESS, TaskOwner
from django_semaphore.waiting import standby

logger = logging.getLogger("django_semaphore")

# Attribute of the Celery task request that carries the key a run holds, for
# the task_postrun receiver (tasks.py can't see the decorator's locals).
TASK_KEY_ATTRIBUTE = "django_semaphore_key"
# ... and the lease the run holds on it (None: a ttl=None permit), which a
# retry stops renewing when it parks the permit.
TASK_LEASE_ATTRIBUTE = "django_semaphore_lease"


def run_task(
    func: Callable[..., Any],
    options: Options,
    task: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run the task holding its permits, claimed by its task id: when they
    are refused, stand by, park, retry or fail, as ``options`` say."""
    fix = "make it a PermitTask (@shared_task(base=PermitTask))"
    options.refuse_undecided(task, task.name, fix)
    parks = options.parks
    if parks:
        # From this process's first parking task on, its releases (this
        # task's own, when it finishes) wake the parked tasks they make room for.
        parking.enable()
    try:
        key = _claim_or_stand_by(task, options)
    except TaskAlreadyRan as exc:
        logger.info("Task %s[%s] dropped: %s", task.name, task.request.id, exc)
        _forget_parked(task, options)
        raise _ignore() from None
    except SemaphoreExhausted as exc:
        if parks and _parks_for(exc):
            _park_task(task, options)
        raise _retry(task, exc) from None
    setattr(task.request, TASK_KEY_ATTRIBUTE, key)  # settled by on_task_postrun
    if parks:
        _forget_parked(task, options)
    lease = options.hold_lease(key)
    setattr(task.request, TASK_LEASE_ATTRIBUTE, lease)
    started = time.monotonic()
    try:
        result = func(*args, **kwargs)
    finally:
        if lease is not None:
            lease.drop()
        if parks:
            standby.learn_hold(options.demand, time.monotonic() - started)
    if lease is not None and lease.lost:
        raise PermitLost(f"Task {task.request.id} lost its permit while it ran.")
    return result


def _parks_for(refusal: SemaphoreExhausted) -> bool:
    """Whether a parking run parks for this refusal: a want of room. Not a
    live duplicate (its permit is held by the other run, not by want of
    room; the retry finds it free once that run ends), nor a full family
    (no member to wait on: a member is made only once idle ones are
    cleaned up)."""
    return not isinstance(refusal, LiveDuplicate | FamilyFull)


def _retry(task: Any, exc: SemaphoreExhausted) -> Exception:
    """Retry the task with a jittered countdown, no sooner than a rate
    limit's next slot (``retry()`` raises; past ``max_retries`` it raises
    ``exc``: the task fails with it)."""
    retries = task.request.retries
    countdown = min(60.0, 2.0**retries) * random.uniform(0.5, 1.5)
    if exc.retry_after is not None:
        # A retry before the slot frees would only spend a retry.
        countdown = max(countdown, exc.retry_after * random.uniform(1.0, 1.1))
    logger.info(
        "Task %s[%s] deferred %.1fs (retry %d): %s",
        task.name,
        task.request.id,
        countdown,
        retries + 1,
        exc,
    )
    return cast(Exception, task.retry(exc=exc, countdown=math.ceil(countdown)))


def _claim_or_stand_by(task: Any, options: Options) -> str:
    """The run's permit key: claimed at once or, when a parking task finds
    no room, standing by in this worker for a release (``standby.stand_by``).
    Raises as ``task_keys.claim``."""
    claim_within = functools.partial(
        task_keys.claim, current_owner(task), options, rerun_finished=not options.parks
    )
    try:
        return claim_within()
    except SemaphoreExhausted as exc:
        if not options.parks or not _parks_for(exc):
            raise
        key = standby.stand_by(task.request.id, options.demand, claim_within)
        if key is None:
            raise
        return key


def _ignore() -> Exception:
    from celery.exceptions import Ignore

    return cast(Exception, Ignore())


def _park_task(task: Any, options: Options) -> None:
    """Park the task and end this run (``Ignore``). Returns only when the
    database failed to take the row (after its own retries): the caller then
    retries the task as without parking, the one way left not to lose it.
    Any other error (a semaphore deleted meanwhile) fails the run, as the
    claim would have."""
    try:
        parking.park(
            task,
            options.demand,
            task_keys.next_key(task.request.id),
            options.max_waiting,
            options.priority_or(0),
            options.share_key,
        )
    except SemaphoreError as exc:
        if not _database_failed(exc):
            raise
        logger.exception("Task %s[%s] could not be parked", task.name, task.request.id)
        return
    logger.info("Task %s[%s] parked for want of room", task.name, task.request.id)
    raise _ignore()


def _database_failed(exc: SemaphoreError) -> bool:
    """Whether ``exc`` is the database's failure (contention, a lost
    connection, a driver error translated), not a refusal of the demand."""
    return isinstance(exc, LockContention | DatabaseUnavailable) or isinstance(exc.__cause__, Error)


def _forget_parked(task: Any, options: Options) -> None:
    try:
        parking.started(task.request.id, options.demand)
    except Error:
        # The row stays; the sweep may publish it again, and that copy is
        # dropped (TaskAlreadyRan) or deferred as a live duplicate.
        logger.exception("Could not delete the parked row of task %s", task.request.id)


def current_owner(task: Any, pid: int | None = None) -> TaskOwner:
    return task_keys.owner(task.request.id, task.name, task.request.hostname or "", pid)


def _park_permit(key: str, task: Any, delay: float) -> None:
    """Mark the permit as held by no process: the task's next attempt, due
    in ``delay`` seconds, adopts it. No heartbeat renews it meanwhile, so its
    lease is pushed past the delay plus one lease (never shortened, never
    revived once lapsed: the next attempt then takes a new one)."""
    parked = str(current_owner(task, pid=NO_PROCESS))
    alias = routing.alias_for_key(key)
    lease: Lease | None = getattr(task.request, TASK_LEASE_ATTRIBUTE, None)
    if lease is None:
        task_keys.update_held(alias, lambda held: held.filter(external_id=key), owner=parked)
        return
    lease.drop()
    kept_until = DatabaseNow() + timedelta(seconds=math.ceil(delay) + lease.ttl)
    task_keys.update_held(
        alias,
        lambda held: held.filter(external_id=key, expires_at__gt=DatabaseNow()),
        owner=parked,
        expires_at=Greatest(F("expires_at"), kept_until),
    )


def _seconds_until(when: Any) -> float:
    """Seconds until a retry runs: its countdown, or its eta (a datetime,
    or ISO text in a message's headers; naive is UTC, as Celery sends it)."""
    if isinstance(when, str):
        when = datetime.fromisoformat(when)
    if isinstance(when, datetime):
        moment = when if when.tzinfo is not None else when.replace(tzinfo=UTC)
        return max(0.0, (moment - datetime.now(UTC)).total_seconds())
    if isinstance(when, int | float) and not isinstance(when, bool):
        return max(0.0, float(when))
    return 0.0


def on_before_task_publish(headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
    """``before_task_publish`` receiver: a task calling ``retry()`` publishes
    its next attempt before ``task_postrun`` runs, and that attempt may start
    at once in another process. Park the permit first, so it is adopted
    rather than mistaken for a live duplicate's."""
    from celery import current_task

    request: Any = getattr(current_task, "request", None)
    key = getattr(request, TASK_KEY_ATTRIBUTE, None)
    if key is None or (headers or {}).get("id") != request.id:
        return
    try:
        _park_permit(key, current_task, _seconds_until((headers or {}).get("eta")))
    except SemaphoreError:
        # The next attempt then defers until postrun parks the permit.
        logger.exception("Could not park the permit %s of task %s", key, request.id)


def on_task_postrun(
    sender: Any = None, task: Any = None, state: str = "", retval: Any = None, **kwargs: Any
) -> None:
    """``task_postrun`` receiver: keep the permit across ``retry()``, release
    it once the task has finished for good (success, failure, revoked)."""
    key = getattr(getattr(task, "request", None), TASK_KEY_ATTRIBUTE, None)
    if key is None:
        return
    try:
        if state == "RETRY":
            # retval is the Retry raised: its ``when`` is the countdown or eta.
            _park_permit(key, task, _seconds_until(getattr(retval, "when", None)))
        else:
            api.release(key)
    except SemaphoreError:
        # The sweep releases what could not be released here; never fail the worker.
        logger.exception("Could not settle the permit %s of task %s", key, task.request.id)
