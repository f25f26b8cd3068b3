"""Force release by key: an operator ends requests whatever their holders
do, on every alias (``manage.py semaphore_release``)."""

from __future__ import annotations

from collections.abc import Iterable

from django_semaphore import routing
from django_semaphore.engine.releasing import release_requests
from django_semaphore.exceptions import InvalidRequest
from django_semaphore.models import PermitRequest
from django_semaphore.states import ReleaseOutcome, ReleaseReason, State
from django_semaphore.validation import validate_keys


def force_release(keys: Iterable[str], reason: str | None = None) -> dict[str, ReleaseOutcome]:
    """Release the requests with these keys on an operator's behalf.

    Args:
        keys: ``external_id`` values.
        reason: a ``ReleaseReason`` value (default ``admin``).

    Returns:
        key -> ``RELEASED`` (this call ended it), ``ALREADY_RELEASED`` or ``NOT_FOUND``.

    Raises:
        InvalidRequest: a key that no request could have, ``keys`` given as
            one str, or a ``reason`` that is not a ``ReleaseReason``; nothing
            is released.
    """
    keys = list(dict.fromkeys(validate_keys(keys)))
    if reason is not None and reason not in ReleaseReason.values:
        raise InvalidRequest(
            f"reason must be one of {', '.join(ReleaseReason.values)}, not {reason!r}."
        )
    outcomes = dict.fromkeys(keys, ReleaseOutcome.NOT_FOUND)
    for alias in routing.aliases():
        # Keys are unique per alias: a key found on one is looked for no further.
        missing = [key for key in keys if outcomes[key] is ReleaseOutcome.NOT_FOUND]
        if missing:
            outcomes |= _force_release_on(alias, missing, reason)
    return outcomes


def _force_release_on(alias: str, keys: list[str], reason: str | None) -> dict[str, ReleaseOutcome]:
    rows = {
        key: (pk, state)
        for key, pk, state in PermitRequest.objects.using(alias)
        .filter(external_id__in=keys)
        .values_list("external_id", "pk", "state")
    }
    outcomes: dict[str, ReleaseOutcome] = {}
    for key in keys:
        if key not in rows:
            outcomes[key] = ReleaseOutcome.NOT_FOUND
            continue
        pk, state = rows[key]
        released = state == State.ACQUIRED and release_requests(
            alias, [pk], reason or ReleaseReason.ADMIN
        )
        outcomes[key] = ReleaseOutcome.RELEASED if released else ReleaseOutcome.ALREADY_RELEASED
    return outcomes
