"""System checks for the ``DJANGO_SEMAPHORE`` settings dict, the databases
the app runs on, the Celery beat schedule its sweeps need, and the Django
tasks backends that cannot defer a waiting run."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import suppress
from difflib import get_close_matches
from fnmatch import fnmatchcase
from importlib import import_module
from typing import Any, TypeVar

from django import db
from django.apps import apps
from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, router
from django.utils.module_loading import import_string

from django_semaphore import backends, beat, declared, routing, sweep
from django_semaphore.conf import DEFAULTS, app_settings, declared_capacity, setting_problems
from django_semaphore.engine.statements import ROUTINES_VERSION, routines
from django_semaphore.integrations import django_tasks
from django_semaphore.integrations.options import GIVEN_DEMANDS
from django_semaphore.models import Permit, PermitRequest, Semaphore
from django_semaphore.parking import deferred
from django_semaphore.validation import is_pattern
from django_semaphore.waiting import POLL_CAP, listening

# Where an installed project reads the docs: its docs/ folder is not installed.
SITE = "https://django-semaphore.readthedocs.io/en/latest/"
DOCS = f"See {SITE}settings/."
T = TypeVar("T")


def _error(id: int, msg: str, hint: str = DOCS) -> Error:
    return Error(msg, hint=hint, id=f"django_semaphore.E{id:03d}")


# The id each key's problems are reported under (conf.setting_problems words
# them): one per key, so silencing one never silences another. The ids a
# key once shared (E004, E005, E006) stay with the first key that had them.
SETTING_IDS = {
    "DATABASE": 3,
    "LOCK_WAIT_TIMEOUT": 4,
    "RETRY_ATTEMPTS": 5,
    "STALENESS_LIMIT": 6,
    "LIVENESS_CHECKERS": 7,
    "VIEW_STATUS_CODE": 8,
    "SEMAPHORES": 9,
    "SHARDS": 10,
    "PRELOCK_TIMEOUT": 11,
    "CLEANUP_BATCH_SIZE": 12,
    "RELEASED_RETENTION": 13,
    "HISTORY_RETENTION": 14,
    "MEMBER_IDLE_LIMIT": 15,
    "LEASE": 16,
    "REFUSED_VIEW": 17,
    "PARK_TASKS": 20,
    "PARKED_REPUBLISH_AFTER": 21,
    "TICKET_LEASE": 22,
    "PRIORITY_STEP": 23,
    "SHARE_WEIGHTS": 24,
    "METRICS_PER_MEMBER": 30,
    "LISTEN_DATABASES": 40,
}


@register(Tags.compatibility)
def check_settings(**kwargs: Any) -> list[CheckMessage]:
    """Every key and value of ``DJANGO_SEMAPHORE``, by the rules a read applies."""
    try:
        user = app_settings.user_settings
    except ImproperlyConfigured as exc:
        return [_error(1, str(exc))]
    errors: list[CheckMessage] = [
        _error(2, f"DJANGO_SEMAPHORE has an unknown key {key!r}.")
        for key in sorted(set(user) - set(DEFAULTS))
    ]
    for key, value in user.items():
        if key in DEFAULTS:
            errors += [_error(SETTING_IDS[key], each) for each in setting_problems(key, value)]
    if "SEMAPHORES" in user and not setting_problems("SEMAPHORES", user["SEMAPHORES"]):
        errors.extend(_shadowed_families(user["SEMAPHORES"]))
    return errors


def _shadowed_families(declared: Mapping[str, Any]) -> list[CheckMessage]:
    """Each pattern that an earlier pattern matches by its own text: a
    heuristic (hence a warning) for the usual mistake, a broad pattern such
    as ``"export:*"`` declared before ``"export:customer:*"``."""
    patterns = [name for name in declared if is_pattern(name)]
    return [
        Warning(
            f"Family {pattern!r} may never create a member: {earlier!r}, declared "
            "before it, matches it.",
            hint="Declare the narrower pattern first: the first matching pattern wins.",
            id="django_semaphore.W006",
        )
        for i, pattern in enumerate(patterns)
        for earlier in patterns[:i]
        if fnmatchcase(pattern, earlier)
    ]


@register(Tags.compatibility)
def check_named_semaphores(**kwargs: Any) -> list[CheckMessage]:
    """Names given as strings to ``@holds_permit`` that ``SEMAPHORES``
    neither declares nor matches by a family pattern (a typo that would
    fail only when called), and counts beyond the capacity it declares (a
    programming error: ``CapacityExceeded`` at each call). Where
    ``SEMAPHORES`` declares nothing, the semaphores are made otherwise (the
    admin, code), and nothing is said."""
    try:
        declared = list(app_settings.SEMAPHORES)
    except ImproperlyConfigured:
        return []  # check_settings reports it
    if not declared:
        return []
    _import_decorated_modules()
    too_many: list[CheckMessage] = [
        Error(
            f"@holds_permit asks for {count} permits of {name!r}, whose capacity SEMAPHORES "
            f"declares as {declared_capacity(name)}: each call fails with CapacityExceeded.",
            hint=f"Lower the count, or raise the declared capacity. {DOCS}",
            id="django_semaphore.E018",
        )
        for name, count in sorted(GIVEN_DEMANDS.items())
        if count > declared_capacity(name)
    ]
    return too_many + [
        Warning(
            f"@holds_permit names {name!r}, which SEMAPHORES neither declares nor matches "
            "by a family pattern: unless it is made otherwise, each call fails with "
            "SemaphoreNotFound.",
            hint=f"{_closest(name, declared)}Fix the name, or declare it in "
            f"DJANGO_SEMAPHORE['SEMAPHORES']. {DOCS}",
            id="django_semaphore.W013",
        )
        for name in sorted(GIVEN_DEMANDS)
        if not any(fnmatchcase(name, each) for each in declared)
    ]


def _closest(name: str, declared: list[str]) -> str:
    return "".join(f"Did you mean {close!r}? " for close in get_close_matches(name, declared, 1))


def _import_decorated_modules() -> None:
    """Import what a request or a worker would, so its decorators have run:
    the URLconf (its ``include``s with it) and each installed app's
    ``tasks`` module, as Celery's autodiscovery does. One that cannot be
    imported is passed over: Django's URL check, or the worker, says why."""
    urlconf = getattr(settings, "ROOT_URLCONF", None)
    modules = [f"{app.name}.tasks" for app in apps.get_app_configs()]
    for module in [urlconf, *modules] if isinstance(urlconf, str) else modules:
        with suppress(ImportError):
            import_module(module)


