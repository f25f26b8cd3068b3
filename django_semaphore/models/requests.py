"""What acquire writes: the request, and its permit on each semaphore."""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import models
from django.db.models import Q
from django.utils.functional import cached_property
from django.utils.translation import gettext_lazy as _

from django_semaphore.exceptions import NameNotHeld, PermitHeld
from django_semaphore.guards import GuardedModel, engine_is_writing
from django_semaphore.managers import PermitManager, PermitRequestManager
from django_semaphore.models.semaphore import RELEASE_FIRST, USE_ACQUIRE, USE_RELEASE, Semaphore
from django_semaphore.states import ReleaseReason, State
from django_semaphore.validation import MAX_LENGTH


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
        max_length=MAX_LENGTH,
        unique=True,
        help_text=_("Idempotency key chosen by the caller: job id, task id, UUID."),
    )
    owner = models.CharField(_("owner"), max_length=MAX_LENGTH, blank=True)
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
        """The fencing token to hand to downstream writes guarded by ``name``.

        Raises:
            NameNotHeld: the request holds no permit on ``name`` (also a
                ``KeyError``); the error lists the names it holds.
        """
        held = self.fencing_tokens
        if not isinstance(name, str) or name not in held:
            raise NameNotHeld(self.external_id, str(name), held)
        return held[name]


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
        "slot_ends",
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
    # On a windowed semaphore (a rate limit): when this grant stops counting
    # against it, released or not. NULL elsewhere.
    slot_ends = models.DateTimeField(_("slot ends"), null=True, blank=True)

    objects = PermitManager()

    class Meta:
        verbose_name = _("permit")
        verbose_name_plural = _("permits")
        indexes = [
            # Covers the in-use sum (semaphore, state) -> SUM(count) so it reads
            # the index alone and never the history of released permits.
            models.Index(fields=["semaphore", "state", "count"], name="semaphore_permit_in_use"),
            # A windowed semaphore's slots by their end: the grant closes the
            # slots that ended, and ``in_use`` counts those not closed yet,
            # each by a range of this index (never the slots of past windows).
            models.Index(fields=["semaphore", "slot_ends", "count"], name="semaphore_permit_slots"),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(count__gte=1), name="semaphore_permit_count_gte_1"),
            models.UniqueConstraint(
                fields=["semaphore", "fencing_token"], name="semaphore_permit_unique_token"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.request_id}:{self.semaphore_id}x{self.count}"


# --- deletes (pre_delete receivers, connected in apps.py) ----------------------------


def refuse_deleting_held_request(
    sender: type[PermitRequest], instance: PermitRequest, using: str, **kwargs: Any
) -> None:
    # ACQUIRED -> RELEASED is one-way: an instance loaded RELEASED is still
    # released; one loaded ACQUIRED may have been released since (refused
    # all the same: reload it).
    if instance.state == State.ACQUIRED and not engine_is_writing():
        raise PermitHeld(
            f"Permit request {instance.external_id!r} is held and cannot be deleted: "
            f"{RELEASE_FIRST}"
        )


def refuse_deleting_held_permit(
    sender: type[Permit], instance: Permit, using: str, **kwargs: Any
) -> None:
    if instance.state == State.ACQUIRED and not engine_is_writing():
        raise PermitHeld(
            f"Permit {instance} is held and cannot be deleted: release its request first "
            f"(or, if its request is already released, run manage.py semaphore_sweep "
            f"--orphans, which frees it)."
        )
