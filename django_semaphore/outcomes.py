"""Plain result types of the public API, importable without Django set up."""

from __future__ import annotations

import enum


class ReleaseOutcome(enum.Enum):
    """What ``release()`` found."""

    RELEASED = "released"  # this call ended the request
    ALREADY_RELEASED = "already_released"  # it had ended before: released, expired, revoked
    NOT_FOUND = "not_found"  # no request has this key
