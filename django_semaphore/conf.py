"""A typed, lazy view of the ``DJANGO_SEMAPHORE`` settings dict.

Read on every access (never cached, never written back into ``settings``) so
``override_settings`` just works; ``checks.py`` validates what is read here.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from datetime import timedelta
from typing import Any

from django.conf import settings

DEFAULTS: dict[str, Any] = {
    # Database alias holding the semaphore tables; all reads go to it. None:
    # where the routers send the app's writes (``default`` without routers).
    "DATABASE": None,
    # Name pattern -> alias, first match wins: semaphores sharded by name
    # (see routing.py); names no pattern matches live on DATABASE.
    "SHARDS": {},
    # Longest a grant transaction waits for a row lock, in seconds.
    "LOCK_WAIT_TIMEOUT": 5,
    # Attempts of one grant transaction on deadlock / lock-wait timeout.
    "RETRY_ATTEMPTS": 3,
    # Longest a thread waits for its own process's per-name pre-lock, seconds.
    "PRELOCK_TIMEOUT": 5,
    # Requests ACQUIRED longer than this are released by the sweep.
    "STALENESS_LIMIT": timedelta(hours=24),
    # Released requests are deleted after this long.
    "RELEASED_RETENTION": timedelta(days=7),
    # Capacity history is deleted after this long.
    "HISTORY_RETENTION": timedelta(days=30),
    # Rows per batch (and per short transaction) of the clean-up sweeps.
    "CLEANUP_BATCH_SIZE": 100,
    # Dotted paths of owner liveness checkers.
    "LIVENESS_CHECKERS": [],
    # Status of a view response when its semaphore is exhausted.
    "VIEW_STATUS_CODE": 429,
    # Declared semaphores, name -> initial capacity, created after migrate. A
    # name with wildcards is a family: its members are created on first use
    # (a capacity, or {"capacity": n, "max_members": m}; see families.py).
    "SEMAPHORES": {},
    # Family members not granted for this long, with nothing held or queued,
    # are deleted by the clean-up (the family's pattern creates them again).
    "MEMBER_IDLE_LIMIT": timedelta(days=1),
    # Whether @holds_permit tasks that find no room park (wait in the
    # database, woken by releases) rather than retry; park= overrides it.
    "PARK_TASKS": False,
    # A woken parked task whose run has not started after this long is
    # published again by the beat sweep (its message was lost, or the
    # publish failed without an error).
    "PARKED_REPUBLISH_AFTER": timedelta(minutes=5),
}

DURATION_KEYS = frozenset(
    {
        "STALENESS_LIMIT",
        "RELEASED_RETENTION",
        "HISTORY_RETENTION",
        "MEMBER_IDLE_LIMIT",
        "PARKED_REPUBLISH_AFTER",
    }
)

# Set by ``routing.on_alias``: the alias the app's single-alias code (sweeps,
# commands, the admin) works on while it visits each shard.
pinned_alias: ContextVar[str | None] = ContextVar("django_semaphore_alias", default=None)


class Settings:
    """Attribute access to the app's settings with their defaults."""

    @property
    def user_settings(self) -> Mapping[str, Any]:
        return getattr(settings, "DJANGO_SEMAPHORE", {})

    def _get(self, key: str) -> Any:
        value = self.user_settings.get(key, DEFAULTS[key])
        if key in DURATION_KEYS and not isinstance(value, timedelta):
            return timedelta(seconds=value)
        return value

    @property
    def DATABASE(self) -> str:
        pinned = pinned_alias.get()
        if pinned is not None:
            return pinned
        configured = self._get("DATABASE")
        if configured is None:
            # Never db_for_read: a router may send reads to a replica, and a
            # grant decided on a replica's stale rows could over-grant.
            from django.db import router

            from django_semaphore.models import Semaphore

            return router.db_for_write(Semaphore)
        return str(configured)

    @property
    def SHARDS(self) -> dict[str, str]:
        return dict(self._get("SHARDS"))

    @property
    def LOCK_WAIT_TIMEOUT(self) -> float:
        return float(self._get("LOCK_WAIT_TIMEOUT"))

    @property
    def RETRY_ATTEMPTS(self) -> int:
        return int(self._get("RETRY_ATTEMPTS"))

    @property
    def PRELOCK_TIMEOUT(self) -> float:
        return float(self._get("PRELOCK_TIMEOUT"))

    @property
    def STALENESS_LIMIT(self) -> timedelta:
        return self._get("STALENESS_LIMIT")  # type: ignore[no-any-return]

    @property
    def RELEASED_RETENTION(self) -> timedelta:
        return self._get("RELEASED_RETENTION")  # type: ignore[no-any-return]

    @property
    def HISTORY_RETENTION(self) -> timedelta:
        return self._get("HISTORY_RETENTION")  # type: ignore[no-any-return]

    @property
    def CLEANUP_BATCH_SIZE(self) -> int:
        return int(self._get("CLEANUP_BATCH_SIZE"))

    @property
    def LIVENESS_CHECKERS(self) -> list[str]:
        return list(self._get("LIVENESS_CHECKERS"))

    @property
    def VIEW_STATUS_CODE(self) -> int:
        return int(self._get("VIEW_STATUS_CODE"))

    @property
    def SEMAPHORES(self) -> dict[str, Any]:
        return dict(self._get("SEMAPHORES"))

    @property
    def MEMBER_IDLE_LIMIT(self) -> timedelta:
        return self._get("MEMBER_IDLE_LIMIT")  # type: ignore[no-any-return]

    @property
    def PARK_TASKS(self) -> bool:
        return bool(self._get("PARK_TASKS"))

    @property
    def PARKED_REPUBLISH_AFTER(self) -> timedelta:
        return self._get("PARKED_REPUBLISH_AFTER")  # type: ignore[no-any-return]


app_settings = Settings()
