"""django-semaphore: a durable, distributed counting semaphore in your database.

The public API. Import-safe: nothing here touches models or settings until
called, so ``import django_semaphore`` works before Django is set up.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django_semaphore.context import permit
from django_semaphore.decorators import holds_permit
from django_semaphore.outcomes import ReleaseOutcome

if TYPE_CHECKING:
    from django_semaphore.models import PermitRequest

__all__ = ["ReleaseOutcome", "acquire", "holds_permit", "permit", "release", "renew"]


def acquire(
    names: Any,
    *,
    external_id: str,
    owner: str = "",
    ttl: int | float | timedelta | None = None,
    timeout: int | float | timedelta = 0,
) -> PermitRequest:
    """Shortcut for ``Semaphore.objects.acquire`` (see ``core.acquire``)."""
    from django_semaphore.core import acquire

    return acquire(names, external_id=external_id, owner=owner, ttl=ttl, timeout=timeout)


def release(external_id: str) -> ReleaseOutcome:
    """Shortcut for ``Semaphore.objects.release`` (see ``core.release``)."""
    from django_semaphore.core import release

    return release(external_id)


def renew(external_id: str, ttl: int | float | timedelta | None = None) -> PermitRequest:
    """Shortcut for ``Semaphore.objects.renew`` (see ``core.renew``)."""
    from django_semaphore.core import renew

    return renew(external_id, ttl)
