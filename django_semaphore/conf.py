"""A typed, lazy view of the ``DJANGO_SEMAPHORE`` settings dict.

Each value is checked against :func:`setting_problems` when first read, as
the system check (``checks.py``) checks it at start-up: a Celery worker or a
script never runs the checks. Checked values are kept (a grant reads about
ten), never written back into ``settings``, and forgotten on Django's
``setting_changed``, so ``override_settings`` just works. Like Django's own
settings, the dict is not to be changed in place at run time.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from fnmatch import fnmatchcase
from typing import Any, Generic, TypeVar

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from django_semaphore.exceptions import InvalidRequest
from django_semaphore.validation import MAX_COUNT, MAX_TTL, is_int, is_pattern, validate_declared

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
    # Dotted path of the view that answers a request @holds_permit refuses,
    # called as view(request, exception) (docs/howto.md, "limit a view").
    "REFUSED_VIEW": "django_semaphore.integrations.views.permit_refused",
    # Declared semaphores, name -> initial capacity, created after migrate:
    # 3, {"capacity": 3}, or a rate limit, {"rate": "100/s"} or
    # {"capacity": 100, "window": 1} (docs/rates.md). A name with wildcards
    # is a family: its members are created on first use, and it may add
    # "max_members" (see families.py).
    "SEMAPHORES": {},
    # Family members not granted for this long, with nothing held or queued,
    # are deleted by the clean-up (the family's pattern creates them again).
    "MEMBER_IDLE_LIMIT": timedelta(days=1),
    # Whether @holds_permit tasks that find no room park (wait in the
    # database, woken by releases) rather than retry; park= overrides it.
    # On by default: waiting must not spend a task's retries nor fail it.
    "PARK_TASKS": True,
    # A woken parked task whose run has not started after this long is
    # published again by the beat sweep (its message was lost, or the
    # publish failed without an error).
    "PARKED_REPUBLISH_AFTER": timedelta(minutes=5),
    # The TTL of every holder the library manages (permit(), @holds_permit)
    # unless it says otherwise: renewed by the process's heartbeat, it runs
    # out this long after the holder dies.
    "LEASE": timedelta(seconds=60),
    # A waiter's ticket (its place in line) lives this long unless its
    # waiter, still waiting, renews it: a crashed waiter keeps room for
    # others at most this long. A parked task's tickets live by its row.
    "TICKET_LEASE": timedelta(seconds=10),
    # A waiter's priority is a head start in line: it is served as if it had
    # come this much earlier per point (Django's -100..100): priority 100
    # goes ahead of priority-0 waiters that came up to 100 steps before it,
    # and a waiter is passed by none that came 200 steps after it.
    "PRIORITY_STEP": timedelta(seconds=1),
    # Share key -> weight, or a callable of the key that returns it: waiting
    # share keys are served in turn, each in proportion to its weight (1
    # unless given; docs/shares.md).
    "SHARE_WEIGHTS": {},
    # Families (patterns in SEMAPHORES) whose members the Prometheus metrics
    # label one by one; any other family's members are one series, labelled
    # with its pattern (metrics/series.py).
    "METRICS_PER_MEMBER": [],
    # Alias -> the alias of a direct connection to the same database, for
    # LISTEN (PostgreSQL): an alias behind a transaction pooler hears no
    # notification on its own; None there: its waiters poll (see
    # waiting/listening.py).
    "LISTEN_DATABASES": {},
}

# PostgreSQL's lock_timeout is an int of milliseconds (less than one is 0:
# no bound at all); MySQL's is at most 2**30 seconds: one range for every backend.
MIN_LOCK_WAIT, MAX_LOCK_WAIT = 0.001, (2**31 - 1) // 1000
MIN_TICKET_LEASE = timedelta(seconds=3)
MAX_PRIORITY_STEP = 86_400
MAX_SHARE_WEIGHT = 1_000


T = TypeVar("T")


def _duration(value: Any) -> timedelta:
    return value if isinstance(value, timedelta) else timedelta(seconds=value)


class _Setting(Generic[T]):
    """A key of the dict, read through ``Settings._get`` as type ``T``
    (``convert`` is called at its first read, and kept with the value)."""

    def __init__(self, convert: Callable[[Any], T]) -> None:
        self.convert = convert

    def __set_name__(self, owner: type[Settings], name: str) -> None:
        self.key = name

    def __get__(self, instance: Settings, owner: type[Settings] | None = None) -> T:
        return instance._get(self.key, self.convert)


class Settings:
    """Attribute access to the app's settings with their defaults."""

    def __init__(self) -> None:
        self._checked: dict[str, Any] = {}

    @property
    def user_settings(self) -> Mapping[str, Any]:
        """The ``DJANGO_SEMAPHORE`` dict as the project wrote it.

        Raises:
            ImproperlyConfigured: it is not a dict.
        """
        user = getattr(settings, "DJANGO_SEMAPHORE", {})
        if not isinstance(user, Mapping):
            raise ImproperlyConfigured(
                f"DJANGO_SEMAPHORE must be a dict, not {type(user).__name__}."
            )
        return user

    def _get(self, key: str, convert: Callable[[Any], T]) -> T:
        if key not in self._checked:
            user = self.user_settings  # a default is the app's own: not checked
            if key in user and (problems := setting_problems(key, user[key])):
                raise ImproperlyConfigured(" ".join(problems))
            self._checked[key] = convert(user.get(key, DEFAULTS[key]))
        return self._checked[key]  # type: ignore[no-any-return]

    # The alias configured; ``routing.current_alias()`` says which to use.
    DATABASE: _Setting[str | None] = _Setting(lambda alias: alias)
    SHARDS = _Setting(dict[str, str])
    LOCK_WAIT_TIMEOUT = _Setting(float)
    RETRY_ATTEMPTS = _Setting(int)
    PRELOCK_TIMEOUT = _Setting(float)
    STALENESS_LIMIT = _Setting(_duration)
    RELEASED_RETENTION = _Setting(_duration)
    HISTORY_RETENTION = _Setting(_duration)
    CLEANUP_BATCH_SIZE = _Setting(int)
    LIVENESS_CHECKERS = _Setting(list[str])
    VIEW_STATUS_CODE = _Setting(int)

    # The view that answers a refused request, imported at its first read
    # (nothing is imported before it is used).
    REFUSED_VIEW: _Setting[Callable[..., Any]] = _Setting(import_string)
    SEMAPHORES = _Setting(dict[str, Any])
    MEMBER_IDLE_LIMIT = _Setting(_duration)
    PARK_TASKS = _Setting(bool)
    PARKED_REPUBLISH_AFTER = _Setting(_duration)
    LEASE = _Setting(_duration)
    TICKET_LEASE = _Setting(_duration)
    PRIORITY_STEP = _Setting(_duration)
    SHARE_WEIGHTS: _Setting[Mapping[str, float] | Callable[[str], Any]] = _Setting(lambda v: v)
    METRICS_PER_MEMBER = _Setting(frozenset[str])
    LISTEN_DATABASES = _Setting(dict[str, str | None])

    def share_weight(self, share: str) -> float:
        """A share key's weight: as ``SHARE_WEIGHTS`` gives it, 1 otherwise.

        Raises:
            InvalidRequest: a callable ``SHARE_WEIGHTS`` gave no weight.
        """
        weights = self.SHARE_WEIGHTS
        weight = weights(share) if callable(weights) else weights.get(share, 1)
        if not _is_weight(weight):
            raise InvalidRequest(
                f"DJANGO_SEMAPHORE['SHARE_WEIGHTS'] gave the share key {share!r} the weight "
                f"{weight!r}: {_WEIGHT_RULE}."
            )
        return float(weight)

    def forget(self, **kwargs: Any) -> None:
        """Read every value afresh: any setting may have changed one (a
        ``DATABASE`` alias is checked against ``DATABASES``)."""
        self._checked = {}
        families.cache_clear()


