"""Argument checks of the public API: every bad input is refused with
``InvalidRequest`` before anything touches the database."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeGuard

from django.db.backends.base.operations import BaseDatabaseOperations

from django_semaphore.exceptions import InvalidRequest
from django_semaphore.limits import Limit

MAX_LENGTH = 255
# Stored in an unsigned 32-bit column on MySQL; ~68 years is plenty. Also
# the longest timeout: a deadline further off overflows the clock's types.
MAX_TTL = 2**31 - 1
MAX_COUNT = 2**31 - 1
# Fencing tokens are PositiveBigIntegerFields: this is their range on
# PostgreSQL and SQLite (MySQL's unsigned column holds more), so one rule
# holds on every backend.
MAX_TOKEN = BaseDatabaseOperations.integer_field_ranges["PositiveBigIntegerField"][1]
# The longest window of a rate limit: a day. The slots of its grants are
# kept on their permits until the grant closes them, whatever the
# retention of released requests (sweep.clean_released keeps them).
MAX_WINDOW = 86_400
# "100/s": a rate's units, in seconds ("min" is how a Limit writes a minute).
RATE_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600}
RATE = re.compile(r"(?P<count>[0-9]+)/(?P<multiple>[0-9]*)(?P<unit>s|m|min|h)", re.ASCII)
# A family's pattern is a declared name with fnmatch wildcards (families.py).
WILDCARDS = frozenset("*?[")


@dataclass(frozen=True)
class Demand:
    """How many permits a request wants of each semaphore."""

    counts: dict[str, int]

    @property
    def names(self) -> list[str]:
        """Sorted: the one order every grant locks rows in."""
        return sorted(self.counts)


def validate_demand(names: Any) -> Demand:
    """Accept ``"a"``, ``["a", "b"]`` or ``{"a": 2}``."""
    if isinstance(names, str):
        counts = {validate_name(names): 1}
    elif isinstance(names, Mapping):
        counts = {
            validate_name(name): validate_int(count, f"The count for {name!r}", 1, MAX_COUNT)
            for name, count in names.items()
        }
    elif isinstance(names, Iterable) and not isinstance(names, bytes | bytearray):
        listed = [validate_name(name) for name in names]
        if len(set(listed)) != len(listed):
            raise InvalidRequest(
                "A semaphore is listed twice; pass {name: count} to ask for more than one."
            )
        counts = dict.fromkeys(listed, 1)
    else:
        raise InvalidRequest(
            f"names must be a name, a list of names or a name -> count mapping, "
            f"not {type(names).__name__}."
        )
    if not counts:
        raise InvalidRequest("At least one semaphore name is required.")
    return Demand(counts)


def validate_name(name: Any) -> str:
    return validate_text(name, "semaphore name")


def validate_text(value: Any, what: str, *, blank: bool = False) -> str:
    """A str of at most ``MAX_LENGTH`` characters, empty or blank only if
    ``blank``. What some database cannot store is refused before the driver
    fails on it: NUL (PostgreSQL text refuses it) and lone surrogates (not
    UTF-8 at all)."""
    if not isinstance(value, str):
        raise InvalidRequest(f"The {what} must be a str, not {type(value).__name__}.")
    if not blank and not value.strip():
        raise InvalidRequest(f"The {what} must not be empty.")
    if len(value) > MAX_LENGTH:
        raise InvalidRequest(f"The {what} must be at most {MAX_LENGTH} characters.")
    if "\x00" in value:
        raise InvalidRequest(f"The {what} must not contain NUL characters.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"The {what} must be valid Unicode (no lone surrogates).") from None
    return value


def is_pattern(name: str) -> bool:
    """Whether a declared name is a family's pattern rather than a semaphore."""
    return any(char in WILDCARDS for char in name)


def validate_key(external_id: Any) -> str:
    return validate_text(external_id, "external_id")


def validate_owner(owner: Any, field: str = "owner") -> str:
    return validate_text(owner, field, blank=True)


