"""Families: per-key semaphores, created on first use from a pattern.

::

    DJANGO_SEMAPHORE = {"SEMAPHORES": {
        "exports": 3,                                      # declared
        "export:customer:*": 2,                            # a family: default capacity 2
        "sync:*": {"capacity": 1, "max_members": 10_000},  # at most 10,000 live members
        "stripe:account:*": {"rate": "25/s"},              # a rate limit per account
    }}

A declared name with ``fnmatch`` wildcards (``*``, ``?``, ``[``) is a
family's pattern. Acquiring a name that a pattern matches (the first, in
settings order) creates that semaphore, a *member*, if it does not exist. A
name no pattern matches still raises ``SemaphoreNotFound``.

- **Nothing extra when the member exists.** The grant's locking read already
  tells that a name is missing; only then does :func:`create_members` run,
  in its own short transaction after the grant's has ended (so the sorted
  lock order of grants is untouched), and the grant is attempted again.
- **Race-free.** Creations of one family are serialized by the lock on its
  *template* row, and the insert ignores a name that exists: two first
  acquires create one row, and ``max_members`` is exact.
- **The family default is a row**, the template: a semaphore named by the
  pattern, created after ``migrate`` like the declared ones (or by the first
  creation, if ``migrate`` has not run since the family was declared). Its
  capacity belongs to the admin and ``set_capacity`` from then on, with its
  history, like any declared capacity; a change is carried to the members
  that follow the default (:func:`follow_default`). The template itself
  cannot be acquired.
- **Fencing tokens stay increasing across a member's lives.** A member's
  fencing counter starts at the database clock in microseconds, not at 0: a
  member deleted while idle and created again later hands out tokens above
  every token of its earlier life (a grant takes far longer than a
  microsecond), so a downstream ``fencing.advance`` never sees them go back.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from django.db import transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore import backends
from django_semaphore.backends import DatabaseNow
from django_semaphore.conf import Family, app_settings, family_of, is_family_default
from django_semaphore.exceptions import FamilyFull, InvalidRequest, SemaphoreNotFound
from django_semaphore.guards import engine_writes
from django_semaphore.models import CapacityChange, Semaphore
from django_semaphore.models.semaphore import close_every_slot

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def refuse_patterns(names: Iterable[str]) -> None:
    """A family's template row is its default, not a semaphore to acquire.

    Raises:
        InvalidRequest: a name is a declared family's pattern.
    """
    for name in names:
        if is_family_default(name):
            raise InvalidRequest(
                f"{name!r} is a family's pattern, not a semaphore: acquire a name it matches."
            )


def create_members(
    connection: BaseDatabaseWrapper, missing: Iterable[str], lock_wait: float
) -> None:
    """Create the missing semaphores ``missing`` that families match, in one
    short transaction of their own (members that exist meanwhile are left
    as they are).

    Raises:
        SemaphoreNotFound: a name no family matches (nothing is created).
        FamilyFull: a family would exceed its ``max_members``.
    """
    wanted: dict[Family, list[str]] = {}
    unknown: list[str] = []
    for name in missing:
        family = family_of(name)
        if family is None:
            unknown.append(name)
        else:
            wanted.setdefault(family, []).append(name)
    if unknown:
        raise SemaphoreNotFound(unknown)
    in_order = sorted(wanted, key=lambda family: family.pattern)
    alias = connection.alias
    with backends.bounded_transaction(connection, lock_wait, durable=True):
        templates = _lock_templates(alias, in_order)
        for family in in_order:
            _create(alias, family, templates[family.pattern], wanted[family])


class _Template(NamedTuple):
    """A family's template row, as its locking read returns it."""

    capacity: int
    window: int | None
    now: datetime  # the database's clock, read with the lock


