"""The semaphore: its capacity, and the counters only the engine writes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models, router, transaction
from django.db.models import F, Q
from django.utils.translation import gettext_lazy as _

from django_semaphore.backends import DatabaseNow
from django_semaphore.exceptions import PermitHeld, SemaphoreNotFound, WaitersInLine
from django_semaphore.guards import GuardedModel, engine_is_writing, engine_writes
from django_semaphore.limits import Limit
from django_semaphore.managers import ReleaseCounterManager, SemaphoreManager
from django_semaphore.models.records import CapacityChange
from django_semaphore.states import State
from django_semaphore.validation import (
    MAX_LENGTH,
    MAX_WINDOW,
    validate_capacity,
    validate_flag,
    validate_name,
    validate_window,
)

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser

# What an ORM write is told to use instead (see guards.py).
ENGINE_ONLY = "only the engine writes it, under the semaphore's row lock."
USE_SET_CAPACITY = (
    "change capacity with set_capacity(name, capacity), which locks "
    "the row and records a CapacityChange (or load the row, set capacity and save() it)."
)
USE_SET_WINDOW = (
    "change the window with set_window(name, window), which locks "
    "the row and records a CapacityChange (or load the row, set window and save() it)."
)
USE_ACQUIRE = "acquire(), which grants a request and its permits together"
USE_RELEASE = (
    "end a request with release(key), or force-release it (the admin's action, "
    "manage.py semaphore_release, force_release(keys)): permits and request change together."
)


class Semaphore(GuardedModel):
    """One counting semaphore; acquire locks this row to serialize its grants.

    Safe to use with the ORM: ``objects.create()`` (or ``save()`` of a new
    instance) creates one; ``save()`` of a loaded one writes back ``name``
    (and the deprecated ``fair``) and a changed ``capacity`` or ``window`` (recorded as
    ``set_capacity`` and ``set_window`` do),
    never the engine-owned columns. Bulk writes of those columns or of
    ``capacity`` are refused (``UnsafeWrite``), and so is deleting a held
    semaphore (``PermitHeld``) or one waited on (``WaitersInLine``). See
    docs/concepts.md, "Using the models".
    """

    # The columns written only by the engine's own statements, under the row
    # lock. save() never writes them back; bulk writes of them are refused.
    ENGINE_OWNED_FIELDS: ClassVar[tuple[str, ...]] = (
        "in_use_counter",
        "released_folded",
        "fencing_counter",
        "queued_until",
        "slots_open",
        "slots_closed_until",
    )
    ORM_REFUSED: ClassVar[dict[str, str]] = {
        **dict.fromkeys(ENGINE_OWNED_FIELDS, ENGINE_ONLY),
        "capacity": USE_SET_CAPACITY,
        "window": USE_SET_WINDOW,
        # Set when a family creates the member: only members are ever deleted
        # by the clean-up, so marking a declared semaphore one would lose it.
        "family": "only a family's first use sets it (see families.py).",
    }

    name = models.CharField(_("name"), max_length=MAX_LENGTH, unique=True)
    capacity = models.PositiveIntegerField(_("capacity"))
    # Bumped under the row lock by every grant: the fencing token source, and
    # the write that makes concurrent grants conflict on Galera (see DESIGN).
    fencing_counter = models.PositiveBigIntegerField(
        _("last fencing token"), default=0, editable=False
    )
    # The permits held are ``in_use_counter - (released - released_folded)``,
    # ``released`` being the total on this semaphore's ``ReleaseCounter``:
    # grants raise ``in_use_counter`` under this row's lock, releases add to
    # the other row (so they never queue behind grants), and a grant that
    # finds no room by ``in_use_counter`` alone reads ``released`` and folds
    # it in. Every query of ``Semaphore.objects`` annotates the exact sum as
    # ``in_use`` (``managers.in_use``). See docs/decisions.md, "Room returned
    # on time".
    in_use_counter = models.PositiveIntegerField(_("in-use counter"), default=0, editable=False)
    released_folded = models.PositiveBigIntegerField(
        _("releases folded in"), default=0, editable=False
    )
    in_use: int  # annotated by every query of Semaphore.objects
    # A rate limit (docs/rates.md): with a window, at most ``capacity``
    # permits are granted in any ``window`` seconds, and ``in_use`` counts
    # the permits granted in the current window, released or not. Each such
    # grant's permit keeps the end of its slot (``Permit.slot_ends``).
    window = models.PositiveIntegerField(
        _("window (seconds)"),
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_WINDOW)],
        help_text=_(
            "Empty: at most capacity permits held at once. Set: a rate limit, at most "
            "capacity grants in any window of this many seconds, released or not."
        ),
    )
    # The slots counted on a windowed semaphore: raised by grants, lowered
    # by the grant that finds no room, by the slots that ended since
    # ``slots_closed_until`` (an index range of Permit.slot_ends), so a grant
    # never reads the slots of past windows. ``in_use`` is exact meanwhile:
    # it subtracts the slots that ended and were not closed yet.
    # A database default too: rows inserted by code that predates the
    # column (an older release during a rolling deploy, raw SQL) count none.
    slots_open = models.PositiveIntegerField(
        _("slots open"), default=0, db_default=0, editable=False
    )
    slots_closed_until = models.DateTimeField(
        _("slots closed until"), null=True, blank=True, editable=False
    )
    # Deprecated, read by nothing: every call that waits waits in line. Kept
    # while version 1 of the routines, which reads it, may still be called
    # (a deploy of this release); dropped with them.
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
    # (``SEMAPHORES = {"export:customer:*": 2}``, see ``engine/families.py``); empty
    # for every other semaphore. Only members are ever deleted by the
    # clean-up, and only while idle.
    family = models.CharField(
        _("family"), max_length=MAX_LENGTH, blank=True, default="", editable=False
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
        # Related look-ups (permit.semaphore) annotate ``in_use`` too.
        base_manager_name = "objects"
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

    @property
    def limit(self) -> Limit:
        return Limit(self.capacity, self.window)

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
        capacity or window changed since the instance was loaded is changed
        as ``set_capacity`` and ``set_window`` do it: under the row lock,
        with a ``CapacityChange`` (no user, no reason). One the instance did
        not change is not written back, so a stale instance never undoes
        someone else's change.

        Raises:
            UnsafeWrite: an engine-owned column was changed on the instance.
            InvalidRequest: the name, or the new capacity or window, is
                malformed or out of range (checked before anything is written,
                on a new row too).
            SemaphoreNotFound: ``update_fields`` or ``force_update`` was given
                and the row is gone (Django would raise ``DatabaseError``).
        """
        if self.pk is None or force_insert:
            self.validate_limits()
            using = using or router.db_for_write(Semaphore, instance=self)
            with transaction.atomic(using=using):
                super().save(force_insert=True, using=using)
                ReleaseCounter.objects.using(using).create(semaphore=self)
            self.in_use = self.in_use_counter
            return
        if engine_is_writing():
            super().save(force_update=force_update, using=using, update_fields=update_fields)
            return
        using = using or router.db_for_write(Semaphore, instance=self)
        names = self._writable_fields(update_fields)
        if "name" in names:
            self.name = validate_name(self.name)
        if "fair" in names:
            self.fair = validate_flag(self.fair, "fair")
        # A changed capacity or window is changed as set_capacity and
        # set_window change it; an unchanged one is not written back.
        limits: dict[str, Any] = {}
        for name, validate in (("capacity", validate_capacity), ("window", validate_window)):
            if name in names:
                names.discard(name)
                if self._changed(name):
                    limits[name] = validate(getattr(self, name))
                    names.add("updated_at")  # and so pre_save/post_save are sent
        with transaction.atomic(using=using):
            locked = Semaphore.objects.using(using).filter(pk=self.pk).locked().first()
            if locked is None:
                if update_fields is not None or force_update:
                    raise SemaphoreNotFound([self.name])
                # Deleted since it was loaded: saved anew, as Django would.
                super().save(using=using, force_insert=True)
                ReleaseCounter.objects.using(using).create(semaphore=self)
            else:
                if limits:
                    locked.record_change(
                        replace(locked.limit, **limits), changed_by=None, reason="", using=using
                    )
                if names:
                    super().save(using=using, update_fields=names)
        self._remember_loaded()

    def validate_limits(self) -> None:
        """Refuse a name, capacity or window that ``acquire``, ``set_capacity``
        and ``set_window`` would refuse (and a ``fair`` that is not a bool),
        before a new row is written: else a window of 0 is stored and limits
        nothing, 1.5 is stored as 1, and -1 fails in the driver. A window may
        be given as a ``timedelta``.

        Raises:
            InvalidRequest: says which value is wrong.
        """
        self.name = validate_name(self.name)
        self.capacity = validate_capacity(self.capacity)
        self.window = validate_window(self.window)
        self.fair = validate_flag(self.fair, "fair")

    def refresh_from_db(
        self,
        using: str | None = None,
        fields: Iterable[str] | None = None,
        from_queryset: models.QuerySet[Any] | None = None,
    ) -> None:
        """Reload the fields, and ``in_use`` with them (an annotation, which
        Django's reload leaves as it was)."""
        fields = None if fields is None else [f for f in fields if f != "in_use"] or None
        super().refresh_from_db(using=using, fields=fields, from_queryset=from_queryset)
        semaphores = Semaphore.objects.using(self._state.db)
        self.in_use = semaphores.values_list(F("in_use"), flat=True).get(pk=self.pk)

    def record_change(
        self, limit: Limit, *, changed_by: AbstractBaseUser | None, reason: str, using: str
    ) -> None:
        """Change this row's limit (capacity and window), which the caller's
        transaction holds locked, and record it in ``CapacityChange``: the
        one home of such a change, for ``set_capacity``, ``set_window`` and
        ``save()`` alike.

        A window removed ends the slots still counted (the semaphore limits
        concurrency from then on, and its holders count); a window set or
        changed counts the grants made from then on, each slot keeping the
        end it was granted with.
        """
        if self.limit == limit:
            return
        CapacityChange.objects.using(using).create(
            semaphore=self,
            old_capacity=self.capacity,
            new_capacity=limit.capacity,
            old_window=self.window,
            new_window=limit.window,
            changed_by_id=None if changed_by is None else changed_by.pk,
            reason=reason,
        )
        if self.limit.is_rate and not limit.is_rate:
            close_every_slot(using, [self.pk])
        self.capacity, self.window = limit.capacity, limit.window
        # A family member changed on its own no longer follows its family
        # default (engine/families.py), and the clean-up keeps it.
        self.own_capacity = bool(self.family)
        with engine_writes():
            self.save(
                using=using, update_fields=["capacity", "window", "own_capacity", "updated_at"]
            )