app_settings = Settings()
setting_changed.connect(app_settings.forget)


def setting_problems(key: str, value: Any) -> list[str]:
    """What is wrong with ``value`` as ``DJANGO_SEMAPHORE[key]``: one sentence
    per problem, naming the key and what it expects (empty: nothing is).

    The one set of rules: the system check reports these at start-up, and a
    read refuses a value that has any, so a process that never runs the
    checks fails with the same words instead of a bare ``ValueError`` (or a
    driver's error, for a value out of the database's range).
    """
    if key in _COMPOUND_RULES:
        return _COMPOUND_RULES[key](value)
    sound, expects = _SCALAR_RULES[key]
    return [] if sound(value) else [f"DJANGO_SEMAPHORE[{key!r}] must be {expects}, not {value!r}."]


def _is_seconds(value: Any, most: float) -> bool:
    # An int is finite however large; math.isfinite() cannot take a huge one.
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    return finite and not isinstance(value, bool) and 0 < value <= most


def _is_duration(value: Any) -> bool:
    return _is_seconds(value.total_seconds() if isinstance(value, timedelta) else value, MAX_TTL)


def _is_weight(value: Any) -> bool:
    return _is_seconds(value, MAX_SHARE_WEIGHT)


_WEIGHT_RULE = f"a weight is a positive number, at most {MAX_SHARE_WEIGHT}"


