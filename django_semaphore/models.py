"""What is stored: semaphores, the requests holding them, and their audit trails."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from django.conf import settings
from django.db import models, router, transaction
from django.db.models import Q
from django.utils.functional import cached_property
from django.utils.translation import gettext_lazy as _

from django_semaphore import signals
from django_semaphore.exceptions import SemaphoreNotFound
from django_semaphore.guards import GuardedModel, engine_is_writing, engine_writes
from django_semaphore.managers import PermitManager, PermitRequestManager, SemaphoreManager
from django_semaphore.states import ReleaseReason, State
from django_semaphore.validation import validate_capacity

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser

MAX_NAME_LENGTH = 255

# What an ORM write is told to use instead (see guards.py).
ENGINE_ONLY = "only the engine writes it, under the semaphore's row lock."
USE_SET_CAPACITY = (
    "change capacity with set_capacity(name, capacity), which locks "
    "the row and records a CapacityChange (or load the row, set capacity and save() it)."
)
USE_ACQUIRE = "acquire(), which grants a request and its permits together"
USE_RELEASE = (
    "end a request with release(key), or force-release it (the admin's action, "
    "manage.py semaphore_release, force_release(keys)): permits and request change together."
)


class Semaphore(GuardedModel):
    """One counting semaphore; acquire locks this row to serialize its grants.

    Safe to use with the ORM: ``objects.create()`` (or ``save()`` of a new
    instance) creates one; ``save()`` of a loaded one writes back ``name``,
    ``fair`` and a changed ``capacity`` (recorded as ``set_capacity`` does),
    never the engine-owned columns. Bulk writes of those columns or of
    ``capacity`` are refused (``UnsafeWrite``), and so is deleting a held
    semaphore (``PermitHeld``). See docs/concepts.md, "Using the models".
    """

    # The columns written only by the engine's own statements, under the row
    # lock. save() never writes them back; bulk writes of them are refused.
    ENGINE_OWNED_FIELDS: ClassVar[tuple[str, ...]] = ("in_use", "fencing_counter", "queued_until")
    ORM_REFUSED: ClassVar[dict[str, str]] = {
        **dict.fromkeys(ENGINE_OWNED_FIELDS, ENGINE_ONLY),
        "capacity": USE_SET_CAPACITY,
        # Set when a family creates the member: only members are ever deleted
        # by the clean-up, so marking a declared semaphore one would lose it.
        "family": "only a family's first use sets it (see families.py).",
    }

    name = models.CharField(_("name"), max_length=MAX_NAME_LENGTH, unique=True)
    capacity = models.PositiveIntegerField(_("capacity"))
    # Bumped under the row lock by every grant: the fencing token source, and
    # the write that makes concurrent grants conflict on Galera (see DESIGN).
    fencing_counter = models.PositiveBigIntegerField(
        _("last fencing token"), default=0, editable=False
    )
    # The permits held: the sum of the ACQUIRED permits' counts, changed in
    # the same transaction as every permit state change, so the grant's room
    # check reads one locked row whatever is held (see ``grant.py``).
    in_use = models.PositiveIntegerField(_("in use"), default=0, editable=False)
    fair = models.BooleanField(
        _("fair (first come, first served)"),
        default=False,
        help_text=_(
            "Waiters queue and are granted in arrival order, so a request for "
            "many permits is never starved by a stream of small ones."
        ),
    )
    # The latest deadline of a ticket queued on this semaphore, written under
    # the row lock when a ticket is taken. The grant's locking read returns it:
    # while it is in the past no ticket can be live, so an acquire skips the
    # queue check and pays nothing for fairness.
    queued_until = models.DateTimeField(_("queued until"), null=True, blank=True, editable=False)
    # The pattern of the family this semaphore was created from on first use
    # (``SEMAPHORES = {"export:customer:*": 2}``, see ``families.py``); empty
    # for every other semaphore. Only members are ever deleted by the
    # clean-up, and only while idle.
    family = models.CharField(
        _("family"), max_length=MAX_NAME_LENGTH, blank=True, default="", editable=False
    )
    # A member whose capacity was changed on its own (admin, set_capacity):
    # it keeps that capacity when the family default changes, and the
    # clean-up keeps it.
    own_capacity = models.BooleanField(_("own capacity"), default=False, editable=False)
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)

    objects = SemaphoreManager()

    class Meta:
        verbose_name = _("semaphore")
        verbose_name_plural = _("semaphores")
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(condition=Q(capacity__gte=0), name="semaphore_capacity_gte_0"),
        ]
        indexes = [
            # A family's members: the live-member count, the admin's filter,
            # and the clean-up's look-up of idle members (by last grant).
            models.Index(fields=["family", "updated_at"], name="semaphore_family_idle"),
        ]

    def __str__(self) -> str:
        return self.name

    def save(
        self,
        *,
        force_insert: bool | tuple[models.base.ModelBase, ...] = False,
        force_update: bool = False,
        using: str | None = None,
        update_fields: Iterable[str] | None = None,
    ) -> None:
        """Create the semaphore, or write back what may be written of it.

        On an existing row the engine-owned columns are never written (the
        instance's copy of them is stale the moment a grant commits), and a
        capacity changed since the instance was loaded is changed as
        ``set_capacity`` does it: under the row lock, with a
        ``CapacityChange`` (no user, no reason). A capacity the instance did
        not change is not written back, so a stale instance never undoes
        someone else's change.

        Raises:
            UnsafeWrite: an engine-owned column was changed on the instance.
            InvalidRequest: the new capacity is out of range.
            SemaphoreNotFound: ``update_fields`` or ``force_update`` was given
                and the row is gone (Django would raise ``DatabaseError``).
        """
        if self.pk is None or force_insert or engine_is_writing():
            super().save(
                force_insert=force_insert,
                force_update=force_update,
                using=using,
                update_fields=update_fields,
            )
            self._remember_loaded()
            return
        using = using or router.db_for_write(Semaphore, instance=self)
        names = self._writable_fields(update_fields)
        capacity = None
        if "capacity" in names:
            names.discard("capacity")
            if self._changed("capacity"):
                capacity = validate_capacity(self.capacity)
                names.add("updated_at")  # and so pre_save/post_save are sent
        with transaction.atomic(using=using):
            locked = Semaphore.objects.using(using).filter(pk=self.pk).locked().first()
            if locked is None:
                if update_fields is not None or force_update:
                    raise SemaphoreNotFound([self.name])
                # Deleted since it was loaded: saved anew, as Django would.
                super().save(using=using, force_insert=True)
            else:
                if capacity is not None:
                    locked.record_capacity_change(capacity, changed_by=None, reason="", using=using)
                if names:
                    super().save(using=using, update_fields=names)
        self._remember_loaded()

    def record_capacity_change(
        self,
        capacity: int,
        *,
        changed_by: AbstractBaseUser | None,
        reason: str,
        using: str,
    ) -> None:
        """Change the capacity of this row, which the caller's transaction
        holds locked, and record it in ``CapacityChange``: the one home of a
        capacity change, for ``set_capacity`` and ``save()`` alike."""
        if self.capacity == capacity:
            return
        CapacityChange.objects.using(using).create(
            semaphore=self,
            old_capacity=self.capacity,
            new_capacity=capacity,
            changed_by_id=None if changed_by is None else changed_by.pk,
            reason=reason,
        )
        raised = capacity - self.capacity
        self.capacity = capacity
        # A family member changed on its own no longer follows its family
        # default (engine/families.py), and the clean-up keeps it.
        self.own_capacity = bool(self.family)
        with engine_writes():
            self.save(using=using, update_fields=["capacity", "own_capacity", "updated_at"])
        if raised > 0 and signals.permits_freed.has_listeners(Semaphore):
            # Room made: parked tasks that fit now are woken once this commits.
            freed = {self.pk: raised}
            transaction.on_commit(
                lambda: signals.permits_freed.send_robust(
                    sender=Semaphore, freed=freed, using=using
                ),
                using=using,
            )


class PermitRequest(GuardedModel):
    """One acquire call: all the permits it was granted, over 1..n semaphores.

    Its ``state`` is written only by the engine (bulk writes of it are
    refused); a held request cannot be deleted (``PermitHeld``).
    """

    ENGINE_OWNED_FIELDS: ClassVar[tuple[str, ...]] = ("state", "released_at", "release_reason")
    ORM_REFUSED: ClassVar[dict[str, str]] = {"state": USE_RELEASE}
    CREATED_BY: ClassVar[str] = USE_ACQUIRE

    external_id = models.CharField(
        _("key"),
        max_length=MAX_NAME_LENGTH,
        unique=True,
        help_text=_("Idempotency key chosen by the caller: job id, task id, UUID."),
    )
    owner = models.CharField(_("owner"), max_length=MAX_NAME_LENGTH, blank=True)
    state = models.CharField(
        _("state"), max_length=8, choices=State.choices, default=State.ACQUIRED
    )
    ttl = models.PositiveIntegerField(
        _("TTL (seconds)"), null=True, blank=True, help_text=_("Empty: no TTL.")
    )
    expires_at = models.DateTimeField(_("expires at"), null=True, blank=True)
    created_at = models.DateTimeField(_("created at"))
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)
    released_at = models.DateTimeField(_("released at"), null=True, blank=True)
    release_reason = models.CharField(
        _("release reason"), max_length=16, choices=ReleaseReason.choices, blank=True
    )

    objects = PermitRequestManager()

    class Meta:
        verbose_name = _("permit request")
        verbose_name_plural = _("permit requests")
        # Ending someone else's permit is a separate power from viewing them;
        # the admin's force-release action is guarded by it.
        permissions = [("force_release_permitrequest", _("Can force-release permit requests"))]
        indexes = [
            # The TTL sweep and inline reclaim look up ACQUIRED rows by expiry.
            models.Index(fields=["state", "expires_at"], name="semaphore_req_expiry"),
            # The staleness sweep finds long-held requests by age.
            models.Index(fields=["state", "created_at"], name="semaphore_req_age"),
            # The retention clean-up finds long-released requests.
            models.Index(fields=["state", "released_at"], name="semaphore_req_released"),
        ]

    def __str__(self) -> str:
        return self.external_id

    @property
    def is_held(self) -> bool:
        return self.state == State.ACQUIRED

    @cached_property
    def fencing_tokens(self) -> dict[str, int]:
        """Semaphore name -> the fencing token of this request's permit on it."""
        return dict(self.permits.values_list("semaphore__name", "fencing_token"))

    def token(self, name: str) -> int:
        """The fencing token to hand to downstream writes guarded by ``name``."""
        try:
            return self.fencing_tokens[name]
        except KeyError:
            raise KeyError(f"Request {self.external_id!r} holds no permit on {name!r}.") from None


class Permit(GuardedModel):
    """The share of one request on one semaphore; written only by the engine.

    Bulk writes of its columns are refused; a held permit cannot be deleted.
    """

    ENGINE_OWNED_FIELDS: ClassVar[tuple[str, ...]] = (
        "semaphore",
        "request",
        "count",
        "state",
        "fencing_token",
    )
    ORM_REFUSED: ClassVar[dict[str, str]] = dict.fromkeys(
        ENGINE_OWNED_FIELDS, "permits are written only by acquire and release; " + USE_RELEASE
    )
    CREATED_BY: ClassVar[str] = USE_ACQUIRE

    semaphore = models.ForeignKey(Semaphore, on_delete=models.CASCADE, related_name="permits")
    request = models.ForeignKey(PermitRequest, on_delete=models.CASCADE, related_name="permits")
    count = models.PositiveIntegerField(_("count"), default=1)
    state = models.CharField(
        _("state"), max_length=8, choices=State.choices, default=State.ACQUIRED
    )
    fencing_token = models.PositiveBigIntegerField(_("fencing token"))

    objects = PermitManager()

    class Meta:
        verbose_name = _("permit")
        verbose_name_plural = _("permits")
        indexes = [
            # Covers the in-use sum (semaphore, state) -> SUM(count) so it reads
            # the index alone and never the history of released permits.
            models.Index(fields=["semaphore", "state", "count"], name="semaphore_permit_in_use"),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(count__gte=1), name="semaphore_permit_count_gte_1"),
            models.UniqueConstraint(
                fields=["semaphore", "fencing_token"], name="semaphore_permit_unique_token"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.request_id}:{self.semaphore_id}x{self.count}"


class Ticket(models.Model):
    """A fair waiter's place in the queue of one semaphore.

    Taken under the semaphore's row lock by the attempt that found no room, so
    on each semaphore ticket ids follow the order of its grant transactions
    (see ``fairness.py``). It stops blocking others at ``expires_at``, the
    waiter's deadline, whether the waiter is granted, gives up or crashed.
    """

    semaphore = models.ForeignKey(Semaphore, on_delete=models.CASCADE, related_name="tickets")
    external_id = models.CharField(_("key"), max_length=MAX_NAME_LENGTH)
    owner = models.CharField(_("owner"), max_length=MAX_NAME_LENGTH, blank=True)
    count = models.PositiveIntegerField(_("count"), default=1)
    created_at = models.DateTimeField(_("waiting since"))
    expires_at = models.DateTimeField(_("expires at"))

    class Meta:
        verbose_name = _("ticket")
        verbose_name_plural = _("tickets")
        ordering = ["id"]
        constraints = [
            # One place per key and semaphore: a retried acquire keeps its place.
            models.UniqueConstraint(
                fields=["semaphore", "external_id"], name="semaphore_ticket_unique_key"
            ),
        ]
        indexes = [
            # The sweep deletes dead tickets by expiry.
            models.Index(fields=["expires_at"], name="semaphore_ticket_expiry"),
        ]

    def __str__(self) -> str:
        return f"{self.external_id}@{self.semaphore_id}#{self.id}"


class CapacityChange(models.Model):
    """Audit trail: every capacity change, from the admin or from code."""

    semaphore = models.ForeignKey(
        Semaphore, on_delete=models.CASCADE, related_name="capacity_changes"
    )
    old_capacity = models.PositiveIntegerField(_("old capacity"))
    new_capacity = models.PositiveIntegerField(_("new capacity"))
    changed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name=_("changed by"),
    )
    changed_at = models.DateTimeField(_("changed at"), auto_now_add=True, db_index=True)
    reason = models.CharField(_("reason"), max_length=MAX_NAME_LENGTH, blank=True)

    class Meta:
        verbose_name = _("capacity change")
        verbose_name_plural = _("capacity changes")
        ordering = ["-changed_at", "-id"]

    def __str__(self) -> str:
        return f"{self.semaphore_id}: {self.old_capacity} -> {self.new_capacity}"