# The beat entries nothing else replaces: parked tasks whose wake-up a
# release missed (made where parking is off, a publish lost), and permits
# leaked by crashed holders. The clean-ups only bound the tables' growth.
REQUIRED_BEAT_TASKS = (beat.WAKE_PARKED, beat.RELEASE_ORPHANS)


@register(Tags.compatibility)
def check_beat_schedule(**kwargs: Any) -> list[CheckMessage]:
    """With Celery installed, the project's beat schedule must run the sweeps
    that parked tasks (the default) and leaked permits rely on."""
    scheduled = beat.scheduled_tasks()  # None: Celery is not installed
    missing = [] if scheduled is None else [t for t in REQUIRED_BEAT_TASKS if t not in scheduled]
    if not missing:
        return []
    return [
        Warning(
            f"The Celery beat schedule lacks django-semaphore's {', '.join(missing)}: "
            "parked tasks whose wake-up was missed wait forever, and permits of crashed "
            "holders are never reclaimed.",
            hint="Merge django_semaphore.beat.BEAT_SCHEDULE into CELERY_BEAT_SCHEDULE (or "
            "app.conf.beat_schedule): CELERY_BEAT_SCHEDULE = {**BEAT_SCHEDULE, ...}, or "
            f"beat_schedule(...) for other intervals. See {SITE}maintenance/.",
            id="django_semaphore.W020",
        )
    ]


@register(Tags.compatibility)
def check_task_backends(**kwargs: Any) -> list[CheckMessage]:
    """Where a Django tasks backend cannot defer a run, a task under
    ``@holds_permit`` that finds no room waits in its worker: say so."""
    return [
        Info(
            f"Django tasks of the task backend {alias!r} that find no room wait in "
            "their worker, which they keep busy: it cannot defer runs.",
            hint=f"django-tasks-db's DatabaseBackend defers them; see {SITE}django-tasks/.",
            id="django_semaphore.I001",
        )
        for alias, options in getattr(settings, "TASKS", {}).items()
        if _waits_in_worker(options)
    ]


def _waits_in_worker(options: Any) -> bool:
    try:
        backend = import_string(options["BACKEND"])
    except (ImportError, KeyError, TypeError):
        return False  # the tasks framework's own checks report it
    return not (issubclass(backend, django_tasks.inline_backends()) or deferred.can_defer(backend))