def _is_alias(value: Any) -> bool:
    return isinstance(value, str) and value in settings.DATABASES


_SCALAR_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "DATABASE": (lambda value: value is None or _is_alias(value), "None or a DATABASES alias"),
    "LOCK_WAIT_TIMEOUT": (
        lambda value: _is_seconds(value, MAX_LOCK_WAIT) and value >= MIN_LOCK_WAIT,
        f"a positive number of seconds, from {MIN_LOCK_WAIT} (1 ms) to {MAX_LOCK_WAIT}",
    ),
    "PRELOCK_TIMEOUT": (
        # What threading.Lock.acquire(timeout=...) takes.
        lambda value: _is_seconds(value, threading.TIMEOUT_MAX),
        f"a positive number of seconds, at most {threading.TIMEOUT_MAX:g}",
    ),
    **dict.fromkeys(
        ("RETRY_ATTEMPTS", "CLEANUP_BATCH_SIZE"),
        (lambda value: is_int(value, 1, MAX_COUNT), f"an int from 1 to {MAX_COUNT}"),
    ),
    # Every duration (a timedelta by default), at most what a TTL may be:
    # "now - limit" stays a date every database holds; but for the two below.
    **dict.fromkeys(
        [key for key, default in DEFAULTS.items() if isinstance(default, timedelta)],
        (_is_duration, f"positive seconds or a timedelta, at most {MAX_TTL} seconds"),
    ),
    # Renewed every third of it by a waiter that polls every second or two.
    "TICKET_LEASE": (
        lambda value: _is_duration(value) and _duration(value) >= MIN_TICKET_LEASE,
        f"seconds or a timedelta, from {MIN_TICKET_LEASE.seconds} to {MAX_TTL} seconds",
    ),
    # 200 steps back from now stays a date every database holds.
    "PRIORITY_STEP": (
        lambda value: _is_duration(value) and _duration(value).total_seconds() <= MAX_PRIORITY_STEP,
        f"positive seconds or a timedelta, at most {MAX_PRIORITY_STEP} seconds",
    ),
    "VIEW_STATUS_CODE": (lambda value: is_int(value, 400, 599), "a 4xx or 5xx status"),
    "PARK_TASKS": (lambda value: isinstance(value, bool), "True or False"),
}


def _shard_problems(value: Any) -> list[str]:
    if not isinstance(value, Mapping):
        return [f"DJANGO_SEMAPHORE['SHARDS'] must map name patterns to aliases, not {value!r}."]
    return [
        f"DJANGO_SEMAPHORE['SHARDS'] must map name patterns to DATABASES aliases, "
        f"not {pattern!r} to {alias!r}."
        for pattern, alias in value.items()
        if not isinstance(pattern, str) or not _is_alias(alias)
    ]


def _listen_problems(value: Any) -> list[str]:
    if not isinstance(value, Mapping):
        return [f"DJANGO_SEMAPHORE['LISTEN_DATABASES'] must map aliases to aliases, not {value!r}."]
    return [
        f"DJANGO_SEMAPHORE['LISTEN_DATABASES'] must map DATABASES aliases to the alias of a "
        f"direct connection (one without DISABLE_SERVER_SIDE_CURSORS: not through a "
        f"transaction pooler) or None, not {alias!r} to {direct!r}."
        for alias, direct in value.items()
        if not _is_alias(alias)
        or not (direct is None or _is_alias(direct))
        or (direct is not None and settings.DATABASES[direct].get("DISABLE_SERVER_SIDE_CURSORS"))
    ]


def _weights_problems(value: Any) -> list[str]:
    """A mapping of share keys to weights, or a callable of the key."""
    if callable(value):
        return []
    if not isinstance(value, Mapping):
        return [
            "DJANGO_SEMAPHORE['SHARE_WEIGHTS'] must map share keys to weights, or be a callable "
            f"of the key that returns its weight, not {value!r}."
        ]
    problems = [
        f"DJANGO_SEMAPHORE['SHARE_WEIGHTS']: the share key {key!r} must be a str "
        f"(an int key is its str: {str(key)!r})."
        for key in value
        if not isinstance(key, str)
    ]
    return problems + [
        f"DJANGO_SEMAPHORE['SHARE_WEIGHTS'] gives the share key {key!r} the weight "
        f"{weight!r}: {_WEIGHT_RULE}."
        for key, weight in value.items()
        if not _is_weight(weight)
    ]


