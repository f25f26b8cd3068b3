"""What is kept beside the semaphores: waiters' tickets, the capacity
history, and the fencing marks of downstream resources."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models.functions import Now
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from django_semaphore.limits import Limit
from django_semaphore.managers import TicketManager
from django_semaphore.validation import MAX_LENGTH


class Ticket(models.Model):
    """A waiter's place in the line of one semaphore: a waiting acquire's
    or a parked task's, under the key its permit is (to be) claimed with.

    Taken under the semaphore's row lock, so on each semaphore ticket ids
    follow the order of its grant transactions (see ``engine/fairness.py``).
    Its place is ``(ranked_at, id)``: when it came (its share key's turn,
    ``turn_at``, for a waiter with one), moved earlier by its priority's
    head start (``engine/line.py``), then its id.
    ``lacked``: the waiter lacked room on this semaphore (then, at a later
    attempt, or when a wake-up passed it over) or was woken to take it;
    only then does it hold back younger waiters here, by keeping the room it
    asks for. It stops holding back at ``expires_at``: a waiter's
    lease (``TICKET_LEASE``, renewed while it waits), a parked task's expiry.
    """

    semaphore = models.ForeignKey(
        "django_semaphore.Semaphore", on_delete=models.CASCADE, related_name="tickets"
    )
    external_id = models.CharField(_("key"), max_length=MAX_LENGTH)
    owner = models.CharField(_("owner"), max_length=MAX_LENGTH, blank=True)
    count = models.PositiveIntegerField(_("count"), default=1)
    created_at = models.DateTimeField(_("waiting since"))
    expires_at = models.DateTimeField(_("expires at"))
    lacked = models.BooleanField(_("lacked room here"), default=True)
    priority = models.SmallIntegerField(_("priority"), default=0, db_default=0)
    # Database defaults: a ticket taken by code that predates these columns
    # (a deploy under way) is in line from when it came, at priority 0.
    ranked_at = models.DateTimeField(_("in line from"), default=timezone.now, db_default=Now())
    # A share key's waiters take turns with other keys' (``engine/line.turn``);
    # "" and no turn: a waiter without one, in line from when it came.
    share = models.CharField(
        _("share"), max_length=MAX_LENGTH, blank=True, default="", db_default=""
    )
    turn_at = models.DateTimeField(_("share's turn"), null=True, blank=True)
    # The parked task whose ticket this is, by key (no column of its own):
    # none for a waiter's.
    parked = models.ForeignObject(
        "django_semaphore.ParkedTask",
        on_delete=models.DO_NOTHING,
        from_fields=["external_id"],
        to_fields=["key"],
        related_name="tickets",
        null=True,
    )

    objects = TicketManager()

    class Meta:
        verbose_name = _("ticket")
        verbose_name_plural = _("tickets")
        ordering = ["ranked_at", "id"]
        constraints = [
            # One place per key and semaphore: a retried acquire keeps its
            # place. Key first: a parked task's tickets are found by its id.
            models.UniqueConstraint(
                fields=["external_id", "semaphore"], name="semaphore_ticket_key"
            ),
        ]
        indexes = [
            # The sweep deletes dead tickets by expiry.
            models.Index(fields=["expires_at"], name="semaphore_ticket_expiry"),
            # A semaphore's line: those holding back, or not, in order.
            models.Index(fields=["semaphore", "lacked", "id"], name="semaphore_ticket_line"),
            # A share key's latest turn on a semaphore (``TicketQuerySet.turns``).
            models.Index(fields=["semaphore", "share", "turn_at"], name="semaphore_ticket_share"),
        ]

    def __str__(self) -> str:
        return f"{self.external_id}@{self.semaphore_id}#{self.id}"

    @property
    def waiter(self) -> str:
        """Who waits: a waiter's owner, or the parked task (select the
        ``parked`` relation with the tickets)."""
        if self.parked is not None:
            return _("parked %(task)s") % {"task": self.parked.task_name}
        return self.owner


class CapacityChange(models.Model):
    """Audit trail: every capacity (and window) change, from the admin or from code."""

    semaphore = models.ForeignKey(
        "django_semaphore.Semaphore", on_delete=models.CASCADE, related_name="capacity_changes"
    )
    old_capacity = models.PositiveIntegerField(_("old capacity"))
    new_capacity = models.PositiveIntegerField(_("new capacity"))
    # A windowed semaphore's window, seconds (None: no window), before and
    # after; equal when only the capacity changed.
    old_window = models.PositiveIntegerField(_("old window"), null=True, blank=True)
    new_window = models.PositiveIntegerField(_("new window"), null=True, blank=True)
    changed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name=_("changed by"),
    )
    changed_at = models.DateTimeField(_("changed at"), auto_now_add=True, db_index=True)
    reason = models.CharField(_("reason"), max_length=MAX_LENGTH, blank=True)

    class Meta:
        verbose_name = _("capacity change")
        verbose_name_plural = _("capacity changes")
        ordering = ["-changed_at", "-id"]

    def __str__(self) -> str:
        return f"{self.semaphore_id}: {self.old_limit} → {self.new_limit}"

    @property
    def old_limit(self) -> Limit:
        return Limit(self.old_capacity, self.old_window)

    @property
    def new_limit(self) -> Limit:
        return Limit(self.new_capacity, self.new_window)


class FencingMark(models.Model):
    """The highest fencing token a downstream resource has accepted."""

    resource = models.CharField(_("resource"), max_length=MAX_LENGTH, unique=True)
    token = models.PositiveBigIntegerField(_("highest token"))
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)

    class Meta:
        verbose_name = _("fencing mark")
        verbose_name_plural = _("fencing marks")

    def __str__(self) -> str:
        return f"{self.resource}@{self.token}"
