"""How long released permits were held: turns ``permit_released`` into
``hold_ended``.

Release is a pair of one-way UPDATEs that read nothing back, so the grant
time of what they released is not at hand; reading it is one query on the
released rows, run only while something listens to ``hold_ended``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError

from django_semaphore import signals

logger = logging.getLogger("django_semaphore")


@dataclass(frozen=True)
class Hold:
    """One released permit: which request, on which semaphore, how long."""

    request_id: int
    semaphore: str
    count: int
    seconds: float  # grant to release, both read from the database's clock


def send_hold_ended(
    sender: Any, request_ids: Sequence[int], reason: str, using: str, **kwargs: Any
) -> None:
    """``permit_released`` receiver: send ``hold_ended`` with the permits' hold times."""
    if not signals.hold_ended.has_listeners(sender):
        return
    try:
        holds = released_holds(request_ids, reason, using)
    except DatabaseError:
        # The release itself is done; a metric is not worth failing its caller.
        logger.warning("Could not read the hold times of released permits.", exc_info=True)
        return
    if holds:
        signals.hold_ended.send_robust(sender=sender, holds=holds, reason=reason, using=using)


def released_holds(request_ids: Sequence[int], reason: str, using: str) -> list[Hold]:
    """The permits of these requests that ended with ``reason``.

    Filtering on the reason leaves out a request in a sweep's batch that its
    holder released a moment before (its own release reports it).
    """
    from django_semaphore.models import Permit

    rows = (
        Permit.objects.using(using)
        .filter(request_id__in=request_ids, request__release_reason=reason)
        .values_list(
            "request_id", "semaphore__name", "count", "request__created_at", "request__released_at"
        )
    )
    return [
        Hold(request_id, name, count, max(0.0, (released_at - created_at).total_seconds()))
        for request_id, name, count, created_at, released_at in rows
        if released_at is not None
    ]