@register(Tags.compatibility)
def check_listening(**kwargs: Any) -> list[CheckMessage]:
    """A PostgreSQL alias behind a transaction pooler, with no direct
    connection named for ``LISTEN``: its waiters poll (``waiting.listening``)."""
    try:
        named = app_settings.LISTEN_DATABASES
    except ImproperlyConfigured:
        return []  # check_settings reports it
    return [
        Warning(
            f"The semaphore database {alias!r} is behind a transaction pooler "
            "(DISABLE_SERVER_SIDE_CURSORS): a LISTEN through it would hear nothing, so its "
            "waiters poll, and hear of a release in another process at their next probe "
            f"(up to {POLL_CAP:g} s later).",
            hint="Name a direct connection to the same database (not through the pooler) "
            f"for listening: DJANGO_SEMAPHORE['LISTEN_DATABASES'] = {{{alias!r}: "
            f"'<direct alias>'}}, or {{{alias!r}: None}} to poll without this warning. "
            f"See {SITE}operations/#connection-poolers.",
            id="django_semaphore.W040",
        )
        for alias in _app_aliases()
        if alias not in named and listening.pooled(alias) and listening.notifies(connections[alias])
    ]


def _app_aliases() -> list[str]:
    """The aliases holding semaphores, if the settings are sound enough to tell
    (check_settings reports what is not)."""
    try:
        return [alias for alias in routing.aliases() if alias in settings.DATABASES]
    except ImproperlyConfigured:
        return []


@register(Tags.compatibility)
def check_production_database(**kwargs: Any) -> list[CheckMessage]:
    """SQLite outside DEBUG or with deferred transactions, or an alias that
    looks like a replica."""
    return list(_production_database_warnings())


def _production_database_warnings() -> Iterator[CheckMessage]:
    aliases = _app_aliases()
    elsewhere = _routed_writes() - set(aliases) if aliases else set()
    if elsewhere:
        # Grants decided away from where the app's writes go could over-grant.
        yield Warning(
            f"The routers send semaphore writes to {', '.join(sorted(elsewhere))}, not "
            f"to the app's alias {routing.current_alias()!r}: it looks like a replica.",
            hint=f"Point DJANGO_SEMAPHORE['DATABASE'] at the primary. See {SITE}clusters/.",
            id="django_semaphore.W003",
        )
    for alias in aliases:
        database = settings.DATABASES[alias]
        # Deferred SQLite transactions make concurrent acquirers fail with
        # "database is locked" instead of waiting their turn.
        if backends.is_sqlite_without_immediate_transactions(database):
            yield Warning(
                f"SQLite database {alias!r} does not use immediate transactions: "
                "concurrent acquires may fail instead of waiting.",
                hint=f"Set DATABASES[{alias!r}]['OPTIONS']['transaction_mode'] = 'IMMEDIATE'.",
                id="django_semaphore.W001",
            )
        if database.get("ENGINE", "").endswith("sqlite3") and not settings.DEBUG:
            yield Warning(
                f"The semaphore database {alias!r} is SQLite outside DEBUG: permits are "
                "shared only by the processes of this one machine.",
                hint="Use MariaDB/MySQL or PostgreSQL when several machines acquire.",
                id="django_semaphore.W002",
            )
        if database.get("TEST", {}).get("MIRROR"):
            yield Warning(
                f"The semaphore database {alias!r} looks like a replica (a test mirror).",
                hint=f"Point DJANGO_SEMAPHORE['DATABASE'] at the primary. See {SITE}clusters/.",
                id="django_semaphore.W003",
            )


def _routed_writes() -> set[str]:
    """Where the routers say the app's models are written, when one says so.

    Asked router by router: ``router.db_for_write`` answers ``default`` when no
    router decides, which is no evidence that writes go anywhere else.
    """
    chosen: set[str] = set()
    for model in (Semaphore, PermitRequest, Permit):
        for candidate in router.routers:
            alias = getattr(candidate, "db_for_write", lambda model: None)(model)
            if alias is not None:
                chosen.add(alias)
                break
    return chosen


def _read_each(databases: Any, read: Callable[[str], T]) -> Iterator[tuple[str, T]]:
    """(alias, what ``read`` found there) for each of the app's aliases that
    ``check --database`` asks about; none unless asked, as Django's own
    database checks. An alias ``read`` fails on is passed over: unreachable
    or not migrated, Django's own checks and ``migrate`` say so."""
    for alias in [] if databases is None else [a for a in _app_aliases() if a in databases]:
        try:
            found = read(alias)
        except db.Error:
            continue
        yield alias, found


