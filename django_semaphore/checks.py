"""System checks for the ``DJANGO_SEMAPHORE`` settings dict."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.utils.module_loading import import_string

from django_semaphore import backends
from django_semaphore.conf import DEFAULTS, DURATION_KEYS
from django_semaphore.validation import MAX_COUNT, MAX_LENGTH

DOCS = "See docs/settings.md."


def _error(id: int, msg: str, hint: str = DOCS) -> Error:
    return Error(msg, hint=hint, id=f"django_semaphore.E{id:03d}")


@register(Tags.compatibility)
def check_settings(**kwargs: Any) -> list[CheckMessage]:
    user = getattr(settings, "DJANGO_SEMAPHORE", {})
    if not isinstance(user, Mapping):
        return [_error(1, "DJANGO_SEMAPHORE must be a dict.")]
    errors: list[CheckMessage] = [
        _error(2, f"DJANGO_SEMAPHORE has an unknown key {key!r}.")
        for key in sorted(set(user) - set(DEFAULTS))
    ]
    for key, value in user.items():
        if key in DEFAULTS:
            errors.extend(_check_value(key, value))
    return errors


def _positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _check_value(key: str, value: Any) -> list[CheckMessage]:
    if key == "DATABASE":
        if value not in settings.DATABASES:
            return [_error(3, f"DJANGO_SEMAPHORE['DATABASE'] is {value!r}, not a DATABASES alias.")]
    elif key in {"LOCK_WAIT_TIMEOUT", "PRELOCK_TIMEOUT"}:
        if not _positive_number(value):
            return [_error(4, f"DJANGO_SEMAPHORE[{key!r}] must be a positive number of seconds.")]
    elif key in {"RETRY_ATTEMPTS", "CLEANUP_BATCH_SIZE"}:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return [_error(5, f"DJANGO_SEMAPHORE[{key!r}] must be an int of at least 1.")]
    elif key in DURATION_KEYS:
        if not (_positive_number(value) or (isinstance(value, timedelta) and value > timedelta(0))):
            return [
                _error(6, f"DJANGO_SEMAPHORE[{key!r}] must be positive seconds or a timedelta.")
            ]
    elif key == "LIVENESS_CHECKERS":
        return _check_checkers(value)
    elif key == "VIEW_STATUS_CODE":
        if not isinstance(value, int) or not 400 <= value <= 599:
            return [_error(8, "DJANGO_SEMAPHORE['VIEW_STATUS_CODE'] must be a 4xx or 5xx status.")]
    elif key == "SEMAPHORES":
        return _check_declared(value)
    return []


def _check_checkers(value: Any) -> list[CheckMessage]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        return [_error(7, "DJANGO_SEMAPHORE['LIVENESS_CHECKERS'] must be a list of dotted paths.")]
    errors: list[CheckMessage] = []
    for path in value:
        try:
            import_string(path)
        except ImportError as exc:
            errors.append(_error(7, f"Liveness checker {path!r} cannot be imported: {exc}"))
    return errors


def _check_declared(value: Any) -> list[CheckMessage]:
    if not isinstance(value, Mapping):
        return [_error(9, "DJANGO_SEMAPHORE['SEMAPHORES'] must map names to capacities.")]
    return [
        _error(9, f"Declared semaphore {name!r}: {capacity!r} is not a valid name and capacity.")
        for name, capacity in value.items()
        if not (
            isinstance(name, str)
            and 0 < len(name) <= MAX_LENGTH
            and isinstance(capacity, int)
            and not isinstance(capacity, bool)
            and 0 <= capacity <= MAX_COUNT
        )
    ]


@register(Tags.compatibility)
def check_sqlite_transactions(**kwargs: Any) -> list[CheckMessage]:
    """Deferred SQLite transactions make concurrent acquirers fail with
    "database is locked" instead of waiting their turn."""
    user = getattr(settings, "DJANGO_SEMAPHORE", {})
    alias = user.get("DATABASE", DEFAULTS["DATABASE"]) if isinstance(user, Mapping) else ""
    database = settings.DATABASES.get(alias)
    if database is None or not backends.is_sqlite_without_immediate_transactions(database):
        return []
    return [
        Warning(
            f"SQLite database {alias!r} does not use immediate transactions: "
            "concurrent acquires may fail instead of waiting.",
            hint=f"Set DATABASES[{alias!r}]['OPTIONS']['transaction_mode'] = 'IMMEDIATE'.",
            id="django_semaphore.W001",
        )
    ]


@register(Tags.compatibility)
def check_production_database(**kwargs: Any) -> list[CheckMessage]:
    """SQLite outside DEBUG, or an alias that looks like a replica."""
    from django.db import router

    from django_semaphore.models import Semaphore

    user = getattr(settings, "DJANGO_SEMAPHORE", {})
    alias = user.get("DATABASE", DEFAULTS["DATABASE"]) if isinstance(user, Mapping) else ""
    database = settings.DATABASES.get(alias)
    if database is None:
        return []
    warnings: list[CheckMessage] = []
    if database.get("ENGINE", "").endswith("sqlite3") and not settings.DEBUG:
        warnings.append(
            Warning(
                f"The semaphore database {alias!r} is SQLite outside DEBUG: permits are "
                "shared only by the processes of this one machine.",
                hint="Use MariaDB/MySQL or PostgreSQL when several machines acquire.",
                id="django_semaphore.W002",
            )
        )
    writes_go_to = router.db_for_write(Semaphore)
    if database.get("TEST", {}).get("MIRROR") or writes_go_to != alias:
        # Grants decided on a replica could over-grant: its rows lag the primary.
        warnings.append(
            Warning(
                f"The semaphore database {alias!r} looks like a replica (a test mirror, or "
                f"the routers send semaphore writes to {writes_go_to!r}).",
                hint="Point DJANGO_SEMAPHORE['DATABASE'] at the primary.",
                id="django_semaphore.W003",
            )
        )
    return warnings
