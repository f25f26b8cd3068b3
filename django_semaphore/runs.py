"""What the doors of ``@holds_permit`` share: a decorator's options, the
owner of a process's permits, the heartbeat of a held permit.

It sits below ``decorators``, ``view_runs`` and ``task_runs``, so that the two
doors need not import each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django_semaphore.conf import app_settings
from django_semaphore.context import Heartbeat
from django_semaphore.owners import this_process


@dataclass(frozen=True)
class Options:
    demand: dict[str, int]
    ttl: int | None
    timeout: int | float | timedelta
    retry_after: int
    label: str  # module.qualname of the decorated function, for owners and logs
    fair: bool
    park: bool | None  # None: the PARK_TASKS setting decides, when the task runs

    @property
    def parks(self) -> bool:
        return app_settings.PARK_TASKS if self.park is None else self.park

    count: int
    names_of: Callable[..., Any] | None  # names computed from each call's arguments


def process_owner(label: str) -> str:
    """``label on host pid N``: the owner of a permit this process holds."""
    return f"{label} on {this_process()}" if label else this_process()


def start_heartbeat(key: str, ttl: int | None) -> Heartbeat | None:
    if ttl is None:
        return None
    heartbeat = Heartbeat(key, ttl)
    heartbeat.start()
    return heartbeat