def validate_ttl(ttl: Any) -> int | None:
    """Whole seconds (fractions round up, so a TTL is never shortened)."""
    return None if ttl is None else math.ceil(_seconds_up_to(ttl, "ttl", MAX_TTL, positive=True))


def validate_timeout(timeout: Any) -> float:
    return _seconds_up_to(timeout, "timeout", MAX_TTL)


def validate_debounce(debounce: Any) -> float | None:
    """Seconds a debounced send waits for the sends that follow it."""
    if debounce is None:
        return None
    return _seconds_up_to(debounce, "debounce", MAX_TTL, positive=True)


def validate_time_budget(time_budget: Any) -> float | None:
    """Seconds after which a sweep starts no new batch; ``None``: no limit."""
    return None if time_budget is None else _seconds_up_to(time_budget, "time_budget", math.inf)


def validate_batch_size(batch_size: Any) -> int | None:
    """Rows per batch of a sweep; ``None``: the ``CLEANUP_BATCH_SIZE`` setting.
    Zero or less would be no batch at all (a negative one, a slice that
    Django refuses)."""
    return None if batch_size is None else validate_int(batch_size, "batch_size", 1, MAX_COUNT)


def validate_keys(keys: Any, what: str = "external_id") -> list[str]:
    """A collection of keys, each checked as ``validate_key`` does; a single
    str is refused rather than taken as its characters."""
    if isinstance(keys, str | bytes) or not isinstance(keys, Iterable):
        raise InvalidRequest(f"Pass a list of {what} values, not {type(keys).__name__}.")
    return [validate_text(key, what) for key in keys]


def validate_flag(value: Any, what: str) -> bool:
    """``True`` or ``False`` only: a truthy string such as ``"false"`` read
    from the environment must not switch a behaviour on."""
    if not isinstance(value, bool):
        raise InvalidRequest(f"{what} must be True or False, not {value!r}.")
    return value


def warn_fair(fair: Any) -> None:
    """``fair=`` is deprecated: every call that waits waits in line (it
    took no ticket without it, and was passed by newcomers). Still taken
    (a bool, as before), and ignored, for a release; ``stacklevel`` names
    the caller of the public function that was given it."""
    if fair is not None:
        validate_flag(fair, "fair")
        warnings.warn(
            "fair= is deprecated and has no effect: every call that waits waits in line, "
            "first come, first served. Remove the argument.",
            DeprecationWarning,
            stacklevel=3,
        )


def validate_priority(priority: Any) -> int:
    """Django's convention for a task's priority: an int, -100 to 100,
    higher first."""
    return validate_int(priority, "priority", -100, 100)


def validate_share(share: Any) -> str:
    """A share key (a str, or an int such as a customer's id, as its str);
    ``None`` or ``""``: none, ``""``."""
    if share is None or share == "":
        return ""
    if isinstance(share, int) and not isinstance(share, bool):
        return str(share)
    return validate_text(share, "share key")


def validate_token(token: Any) -> int:
    """A fencing token as its column can hold it, on every database."""
    return validate_int(token, "A fencing token", 0, MAX_TOKEN)


def is_int(value: Any, least: int, most: int) -> TypeGuard[int]:
    """An int (``True`` is not one) from ``least`` to ``most``."""
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= most


def validate_int(value: Any, what: str, least: int, most: int) -> int:
    """``value`` if :func:`is_int` says so; else ``InvalidRequest`` naming ``what``."""
    if not is_int(value, least, most):
        raise InvalidRequest(f"{what} must be an int from {least} to {most}, not {value!r}.")
    return value


def validate_capacity(capacity: Any) -> int:
    return validate_int(capacity, "capacity", 0, MAX_COUNT)


def validate_window(window: Any) -> int | None:
    """Whole seconds from 1 to ``MAX_WINDOW`` (an int or a timedelta of
    whole seconds), or ``None``: no window."""
    return None if window is None else _window_seconds(window)


