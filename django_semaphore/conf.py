"""A typed, lazy view of the ``DJANGO_SEMAPHORE`` settings dict.

Read on every access (never cached, never written back into ``settings``) so
``override_settings`` just works; ``checks.py`` validates what is read here.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings

DEFAULTS: dict[str, Any] = {
    # Database alias holding the semaphore tables; all reads go to it.
    "DATABASE": "default",
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
    # Declared semaphores, name -> initial capacity, created after migrate.
    "SEMAPHORES": {},
}

DURATION_KEYS = frozenset({"STALENESS_LIMIT", "RELEASED_RETENTION", "HISTORY_RETENTION"})


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
        return str(self._get("DATABASE"))

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
    def SEMAPHORES(self) -> dict[str, int]:
        return dict(self._get("SEMAPHORES"))


app_settings = Settings()
