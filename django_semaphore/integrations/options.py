"""What the doors of ``@holds_permit`` share: a decorator's options.

It sits below ``decorators``, ``views`` and ``celery_tasks``, so that the two
doors need not import each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django_semaphore.conf import app_settings
from django_semaphore.integrations.leases import DefaultLease, lease_seconds


@dataclass(frozen=True)
class Options:
    demand: dict[str, int]
    ttl: int | DefaultLease | None  # LEASE: the setting, read at each call
    timeout: int | float | timedelta
    retry_after: int
    label: str  # module.qualname of the decorated function, for owners and logs
    fair: bool
    park: bool | None  # None: the PARK_TASKS setting decides, when the task runs

    @property
    def lease(self) -> int | None:
        """The ttl of a permit taken now, in seconds; ``None``: no expiry."""
        return lease_seconds(self.ttl)

    @property
    def parks(self) -> bool:
        return app_settings.PARK_TASKS if self.park is None else self.park

    count: int
    names_of: Callable[..., Any] | None  # names computed from each call's arguments
    max_waiting: int | None = None  # parked tasks each semaphore may have waiting