class FencingMark(models.Model):
    """The highest fencing token a downstream resource has accepted."""

    resource = models.CharField(_("resource"), max_length=MAX_NAME_LENGTH, unique=True)
    token = models.PositiveBigIntegerField(_("highest token"))
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)

    class Meta:
        verbose_name = _("fencing mark")
        verbose_name_plural = _("fencing marks")

    def __str__(self) -> str:
        return f"{self.resource}@{self.token}"


class ParkedTask(models.Model):
    """A Celery task that found no room and waits, without a broker message,
    until releases make room for it (``parking.py``).

    Holds what publishing it again exactly takes: the message's body as the
    task's serializer encoded it (name, id, args, kwargs and the options the
    worker received: queue, routing key, priority, headers, expiry). Its
    ``ParkedDemand`` rows say what it waits for, per semaphore.
    """

    task_id = models.CharField(_("task id"), max_length=MAX_NAME_LENGTH, unique=True)
    task_name = models.CharField(_("task"), max_length=MAX_NAME_LENGTH)
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
    parked task's id) per semaphore when its permits are released."""

    task = models.ForeignKey(ParkedTask, on_delete=models.CASCADE, related_name="demands")
    semaphore = models.ForeignKey(
        Semaphore, on_delete=models.CASCADE, related_name="parked_demands"
    )
    count = models.PositiveIntegerField(_("count"), default=1)

    class Meta:
        verbose_name = _("parked demand")
        verbose_name_plural = _("parked demands")
        constraints = [
            models.UniqueConstraint(fields=["semaphore", "task"], name="semaphore_parked_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.task_id}@{self.semaphore_id}x{self.count}"
