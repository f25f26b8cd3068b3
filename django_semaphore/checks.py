"""System checks for the ``DJANGO_SEMAPHORE`` settings dict."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from fnmatch import fnmatchcase
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import DatabaseError, connections
from django.utils.module_loading import import_string

from django_semaphore import backends, families, routing
from django_semaphore.conf import DEFAULTS, DURATION_KEYS, app_settings
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
        if value is not None and value not in settings.DATABASES:
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
    elif key == "PARK_TASKS":
        if not isinstance(value, bool):
            return [_error(20, "DJANGO_SEMAPHORE['PARK_TASKS'] must be True or False.")]
    elif key == "SHARDS":
        return _check_shards(value)
    return []


def _check_shards(value: Any) -> list[CheckMessage]:
    if not isinstance(value, Mapping):
        return [_error(10, "DJANGO_SEMAPHORE['SHARDS'] must map name patterns to aliases.")]
    return [
        _error(10, f"Shard {pattern!r}: {alias!r} is not a DATABASES alias.")
        for pattern, alias in value.items()
        if not isinstance(pattern, str) or alias not in settings.DATABASES
    ]


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
    errors: list[CheckMessage] = [
        _error(9, f"Declared semaphore {name!r}: {capacity!r} is not a valid name and capacity.")
        for name, capacity in value.items()
        if not (
            isinstance(name, str)
            and 0 < len(name) <= MAX_LENGTH
            and (_is_capacity(capacity) or (families.is_pattern(name) and _is_family(capacity)))
        )
    ]
    if errors:
        return errors
    return [
        Warning(
            f"Family {pattern!r} may never create a member: {earlier!r}, declared "
            "before it, matches it.",
            hint="Declare the narrower pattern first: the first matching pattern wins.",
            id="django_semaphore.W006",
        )
        for pattern, earlier in _shadowed([name for name in value if families.is_pattern(name)])
    ]


def _is_capacity(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _is_family(value: Any) -> bool:
    """``{"capacity": n}`` with an optional ``"max_members"`` of at least 1."""
    if not isinstance(value, Mapping) or not set(value) <= {"capacity", "max_members"}:
        return False
    bound = value.get("max_members")
    return _is_capacity(value.get("capacity")) and (
        bound is None or (_is_capacity(bound) and bound >= 1)
    )


def _shadowed(patterns: list[str]) -> list[tuple[str, str]]:
    """(pattern, an earlier pattern that matches the pattern's own text): a
    heuristic (hence a warning) for the usual mistake, a broad pattern such
    as ``"export:*"`` declared before ``"export:customer:*"``."""
    return [
        (pattern, earlier)
        for i, pattern in enumerate(patterns)
        for earlier in patterns[:i]
        if fnmatchcase(pattern, earlier)
    ]


@register(Tags.compatibility)
def check_sqlite_transactions(**kwargs: Any) -> list[CheckMessage]:
    """Deferred SQLite transactions make concurrent acquirers fail with
    "database is locked" instead of waiting their turn."""
    return [
        Warning(
            f"SQLite database {alias!r} does not use immediate transactions: "
            "concurrent acquires may fail instead of waiting.",
            hint=f"Set DATABASES[{alias!r}]['OPTIONS']['transaction_mode'] = 'IMMEDIATE'.",
            id="django_semaphore.W001",
        )
        for alias in _app_aliases()
        if backends.is_sqlite_without_immediate_transactions(settings.DATABASES[alias])
    ]


def _app_aliases() -> list[str]:
    """The aliases holding semaphores, if the settings are sound enough to tell
    (check_settings reports what is not)."""
    user = getattr(settings, "DJANGO_SEMAPHORE", {})
    if not isinstance(user, Mapping) or not isinstance(user.get("SHARDS", {}), Mapping):
        return []
    return [alias for alias in routing.aliases() if alias in settings.DATABASES]


@register(Tags.compatibility)
def check_production_database(**kwargs: Any) -> list[CheckMessage]:
    """SQLite outside DEBUG, or an alias that looks like a replica."""
    warnings: list[CheckMessage] = []
    aliases = _app_aliases()
    elsewhere = _routed_writes() - set(aliases) if aliases else set()
    if elsewhere:
        # Grants decided away from where the app's writes go could over-grant.
        warnings.append(
            Warning(
                f"The routers send semaphore writes to {', '.join(sorted(elsewhere))}, not "
                f"to the app's alias {app_settings.DATABASE!r}: it looks like a replica.",
                hint="Point DJANGO_SEMAPHORE['DATABASE'] at the primary. See docs/clusters.md.",
                id="django_semaphore.W003",
            )
        )
    for alias in aliases:
        database = settings.DATABASES[alias]
        if database.get("ENGINE", "").endswith("sqlite3") and not settings.DEBUG:
            warnings.append(
                Warning(
                    f"The semaphore database {alias!r} is SQLite outside DEBUG: permits are "
                    "shared only by the processes of this one machine.",
                    hint="Use MariaDB/MySQL or PostgreSQL when several machines acquire.",
                    id="django_semaphore.W002",
                )
            )
        if database.get("TEST", {}).get("MIRROR"):
            warnings.append(
                Warning(
                    f"The semaphore database {alias!r} looks like a replica (a test mirror).",
                    hint="Point DJANGO_SEMAPHORE['DATABASE'] at the primary. See docs/clusters.md.",
                    id="django_semaphore.W003",
                )
            )
    return warnings


def _routed_writes() -> set[str]:
    """Where the routers say the app's models are written, when one says so.

    Asked router by router: ``router.db_for_write`` answers ``default`` when no
    router decides, which is no evidence that writes go anywhere else.
    """
    from django.db import router

    from django_semaphore.models import Permit, PermitRequest, Semaphore

    chosen: set[str] = set()
    for model in (Semaphore, PermitRequest, Permit):
        for candidate in router.routers:
            method = getattr(candidate, "db_for_write", None)
            alias = None if method is None else method(model)
            if alias is not None:
                chosen.add(alias)
                break
    return chosen


@register(Tags.database)
def check_database_servers(databases: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """What only the connected server can tell: a read-only server (a replica),
    Galera reads that may not see the other nodes' latest writes, an isolation
    level the grant was not designed for. Runs with ``check --database``."""
    if databases is None:  # as Django's own database checks: only when asked
        return []
    warnings: list[CheckMessage] = []
    for alias in _app_aliases():
        if alias not in databases:
            continue
        try:
            server = backends.server_settings(connections[alias])
        except DatabaseError:
            continue  # unreachable: Django's own checks and the first acquire say so
        warnings.extend(_server_warnings(alias, server))
    return warnings


def _server_warnings(alias: str, server: backends.ServerSettings) -> list[CheckMessage]:
    warnings: list[CheckMessage] = []
    if server.read_only:
        warnings.append(
            Warning(
                f"The semaphore database {alias!r} is read-only ({server.read_only}): "
                "a replica, or a demoted primary.",
                hint="Point the alias at the primary (or the cluster's writer endpoint).",
                id="django_semaphore.W003",
            )
        )
    if server.galera and not server.causal_reads:
        warnings.append(
            Warning(
                f"The semaphore database {alias!r} is a Galera node without causal reads "
                "(wsrep_sync_wait lacks 1): grants stay safe, but a release or renew on "
                "another node than the grant's may not find it yet (NOT_FOUND, the "
                "permit then held until its TTL or the sweep).",
                hint="Add \"SET SESSION wsrep_sync_wait = 1\" to OPTIONS['init_command'], or "
                "send every client of the app to one node. See docs/clusters.md.",
                id="django_semaphore.W004",
            )
        )
    if server.isolation not in {"", "read committed", "read-committed"}:
        warnings.append(
            Warning(
                f"The semaphore database {alias!r} runs at {server.isolation.upper()}: the "
                "grant is designed for READ COMMITTED (it reads the permits committed "
                "before its row lock); other levels cost retried serialization failures "
                "or refusals for permits never committed.",
                hint=f"Leave DATABASES[{alias!r}]['OPTIONS']['isolation_level'] unset, or "
                "give the app its own alias at READ COMMITTED.",
                id="django_semaphore.W005",
            )
        )
    return warnings


# What check_data_consistency reports, by kind of repair (sweep.REPAIRS).
INCONSISTENCIES = {
    "partly_released": (
        6,
        "{count} held permit request(s) on {alias!r} have released permits: a request is "
        "held all or nothing.",
    ),
    "stray_permits": (
        7,
        "{count} permit(s) on {alias!r} are held under released requests: counted against "
        "capacity though nobody holds them.",
    ),
    "orphan_permits": (
        8,
        "{count} permit(s) on {alias!r} are held with no permit request row (written with "
        "foreign key checks off): counted against capacity though nobody holds them.",
    ),
    "fencing_counters": (
        9,
        "{count} semaphore(s) on {alias!r} have a fencing counter below a token already "
        "issued: their next grants fail, and would re-issue tokens once the clean-up "
        "deletes the permits that hold them.",
    ),
}


@register(Tags.database)
def check_data_consistency(databases: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """States the engine never writes (a manual edit, a restore, a crash, raw
    SQL): reported, not changed; the orphan sweep repairs them. Runs with
    ``check --database``."""
    from django_semaphore import sweep

    if databases is None:
        return []
    messages: list[CheckMessage] = []
    for alias in _app_aliases():
        if alias not in databases:
            continue
        try:
            found = sweep.inconsistencies(alias)
        except DatabaseError:
            continue  # unreachable or not migrated: Django's own checks say so
        for kind, count in found.items():
            if count:
                number, text = INCONSISTENCIES[kind]
                messages.append(
                    # A warning, not an error: migrate runs the database
                    # checks too, and must not be blocked by what the sweep repairs.
                    Warning(
                        text.format(count=count, alias=alias),
                        hint="Run manage.py semaphore_sweep --orphans (or wait for the beat "
                        "task release_orphans) to repair it. See docs/maintenance.md.",
                        id=f"django_semaphore.W{number:03d}",
                    )
                )
    return messages