def _window_seconds(window: Any) -> int:
    seconds = _seconds(window, "window")
    if not 1 <= seconds <= MAX_WINDOW or seconds != int(seconds):
        raise InvalidRequest(
            f"window must be whole seconds from 1 to {MAX_WINDOW}, or None, not {window!r}."
        )
    return int(seconds)


def parse_rate(rate: Any) -> tuple[int, int]:
    """``"100/s"``, ``"5/m"`` (or ``"5/min"``), ``"1000/h"``, also
    ``"3/10s"``: (capacity, window).

    Raises:
        InvalidRequest: not such a string, or out of range.
    """
    found = RATE.fullmatch(rate) if isinstance(rate, str) else None
    if found is None:
        raise InvalidRequest(
            f"A rate is a count per second, minute or hour, like '100/s', '5/m' or "
            f"'1000/h', not {rate!r}."
        )
    window = int(found["multiple"] or 1) * RATE_UNITS[found["unit"]]
    return validate_capacity(int(found["count"])), _window_seconds(window)


@dataclass(frozen=True)
class Declared:
    """A ``SEMAPHORES`` value: ``3``, ``{"capacity": 3}``, ``{"rate": "100/s"}``,
    ``{"capacity": 100, "window": 1}``; a family's pattern may add
    ``"max_members"``."""

    capacity: int
    window: int | None = None
    max_members: int | None = None

    @property
    def limit(self) -> Limit:
        return Limit(self.capacity, self.window)


def validate_declared(name: Any, value: Any) -> Declared:
    """One ``SEMAPHORES`` entry, as the system check and the app read it.

    Raises:
        InvalidRequest: says what is wrong with it.
    """
    where = f"DJANGO_SEMAPHORE['SEMAPHORES'][{name!r}]"
    if not isinstance(name, str) or not 0 < len(name) <= MAX_LENGTH:
        raise InvalidRequest(f"{where}: a name is a str of 1 to {MAX_LENGTH} characters.")
    keys = {"capacity", "window", "rate"} | ({"max_members"} if is_pattern(name) else set())
    try:
        if not isinstance(value, Mapping):
            return Declared(validate_capacity(value))
        if not set(value) <= keys or ("rate" in value) == ("capacity" in value):
            raise InvalidRequest(
                f"give a capacity (with an optional window) or a rate, and only "
                f"{sorted(keys)}, not {dict(value)!r}."
            )
        if "rate" not in value:
            capacity = validate_capacity(value["capacity"])
            window = validate_window(value.get("window"))
        elif "window" in value:
            raise InvalidRequest("a rate has its window already ('100/s').")
        else:
            capacity, window = parse_rate(value["rate"])
        bound = value.get("max_members")
        if bound is not None:
            validate_int(bound, "max_members", 1, MAX_COUNT)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{where}: {exc}") from None
    return Declared(capacity, window, bound)


def parse_limit(text: str) -> Limit:
    """A capacity or a rate as written on a command line: ``"3"`` (no
    window) or ``"100/s"``."""
    if "/" in text:
        return Limit(*parse_rate(text))
    if not (text.isascii() and text.isdigit()):
        raise InvalidRequest(f"Give a capacity (3) or a rate (100/s), not {text!r}.")
    return Limit(validate_capacity(int(text)))


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(
            f"{what} must be seconds (int or float) or a timedelta, not {type(value).__name__}."
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"{what} must be finite, not {value!r}.")
    try:
        return float(value)
    except OverflowError:  # an int beyond every float: as good as forever
        return math.inf if value > 0 else -math.inf


def _seconds_up_to(value: Any, what: str, most: float, *, positive: bool = False) -> float:
    seconds = _seconds(value, what)
    if seconds <= 0 if positive else seconds < 0:
        least = "positive" if positive else "0 or more"
        raise InvalidRequest(f"{what} must be {least}, not {value!r}.")
    if seconds > most:
        raise InvalidRequest(f"{what} must be at most {most:.0f} seconds, not {value!r}.")
    return seconds