def _checker_problems(value: Any) -> list[str]:
    if not isinstance(value, list | tuple) or not all(isinstance(path, str) for path in value):
        return [
            f"DJANGO_SEMAPHORE['LIVENESS_CHECKERS'] must be a list of dotted paths, not {value!r}."
        ]
    return [problem for path in value for problem in _import_problems("LIVENESS_CHECKERS", path)]


def _refused_view_problems(value: Any) -> list[str]:
    """A dotted path to a callable. Only a value the project gives is
    imported by the check: the default's module is the app's own."""
    if not isinstance(value, str):
        return [f"DJANGO_SEMAPHORE['REFUSED_VIEW'] must be a dotted path, not {value!r}."]
    if problems := _import_problems("REFUSED_VIEW", value):
        return problems
    if not callable(import_string(value)):
        return [f"DJANGO_SEMAPHORE['REFUSED_VIEW']: {value!r} is not callable."]
    return []


def _import_problems(key: str, path: str) -> list[str]:
    try:
        import_string(path)
    except (ImportError, TypeError, ValueError) as exc:  # not a dotted path: ".x", "."
        return [f"DJANGO_SEMAPHORE[{key!r}]: {path!r} cannot be imported: {exc}"]
    return []


def _declared_problems(value: Any) -> list[str]:
    if not isinstance(value, Mapping):
        return [f"DJANGO_SEMAPHORE['SEMAPHORES'] must map names to capacities, not {value!r}."]
    problems = []
    for name, declared in value.items():
        try:
            validate_declared(name, declared)
        except InvalidRequest as exc:
            problems.append(str(exc))
    return problems


def _per_member_problems(value: Any) -> list[str]:
    """A list of family patterns, each declared in ``SEMAPHORES``: a pattern
    declared nowhere (a typo) would keep its family's members in one series
    without a word."""
    if not isinstance(value, list | tuple):
        return [
            "DJANGO_SEMAPHORE['METRICS_PER_MEMBER'] must be a list of family patterns, "
            f"not {value!r}."
        ]
    declared = app_settings.user_settings.get("SEMAPHORES")
    names = declared if isinstance(declared, Mapping) else {}
    families = [name for name in names if isinstance(name, str) and is_pattern(name)]
    return [
        f"DJANGO_SEMAPHORE['METRICS_PER_MEMBER'] names {pattern!r}, which is not a family "
        f"declared in SEMAPHORES (declared: {families!r})."
        for pattern in value
        if not isinstance(pattern, str) or pattern not in families
    ]


# The keys whose value holds several parts: each rule lists every problem.
_COMPOUND_RULES: dict[str, Callable[[Any], list[str]]] = {
    "SHARDS": _shard_problems,
    "LIVENESS_CHECKERS": _checker_problems,
    "REFUSED_VIEW": _refused_view_problems,
    "SEMAPHORES": _declared_problems,
    "METRICS_PER_MEMBER": _per_member_problems,
    "LISTEN_DATABASES": _listen_problems,
    "SHARE_WEIGHTS": _weights_problems,
}

# --- families: the patterns SEMAPHORES declares ----------------------------------------


@dataclass(frozen=True)
class Family:
    """A pattern declared in ``SEMAPHORES``, as settings give it."""

    pattern: str
    # The template's first capacity and window; the row's rules once it exists.
    capacity: int
    window: int | None
    max_members: int | None


@functools.cache
def families() -> tuple[Family, ...]:
    """The declared families, in settings order (the order names are matched
    in). Built once, as the settings' values are read once: every release
    asks which family each of its names is in."""
    return tuple(
        Family(pattern, **asdict(validate_declared(pattern, value)))
        for pattern, value in app_settings.SEMAPHORES.items()
        if is_pattern(pattern)
    )


def family_of(name: str) -> Family | None:
    """The family whose pattern matches ``name`` first; ``None`` if none does."""
    matching = (f for f in families() if name != f.pattern and fnmatchcase(name, f.pattern))
    return next(matching, None)


def declared_capacity(name: str) -> float:
    """The capacity settings declare for ``name``, its own or its family's;
    ``math.inf`` (no bound) when they declare neither."""
    if name in app_settings.SEMAPHORES:
        return validate_declared(name, app_settings.SEMAPHORES[name]).capacity
    family = family_of(name)
    return math.inf if family is None else family.capacity


def is_family_default(name: str) -> bool:
    """Whether ``name`` is a declared family's pattern (its template row)."""
    return is_pattern(name) and name in app_settings.SEMAPHORES
