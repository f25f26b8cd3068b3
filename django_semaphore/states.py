"""Where a request stands and how it ended: the vocabulary every layer
shares, importable without Django set up (no import of the package)."""

from __future__ import annotations

import enum

from django.db import models
from django.utils.translation import gettext_lazy as _


class State(models.TextChoices):
    """One-way lifecycle of requests and permits: ACQUIRED -> RELEASED, never back."""

    ACQUIRED = "ACQUIRED", _("acquired")
    RELEASED = "RELEASED", _("released")


class ReleaseReason(models.TextChoices):
    """Why a request ended: ``PermitRequest.release_reason``, and the
    ``reason`` of ``permit_released``; any but ``released`` is a reclaim."""

    RELEASED = "released", _("released by its holder")
    EXPIRED = "expired", _("TTL expired")
    OWNER_DEAD = "owner_dead", _("owner no longer alive")
    STALE = "stale", _("held past the staleness limit")
    ADMIN = "admin", _("force-released by staff")


class ReleaseOutcome(enum.Enum):
    """What ``release()`` found."""

    RELEASED = "released"  # this call ended the request
    ALREADY_RELEASED = "already_released"  # it had ended before: released, expired, revoked
    NOT_FOUND = "not_found"  # no request has this key