def close_every_slot(using: str, semaphore_ids: list[int]) -> None:
    """End the slots these windowed semaphores (locked by the caller's
    transaction) still count, as their window is removed: their permits
    forget their slot, and the counters start again from nothing, so a
    window set again later counts only the grants made from then on."""
    if not semaphore_ids:
        return
    now = Semaphore.objects.using(using).values_list(DatabaseNow(), flat=True)[:1].get()
    permits = Semaphore.permits.rel.related_model._default_manager.using(using)
    with engine_writes():
        permits.filter(semaphore_id__in=semaphore_ids, slot_ends__gt=now).update(slot_ends=None)
        Semaphore.objects.using(using).filter(pk__in=semaphore_ids).update(
            slots_open=0, slots_closed_until=now
        )


class ReleaseCounter(GuardedModel):
    """The permits ever released from one semaphore, counted apart from its row.

    The grant holds the semaphore's row lock from its locking read to its
    commit, and grants queue on that lock. A release that lowered a counter
    on that row queued behind them, and its holder's permits kept counting
    until it got through: callers were refused by permits whose holders were
    done. A release adds what it frees here instead, a row no grant locks;
    the grant reads the total only when ``Semaphore.in_use_counter`` alone
    says there is no room, and folds it into the semaphore's row. Created
    with its semaphore (``save()``, ``bulk_create()``, the migration).
    """

    ENGINE_OWNED_FIELDS: ClassVar[tuple[str, ...]] = ("released",)
    ORM_REFUSED: ClassVar[dict[str, str]] = {"released": ENGINE_ONLY}

    semaphore = models.OneToOneField(
        Semaphore, on_delete=models.CASCADE, primary_key=True, related_name="release_counter"
    )
    released = models.PositiveBigIntegerField(_("permits released"), default=0)

    objects = ReleaseCounterManager()

    class Meta:
        verbose_name = _("release counter")
        verbose_name_plural = _("release counters")

    def __str__(self) -> str:
        return f"{self.semaphore_id}: {self.released} released"