def _lock_templates(alias: str, wanted: list[Family]) -> dict[str, _Template]:
    """Lock the families' template rows in name order (as grants lock rows),
    creating those that ``migrate`` has not created yet."""
    semaphores = Semaphore.objects.using(alias)
    locking = (
        semaphores.filter(name__in=[family.pattern for family in wanted])
        .locked()
        .values_list("name", "capacity", "window", DatabaseNow())
    )
    locked = {name: _Template._make(values) for name, *values in locking}
    if absent := [family for family in wanted if family.pattern not in locked]:
        semaphores.bulk_create(
            [
                Semaphore(name=family.pattern, capacity=family.capacity, window=family.window)
                for family in absent
            ],
            ignore_conflicts=True,
        )
        # Again, not from the first read's cache: every template exists now.
        locked = {name: _Template._make(values) for name, *values in locking.all()}
    return locked


def _create(alias: str, family: Family, template: _Template, names: list[str]) -> None:
    members = Semaphore.objects.using(alias)
    # Under the template's lock no other creation of this family runs: what
    # exists now is exact. (A case-insensitive collation also calls equal a
    # name that differs in case; the retried grant then reports it missing.)
    existing = set(members.filter(name__in=names).values_list("name", flat=True))
    new = sorted(name for name in names if name not in existing)
    if not new:
        return
    if family.max_members is not None:
        live = members.filter(family=family.pattern).count()
        if live + len(new) > family.max_members:
            raise FamilyFull(
                new,
                f"Family {family.pattern!r} has {live} live members, its maximum is "
                f"{family.max_members}: not created: {', '.join(new)}",
            )
    start = _microseconds(template.now)
    members.bulk_create(
        [
            Semaphore(
                name=name,
                capacity=template.capacity,
                window=template.window,
                family=family.pattern,
                fencing_counter=start,
            )
            for name in new
        ],
        ignore_conflicts=True,
    )


def _microseconds(moment: datetime) -> int:
    if moment.tzinfo is None:  # USE_TZ off: the database's local time, taken as UTC
        moment = moment.replace(tzinfo=UTC)
    return (moment - EPOCH) // timedelta(microseconds=1)


def follow_default(alias: str, pattern: str, changed_by_id: Any, reason: str) -> int:
    """Give the members that follow their family's default (not changed on
    their own) the template's capacity, ``CLEANUP_BATCH_SIZE`` members per
    short transaction, each change under the members' row locks and in
    their capacity history. Returns how many members changed.

    Each batch reads the template's capacity under its lock first (the order
    creations lock in too): two default changes in a row end with the last.
    """
    total = 0
    while changed := _follow_batch(alias, pattern, changed_by_id, reason):
        total += changed
    return total


def _follow_batch(alias: str, pattern: str, changed_by_id: Any, reason: str) -> int:
    semaphores = Semaphore.objects.using(alias)
    with transaction.atomic(using=alias):
        default = semaphores.filter(name=pattern).locked().values_list("capacity", "window").first()
        if default is None:
            return 0
        capacity, window = default
        # The members that follow the family default (not changed on their own).
        batch = list(
            semaphores.filter(family=pattern, own_capacity=False)
            .exclude(capacity=capacity, window=window)
            .locked()
            .values_list("pk", "capacity", "window")[: app_settings.CLEANUP_BATCH_SIZE]
        )
        if not batch:
            return 0
        CapacityChange.objects.using(alias).bulk_create(
            CapacityChange(
                semaphore_id=pk,
                old_capacity=old_capacity,
                new_capacity=capacity,
                old_window=old_window,
                new_window=window,
                changed_by_id=changed_by_id,
                reason=reason,
            )
            for pk, old_capacity, old_window in batch
        )
        if window is None:
            close_every_slot(alias, [pk for pk, _, old in batch if old is not None])
        with engine_writes():  # capacity and window, under the rows' locks, recorded above
            members = semaphores.filter(pk__in=[pk for pk, *_ in batch])
            members.update(capacity=capacity, window=window)
        return len(batch)
