"""Parked Celery tasks, and what each waits for (``parking``)."""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

from django_semaphore.models.semaphore import Semaphore
from django_semaphore.validation import MAX_LENGTH


class ParkedTask(models.Model):
    """A Celery task that found no room and waits, without a broker message,
    until releases make room for it (``parking``).

    Holds what publishing it again exactly takes: the message's body as the
    task's serializer encoded it (name, id, args, kwargs and the options the
    worker received: queue, routing key, priority, headers, expiry). Its
    ``ParkedDemand`` rows say what it waits for, per semaphore.
    """

    task_id = models.CharField(_("task id"), max_length=MAX_LENGTH, unique=True)
    task_name = models.CharField(_("task"), max_length=MAX_LENGTH)
    # The signature as the task's serializer encoded it (kombu.serialization).
    body = models.BinaryField(_("message body"))
    content_type = models.CharField(_("content type"), max_length=100)
    content_encoding = models.CharField(_("content encoding"), max_length=30)
    parked_at = models.DateTimeField(_("parked at"))
    # Set when a release woke it and its message is being (or was) published;
    # the room it asks for is kept for it until its run deletes the row.
    woken_at = models.DateTimeField(_("woken at"), null=True, blank=True)
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


class ParkedDemand(models.Model):
    """What a parked task waits for on one semaphore; read FIFO (by the
    parked task's id) per semaphore when its permits are released.

    ``lacked``: the task has lacked room here (when it parked, or at a
    wake-up that passed it over); from then on it holds back younger tasks
    on this semaphore. ``elsewhere``: it has lacked room on another of its
    semaphores, so a wake-up of this one looks for it only among the
    oldest (see ``engine/wakeups``).
    """

    task = models.ForeignKey(ParkedTask, on_delete=models.CASCADE, related_name="demands")
    semaphore = models.ForeignKey(
        Semaphore, on_delete=models.CASCADE, related_name="parked_demands"
    )
    count = models.PositiveIntegerField(_("count"), default=1)
    lacked = models.BooleanField(_("lacked room here"), default=False)
    elsewhere = models.BooleanField(_("lacked room elsewhere"), default=False)

    class Meta:
        verbose_name = _("parked demand")
        verbose_name_plural = _("parked demands")
        constraints = [
            models.UniqueConstraint(fields=["semaphore", "task"], name="semaphore_parked_unique"),
        ]
        indexes = [
            # A wake-up's window: the oldest held back here, the oldest
            # held back nowhere else (engine/wakeups).
            models.Index(fields=["semaphore", "lacked", "task"], name="semaphore_parked_lacked"),
            models.Index(
                fields=["semaphore", "elsewhere", "task"], name="semaphore_parked_elsewhere"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.task_id}@{self.semaphore_id}x{self.count}"
