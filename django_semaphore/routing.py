"""Which database alias holds a semaphore: placement by name, for sharding.

``DJANGO_SEMAPHORE["SHARDS"]`` maps name patterns to aliases, in order, first
match wins (``fnmatch`` patterns, matched case-sensitively as names are)::

    DJANGO_SEMAPHORE = {
        "DATABASE": "semaphores",                  # every name no pattern matches
        "SHARDS": {"tenant-a-*": "semaphores_a", "tenant-b-*": "semaphores_b"},
    }

Each alias holds complete semaphore tables (``migrate --database=<alias>``) and
is a write alias, never a replica: every read that decides a grant or a
release goes to the alias chosen here, whatever ``db_for_read`` a router has.

A grant is one transaction, so a multi-semaphore request must name semaphores
of one alias (``CrossShardRequest`` otherwise). A key is looked up on every
alias by ``release``/``renew``/``force_release``, which act on each request
that has it. Sweeps, commands and the admin visit every alias.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from fnmatch import fnmatchcase
from typing import TypeVar

from django.db import connections, router

from django_semaphore.conf import app_settings
from django_semaphore.exceptions import CrossShardRequest
from django_semaphore.models import PermitRequest, Semaphore
from django_semaphore.retry import run_with_retries

T = TypeVar("T")

# Set by ``on_alias``: the alias the app's single-alias code (sweeps,
# commands, the admin) works on while it visits each shard.
pinned_alias: ContextVar[str | None] = ContextVar("django_semaphore_alias", default=None)


def current_alias() -> str:
    """The alias of every semaphore no shard pattern places, or the one
    ``on_alias`` pinned: ``DJANGO_SEMAPHORE["DATABASE"]``, else where the
    routers send the semaphores' writes. Never ``db_for_read``: a router may
    send reads to a replica, and a grant decided on a replica's stale rows
    could over-grant."""
    return pinned_alias.get() or app_settings.DATABASE or router.db_for_write(Semaphore)


def alias_for_name(name: str) -> str:
    """The alias holding the semaphore ``name``."""
    for pattern, alias in app_settings.SHARDS.items():
        if fnmatchcase(name, pattern):
            return alias
    return current_alias()


def alias_for_names(names: Iterable[str]) -> str:
    """The one alias holding every semaphore of a request.

    Raises:
        CrossShardRequest: the names live on different aliases.
    """
    placed = {name: alias_for_name(name) for name in names}
    aliases = set(placed.values())
    if len(aliases) == 1:
        return aliases.pop()
    if not aliases:
        return current_alias()
    described = "; ".join(
        f"{alias}: {', '.join(sorted(n for n, a in placed.items() if a == alias))}"
        for alias in sorted(aliases)
    )
    raise CrossShardRequest(
        f"One request cannot span database aliases (its grant is one transaction): "
        f"{described}. Acquire them separately, or place them together in "
        f"DJANGO_SEMAPHORE['SHARDS']."
    )


def aliases() -> list[str]:
    """Every alias holding semaphores: ``DATABASE`` first, then the shards'."""
    return list(dict.fromkeys([current_alias(), *app_settings.SHARDS.values()]))


def aliases_for_key(key: str) -> list[str]:
    """The aliases whose requests have ``key``: a key used on two aliases
    has a request on each (no database can refuse it for the other), and
    by-key operations act on all of them. ``[DATABASE]`` when none has it,
    or when there is only one alias (without asking the database)."""
    candidates = aliases()
    if len(candidates) == 1:
        return candidates
    found = [
        alias
        for alias in candidates
        if run_with_retries(
            connections[alias], PermitRequest.objects.using(alias).filter(external_id=key).exists
        )
    ]
    return found or candidates[:1]


def alias_for_key(key: str) -> str:
    """The first of :func:`aliases_for_key`: for a task id, whose requests
    live on its demand's one alias."""
    return aliases_for_key(key)[0]


@contextmanager
def on_alias(alias: str) -> Iterator[None]:
    """Run the app's single-alias code (sweeps, commands, the admin's reads)
    against ``alias``: inside, ``current_alias()`` is ``alias``."""
    token = pinned_alias.set(alias)
    try:
        yield
    finally:
        pinned_alias.reset(token)


def on_each_alias(work: Callable[[], T]) -> list[T]:
    """Run ``work`` on every alias in turn, pinned (see :func:`on_alias`).

    Not a generator: one suspended by the caller's error would keep its
    alias pinned for as long as that error is referenced.
    """
    results: list[T] = []
    for alias in aliases():
        with on_alias(alias):
            results.append(work())
    return results