@register(Tags.database)
def check_database_servers(databases: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """What only the connected server can tell: a read-only server (a replica),
    Galera reads that may not see the other nodes' latest writes, an isolation
    level the grant was not designed for. Runs with ``check --database``."""
    servers = _read_each(databases, lambda alias: backends.server_settings(connections[alias]))
    return [warning for alias, server in servers for warning in _server_warnings(alias, server)]


def _server_warnings(alias: str, server: backends.ServerSettings) -> Iterator[CheckMessage]:
    if server.read_only:
        yield Warning(
            f"The semaphore database {alias!r} is read-only ({server.read_only}): "
            "a replica, or a demoted primary.",
            hint="Point the alias at the primary (or the cluster's writer endpoint).",
            id="django_semaphore.W011",
        )
    if server.galera and not server.causal_reads:
        yield Warning(
            f"The semaphore database {alias!r} is a Galera node without causal reads "
            "(wsrep_sync_wait lacks 1): grants stay safe, but a release or renew on "
            "another node than the grant's may not find it yet (NOT_FOUND, the "
            "permit then held until its TTL or the sweep).",
            hint="Add \"SET SESSION wsrep_sync_wait = 1\" to OPTIONS['init_command'], or "
            f"send every client of the app to one node. See {SITE}clusters/.",
            id="django_semaphore.W004",
        )
    if server.isolation not in {"", "read committed", "read-committed"}:
        yield Warning(
            f"The semaphore database {alias!r} runs at {server.isolation.upper()}: the "
            "grant is designed for READ COMMITTED (it reads the permits committed "
            "before its row lock); other levels cost retried serialization failures, "
            "refusals for permits never committed, and the line's hand-off at the "
            "head (the first waiter does not wait there for a release it would not see).",
            hint=f"Leave DATABASES[{alias!r}]['OPTIONS']['isolation_level'] unset, or "
            "give the app its own alias at READ COMMITTED.",
            id="django_semaphore.W005",
        )


@register(Tags.database)
def check_routines(databases: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The routines of this code's version that the database lacks: grants
    and releases then go the general way (slower, never failing). Runs with
    ``check --database``."""
    return [
        Warning(
            f"The semaphore database {alias!r} lacks the routines of version "
            f"{ROUTINES_VERSION} ({', '.join(missing)}): grants and releases take "
            "the general path, several statements where one call would do.",
            hint=f"Run manage.py migrate django_semaphore --database {alias}; on "
            f"MariaDB the migrating user needs CREATE ROUTINE ({SITE}operations/"
            "#database-privileges).",
            id="django_semaphore.W021",
        )
        for alias, missing in _read_each(databases, lambda a: routines.missing(connections[a]))
        if missing
    ]


# What check_data_consistency reports, by kind of repair (sweep.REPAIRS).
INCONSISTENCIES = {
    "partly_released": (
        10,
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
    return [
        # A warning, not an error: migrate runs the database checks too, and
        # must not be blocked by what the sweep repairs.
        Warning(
            INCONSISTENCIES[kind][1].format(count=count, alias=alias),
            hint="Run manage.py semaphore_sweep --orphans (or wait for the beat "
            f"task release_orphans) to repair it. See {SITE}maintenance/.",
            id=f"django_semaphore.W{INCONSISTENCIES[kind][0]:03d}",
        )
        for alias, found in _read_each(databases, sweep.inconsistencies)
        for kind, count in found.items()
        if count
    ]


@register(Tags.database)
def check_settings_drift(databases: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Declared semaphores whose row has other limits than ``SEMAPHORES``
    says (``migrate`` creates missing ones but never changes existing ones).
    Runs with ``check --database``, and in ``migrate``'s checks."""
    try:
        return [
            # A warning: migrate runs the database checks too, and must not
            # be blocked by a difference it is documented to leave alone.
            Warning(
                each.describe(),
                hint=f"Run {declared.APPLY_COMMAND} to apply the settings (recorded in the "
                "capacity history; see what it would change without --apply), or change "
                f"SEMAPHORES to match. {DOCS}",
                id="django_semaphore.W012",
            )
            for _, found in _read_each(databases, lambda a: declared.drift(a, missing=False))
            for each in found
        ]
    except ImproperlyConfigured:
        return []  # check_settings reports it