# --- deletes (pre_delete receivers, connected in apps.py) ----------------------------

RELEASE_FIRST = (
    "release it first: release(key) by its holder, or force-release it "
    "(the admin's action, manage.py semaphore_release KEY, force_release(keys))."
)


def refuse_deleting_a_semaphore_in_use(
    sender: type[Semaphore], instance: Semaphore, using: str, **kwargs: Any
) -> None:
    """Deleting a held semaphore would end its holders' permits silently;
    one that waiters or parked tasks wait on would leave them waiting
    for a semaphore that is gone."""
    if engine_is_writing():
        return
    # Under the row lock (the delete's own transaction): a grant or a ticket
    # committed after Django collected the rows to delete is seen here, and
    # no new one is made until the delete commits.
    sender.objects.using(using).filter(pk=instance.pk).locked().exists()
    held = instance.permits.using(using).filter(state=State.ACQUIRED)
    if holders := held.values("request_id").distinct().count():
        raise PermitHeld(
            f"Semaphore {instance.name!r} is held by {holders} request(s) and cannot be "
            f"deleted: {RELEASE_FIRST}"
        )
    if waiters := instance.tickets.using(using).live().count():
        raise WaitersInLine(
            f"Semaphore {instance.name!r} has {waiters} waiter(s) or parked task(s) "
            f"in line and cannot be deleted: let them be served, or drop the parked tasks "
            f"(the admin's action, parking.cancel(task_ids)); a waiter's place ends "
            f"when it gives up."
        )
