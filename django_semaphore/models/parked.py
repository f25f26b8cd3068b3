"""Parked Celery tasks (``parking``); their places in line are tickets."""

from __future__ import annotations

from datetime import UTC, datetime

from django.db import models
from django.utils.translation import gettext_lazy as _

from django_semaphore.validation import MAX_LENGTH

# The ``not_before`` of a row its sender's transaction has not confirmed
# yet (``parking.aside``): no wake-up reaches it meanwhile.
SENDING = datetime(9000, 1, 1, tzinfo=UTC)


class ParkedTask(models.Model):
    """A task that found no room and waits, without a broker message or a
    worker, until releases make room for it (``parking``).

    A Celery task's row holds what publishing it again exactly takes: the
    message's body as the task's serializer encoded it (name, id, args,
    kwargs and the options the worker received: queue, routing key,
    priority, headers, expiry). A Django task's names its ``backend``
    instead, where its result waits, deferred, to be run again. What it
    waits for, and its place in each semaphore's line, are its ``Ticket``
    rows, under its ``key`` as a waiter's are under its own.
    """

    task_id = models.CharField(_("task id"), max_length=MAX_LENGTH, unique=True)
    # The key its run claims its permit under, and its tickets stand under:
    # the task id, or a later generation of it once a permit under the id
    # was released (integrations.task_keys).
    key = models.CharField(_("key"), max_length=MAX_LENGTH, unique=True)
    task_name = models.CharField(_("task"), max_length=MAX_LENGTH)
    # A Django task's backend (an alias of TASKS); empty for a Celery task.
    backend = models.CharField(_("task backend"), max_length=100, blank=True)
    # A Celery task's signature as its serializer encoded it (kombu.serialization).
    body = models.BinaryField(_("message body"))
    content_type = models.CharField(_("content type"), max_length=100)
    content_encoding = models.CharField(_("content encoding"), max_length=30)
    parked_at = models.DateTimeField(_("parked at"))
    # Set when a release woke it and its message is being (or was) published;
    # its tickets keep the room it asks for until its run deletes them.
    woken_at = models.DateTimeField(_("woken at"), null=True, blank=True)
    # A debounced send's delay: never woken before it ends (parking.admission).
    not_before = models.DateTimeField(_("not before"), null=True, blank=True)
    # The caller's ``expires``: past it the task is dropped, never published.
    expires_at = models.DateTimeField(_("expires at"), null=True, blank=True)

    class Meta:
        verbose_name = _("parked task")
        verbose_name_plural = _("parked tasks")
        ordering = ["id"]
        indexes = [
            # The beat sweep finds wakes whose publish is overdue.
            models.Index(fields=["woken_at"], name="semaphore_parked_woken"),
        ]

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}]"
