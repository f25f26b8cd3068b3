"""Argument checks of the public API: every bad input is refused with
``InvalidRequest`` before anything touches the database."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django_semaphore.exceptions import InvalidRequest

MAX_LENGTH = 255
# Stored in an unsigned 32-bit column on MySQL; ~68 years is plenty.
MAX_TTL = 2**31 - 1
MAX_COUNT = 2**31 - 1


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
        counts = {_name(names): 1}
    elif isinstance(names, Mapping):
        counts = {_name(name): _count(name, count) for name, count in names.items()}
    elif isinstance(names, Iterable) and not isinstance(names, bytes | bytearray):
        listed = [_name(name) for name in names]
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


def _name(name: Any) -> str:
    return _text(name, "semaphore name")


def _count(name: str, count: Any) -> int:
    if not isinstance(count, int) or isinstance(count, bool):
        raise InvalidRequest(f"The count for {name!r} must be an int, not {type(count).__name__}.")
    if not 1 <= count <= MAX_COUNT:
        raise InvalidRequest(f"The count for {name!r} must be at least 1, not {count}.")
    return count


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"The {what} must be a str, not {type(value).__name__}.")
    if not value.strip():
        raise InvalidRequest(f"The {what} must not be empty.")
    if len(value) > MAX_LENGTH:
        raise InvalidRequest(f"The {what} must be at most {MAX_LENGTH} characters.")
    return validate_storable(value, what)


def validate_storable(value: str, what: str) -> str:
    """Refuse what some database cannot store, before the driver fails on it:
    NUL (PostgreSQL text refuses it) and lone surrogates (not UTF-8 at all)."""
    if "\x00" in value:
        raise InvalidRequest(f"The {what} must not contain NUL characters.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"The {what} must be valid Unicode (no lone surrogates).") from None
    return value


def validate_key(external_id: Any) -> str:
    return _text(external_id, "external_id")


def validate_owner(owner: Any, field: str = "owner") -> str:
    if not isinstance(owner, str):
        raise InvalidRequest(f"The {field} must be a str, not {type(owner).__name__}.")
    if len(owner) > MAX_LENGTH:
        raise InvalidRequest(f"The {field} must be at most {MAX_LENGTH} characters.")
    return validate_storable(owner, field)


def validate_ttl(ttl: Any) -> int | None:
    """Whole seconds (fractions round up, so a TTL is never shortened)."""
    if ttl is None:
        return None
    seconds = _seconds(ttl, "ttl")
    if seconds <= 0:
        raise InvalidRequest(f"ttl must be positive, not {ttl!r}.")
    if seconds > MAX_TTL:
        raise InvalidRequest(f"ttl must be at most {MAX_TTL} seconds.")
    return math.ceil(seconds)


def validate_timeout(timeout: Any) -> float:
    seconds = _seconds(timeout, "timeout")
    if seconds < 0:
        raise InvalidRequest(f"timeout must not be negative, not {timeout!r}.")
    return seconds


def validate_capacity(capacity: Any) -> int:
    if not isinstance(capacity, int) or isinstance(capacity, bool):
        raise InvalidRequest(f"capacity must be an int, not {type(capacity).__name__}.")
    if not 0 <= capacity <= MAX_COUNT:
        raise InvalidRequest(f"capacity must be between 0 and {MAX_COUNT}, not {capacity}.")
    return capacity


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(
            f"{what} must be seconds (int or float) or a timedelta, not {type(value).__name__}."
        )
    if not math.isfinite(value):
        raise InvalidRequest(f"{what} must be finite, not {value!r}.")
    return float(value)
