"""``PermitTask``: the Celery task class whose sending decides who may wait.

``@holds_permit`` runs in the worker; what happens when a task is *sent*
needs the task class. With ``base=PermitTask``, a task whose decorator sets
``on_conflict``, ``max_waiting`` or ``debounce`` is parked as it is sent, in one
transaction under its semaphores' row locks (``parking.admission``):
published once that committed where it fits, waiting in line where it does
not -- or discarded, replacing, refused, as its policy says.
"""

from __future__ import annotations

import functools
import logging
from datetime import timedelta
from typing import Any

from celery import Task
from celery.utils import uuid
from django.utils import timezone

from django_semaphore import parking
from django_semaphore.integrations.options import OPTIONS_ATTRIBUTE, Options
from django_semaphore.parking import admission, wake
from django_semaphore.parking.rows import Row

logger = logging.getLogger("django_semaphore")


class PermitTask(Task):  # type: ignore[misc]
    """A Celery task class: ``@shared_task(base=PermitTask)`` applies
    ``@holds_permit``'s ``on_conflict``, ``max_waiting`` and ``debounce``
    when the task is sent.

    ``apply_async`` (so ``delay``, and a chain's or a group's tasks) returns
    the task's result as usual; when ``on_conflict="discard"`` dropped it,
    the result of the task it found holding or waiting (its ``id`` says
    which); when its ``debounce`` collapsed it, the waiting one's. It raises
    ``SemaphoreExhausted`` when discarded where no task holds or waits (a
    view holds, a rate limit is full), ``LineFull`` past ``max_waiting``.
    Its own retries, a parked task published again and
    ``task_always_eager`` are sent as Celery sends them. ``send_task`` by
    name bypasses the class.
    """

    # What the run checks: a task whose on_conflict no send decided fails.
    decides_when_sent = True

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        policy = _policy(self)
        if (
            policy is None
            or wake.republishing()
            or self.app.conf.task_always_eager
            or (task_id is not None and task_id == self.request.id)  # its own retry
        ):
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        call = policy.for_call(*(args or ()), **(kwargs or {}))
        task_id = task_id or uuid()
        expires = options.get("expires")
        if isinstance(expires, int | float) and not isinstance(expires, bool):
            # Relative to now, not to a publish that may come later.
            options["expires"] = timezone.now() + timedelta(seconds=expires)
        signature = self.signature(
            args, kwargs, task_id=task_id, link=link, link_error=link_error, shadow=shadow,
            **options,
        )  # fmt: skip
        row_of = functools.partial(
            Row.of_celery, self, signature, priority=call.priority_or(0), share=call.share_key
        )
        admitted = admission.enqueue(row_of, call.demand, call.policy)
        if admitted.existing:
            existing = admitted.existing[0]
            logger.info("Task %s[%s] discarded: %s holds or waits", self.name, task_id, existing)
            return self.AsyncResult(existing)
        for replaced in admitted.replaced:
            logger.info("Task %s[%s] replaced by %s", self.name, replaced, task_id)
            _mark_revoked(self, replaced)
        if admitted.waits:
            parking.set_state(self, call.demand, task_id)
        return self.AsyncResult(task_id)


def _policy(task: Task) -> Options | None:
    """The options of the task's ``@holds_permit``, if they decide anything
    when it is sent (``autoretry_for`` keeps the body as ``_orig_run``)."""
    for run in (getattr(task, "_orig_run", None), task.run):
        options = getattr(run, OPTIONS_ATTRIBUTE, None)
        if options is not None:
            return options if options.has_send_policy else None
    return None


def _mark_revoked(task: Task, task_id: str) -> None:
    """A replaced task never runs: say so in the result backend, if the
    task keeps results."""
    if task.ignore_result:
        return
    try:
        task.backend.mark_as_revoked(task_id, reason="replaced", request=None)
    except Exception:  # a disabled or unreachable backend must not fail the send
        logger.warning("Could not record the replaced task %s as revoked", task_id, exc_info=True)
