"""Waking parked Celery tasks (see ``parking`` for the whole story): a
release that freed permits wakes the oldest parked tasks that fit, in
their semaphores' lines, and publishes their messages once that
is committed. The doors call it through ``parking.room_made``; the beat
sweep (``sweep.sweep_parked``) is the backstop.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable
from contextvars import ContextVar

from django.db import Error, connections, transaction

from django_semaphore import process
from django_semaphore.engine import wakeups
from django_semaphore.exceptions import SemaphoreError
from django_semaphore.models import ParkedTask
from django_semaphore.parking import deferred
from django_semaphore.retry import run_with_retries

logger = logging.getLogger("django_semaphore")


# The task a wake-up for later is published as: when a rate limit's next slot
# ends, or a debounced send's delay.
WAKE_SLOTS = "django_semaphore.wake_slots"
# A wake-up this process published for a slot's end that comes no later
# than SLOT_SLACK seconds after a newer one's makes the newer one needless.
SLOT_SLACK = 0.05


def wake(alias: str, semaphore_ids: Iterable[int]) -> int:
    """Mark the oldest parked tasks that fit in the room on these semaphores,
    and publish them once that is committed; returns how many were woken.

    Never raises for the database: what it could not do, the beat sweep does.
    """
    ids = set(semaphore_ids)
    if not ids:
        return 0
    connection = connections[alias]
    try:
        woken = run_with_retries(connection, functools.partial(wakeups.wake_once, connection, ids))
    except SemaphoreError:
        logger.exception("Could not wake parked tasks of semaphores %s", sorted(ids))
        return 0
    if woken:
        # At once, or when the caller's transaction commits, if it has one.
        transaction.on_commit(functools.partial(publish, alias, woken), using=alias)
    return len(woken)


class Scheduled(process.State):
    """The slot wake-ups this process published."""

    def reset(self) -> None:
        self.lock = threading.Lock()
        # (alias, semaphore id) -> time.monotonic() when the last one is due.
        self.due: dict[tuple[str, int], float] = {}


SCHEDULED = Scheduled()


def schedule_slots(alias: str, semaphore_ids: set[int]) -> None:
    """Publish a wake-up (``WAKE_SLOTS``) for when the next slot ends on each
    rate limit among these that parked tasks wait on: a rate limit gains
    room when its window moves on, and no release says so. Called where a
    task parks, by that wake-up itself (so they follow one another while
    tasks wait) and by the beat sweep (the backstop of one lost); one a
    process per slot's end. Without Celery, nothing: a Django task refused
    by a rate limit waits for its slot in its backend."""
    try:
        from celery import current_app
    except ImportError:
        return

    try:
        due = wakeups.next_slots(alias, semaphore_ids)
    except Error:
        logger.warning("Could not read when the rate limits %s free a slot", sorted(semaphore_ids))
        return
    now = time.monotonic()
    for id, seconds in due.items():
        with SCHEDULED.lock:
            earlier = SCHEDULED.due.get((alias, id), 0.0)
            if now < earlier <= now + seconds + SLOT_SLACK:
                continue
            SCHEDULED.due[(alias, id)] = now + seconds
        try:
            current_app.send_task(WAKE_SLOTS, args=(alias, [id]), countdown=seconds)
        except Exception:  # the broker's errors are as varied as brokers
            logger.exception("Could not publish the wake-up of rate limit %s", id)
            with SCHEDULED.lock:
                SCHEDULED.due.pop((alias, id), None)


def wake_later(alias: str, semaphore_ids: set[int], seconds: float) -> None:
    """Publish a wake-up of these semaphores' parked tasks (``WAKE_SLOTS``)
    for ``seconds`` from now: a debounced send's delay ends then. Lost, the
    beat sweep wakes it."""
    from celery import current_app

    try:
        current_app.send_task(WAKE_SLOTS, args=(alias, sorted(semaphore_ids)), countdown=seconds)
    except Exception:  # the broker's errors are as varied as brokers
        logger.exception("Could not publish the wake-up of semaphores %s", sorted(semaphore_ids))


def publish(alias: str, parked_ids: list[int]) -> int:
    """Publish the messages of these woken rows (a Django task's: resume its
    deferred result); returns how many went out.

    A task whose publish fails is not woken any more (``woken_at`` cleared)
    but keeps its place, first in line: the next wake-up (the beat sweep's,
    at the latest) tries again; the row is never lost.
    """
    rows = ParkedTask.objects.using(alias).filter(id__in=parked_ids).order_by("id")
    sent = 0
    for parked in rows:
        try:
            if parked.backend:
                deferred.resume(parked.task_id)
            else:
                _send(parked)
        except Exception:  # the broker's errors are as varied as brokers
            logger.exception("Could not publish the parked task %s", parked)
            ParkedTask.objects.using(alias).filter(pk=parked.pk).update(woken_at=None)
            continue
        sent += 1
    return sent


def _send(parked: ParkedTask) -> None:
    """Publish a parked Celery task's message again."""
    from celery import current_app
    from kombu import serialization

    message = serialization.loads(  # type: ignore[no-untyped-call]
        bytes(parked.body),
        parked.content_type,
        parked.content_encoding,
        accept={parked.content_type},
    )
    token = _REPUBLISHING.set(True)
    try:
        current_app.signature(message).apply_async()
    finally:
        _REPUBLISHING.reset(token)


# Set while a parked task's message is published: the enqueue-time policies
# (``PermitTask``) decided on it when it was first sent.
_REPUBLISHING: ContextVar[bool] = ContextVar("django_semaphore_republishing", default=False)


def republishing() -> bool:
    """Whether the task being sent now is a parked task published again."""
    return _REPUBLISHING.get()
