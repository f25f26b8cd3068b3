"""Parked tasks in line: their places taken when they park, and which of
them a release (or a capacity raise) wakes.

**One line.** A parked task waits in each of its semaphores' lines as a
waiter does: by a ``Ticket`` per semaphore, keyed by its task id and
taken under the rows' locks, and under the line's one rule
(``engine/line``): an older ticket that lacked room keeps the room it
asks for, and a younger waiter -- a parked task, a waiter, any grant
-- fits only beside it. A task that does not fit lacks room there from
then on and holds back younger ones in turn, so a release elsewhere cannot
snatch that room from it again and again; where it has room it holds back
nobody: tenant A's tasks waiting for A's own cap never keep tenant B's
from the shared ``exports``. A woken task lacks room on all of its
semaphores until its run (granted beside the older ones) deletes its
tickets: that keeps its room for it meanwhile.

The wake-up's decision is the engine's, as a grant's is: it locks the
semaphore rows in the one lock order. Publishing the woken tasks' messages
is the caller's (``parking/wake.py``), once this committed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Exists, F, Max, OuterRef, Q, Subquery
from django.utils import timezone

from django_semaphore import backends
from django_semaphore.backends import DatabaseNow
from django_semaphore.conf import app_settings
from django_semaphore.engine.line import fits, lacking_room, room
from django_semaphore.engine.releasing import reclaim_expired
from django_semaphore.engine.statements.tickets import MAX_TICKET_LIFE, ticket_statements
from django_semaphore.exceptions import SemaphoreNotFound
from django_semaphore.limits import Limit
from django_semaphore.models import ParkedTask, Permit, Semaphore, Ticket

# Parked tasks read per semaphore and kind by one wake: more than any
# capacity frees at once in practice; the rest wait for the next release.
CANDIDATES_READ = 200


@dataclass(frozen=True)
class Lined:
    """Where a parking task's tickets were taken: its semaphores' ids by
    name, the rate limits among them, and those where it lacks room."""

    ids: dict[str, int]
    rate_limits: set[int]
    short: set[int]


def line_up(
    connection: BaseDatabaseWrapper,
    key: str,
    demand: Mapping[str, int],
    expires_at: datetime | None,
    *,
    woken: bool = False,
    priority: int = 0,
    share: str = "",
) -> Lined:
    """In the caller's transaction: lock these semaphores' rows and take
    the task's tickets, lacking room where it does not fit beside the older
    tickets that lacked it (expired holders reclaimed first), ranked by
    ``priority`` (from its ``share`` key's turn, where it has one). A task
    parked again keeps its tickets, and so its place.
    ``woken``: a task that fits everywhere takes its tickets lacking room
    everywhere, which keeps the room for its run (as a wake-up does).

    Raises:
        SemaphoreNotFound: a semaphore of the demand does not exist.
    """
    lock_wait = app_settings.LOCK_WAIT_TIMEOUT
    rows = _locked(connection, demand)
    now = rows[0].now
    ids = {row.name: row.id for row in rows}
    statements = ticket_statements(connection)
    with connection.cursor() as cursor:
        older = statements.older(cursor, list(ids.values()), key, now, lock_wait)
        kept = {id: permits for id, (_, permits) in older.items()}
        short = {row.id for row in lacking_room(rows, demand, kept)}
        held_short = [row.id for row in rows if row.id in short and not row.limit.is_rate]
        if held_short and reclaim_expired(connection, held_short, now, lock_wait):
            short = {row.id for row in lacking_room(_locked(connection, demand), demand, kept)}
        until = expires_at or now + MAX_TICKET_LIFE
        lacking = short
        if woken and not short:
            lacking = set(ids.values())
            # A queue deadline later than any, so that it writes every row:
            # on Galera a row lock is local to its node, and this write is
            # what makes two sends that fit on two nodes conflict at
            # certification (one is retried, and finds the other's ticket).
            queued = [row.queued_until for row in rows if row.queued_until is not None]
            until = max([until, *queued]) + timedelta(microseconds=1)
        counts = {ids[name]: count for name, count in demand.items()}
        statements.take(cursor, key, "", counts, now, until, lacking, lock_wait, priority, share)
    return Lined(ids, {row.id for row in rows if row.limit.is_rate}, short)


class _Locked(NamedTuple):
    """A semaphore row as ``line_up`` locked it."""

    name: str
    id: int
    capacity: int
    in_use: int
    window: int | None
    queued_until: datetime | None
    now: datetime  # the database's clock

    @property
    def limit(self) -> Limit:
        return Limit(self.capacity, self.window)


def _locked(connection: BaseDatabaseWrapper, demand: Mapping[str, int]) -> list[_Locked]:
    """These semaphores' rows, locked (again), with the database's clock."""
    rows = [
        _Locked(*row)
        for row in Semaphore.objects.using(connection.alias)
        .filter(name__in=demand)
        .locked()
        .annotate(db_now=DatabaseNow())
        .values_list("name", "id", "capacity", F("in_use"), "window", "queued_until", "db_now")
    ]
    if len(rows) != len(demand):
        raise SemaphoreNotFound(set(demand) - {row.name for row in rows})
    return rows


def _candidates(alias: str, freed: set[int]) -> list[str]:
    """The parked tasks that may fit in the room on these semaphores, by
    plain reads (no lock, no transaction; the wake-up decides under the
    lock). On each semaphore with room, by two indexed reads of at most
    its room each (every task takes at least one): the oldest tasks that
    lacked room there (they come first), and the oldest that lacked room
    nowhere (younger ones that may pass the others). A task held back
    elsewhere is found by the wake-ups of the semaphores it lacks. Most
    releases of a busy semaphore find no room left, or nothing parked, and
    end the wake-up here. A park or a release committed after these reads
    runs a wake-up of its own."""
    semaphores = Semaphore.objects.using(alias).filter(id__in=freed)
    lacking = Ticket.objects.filter(external_id=OuterRef("external_id"), lacked=True)
    candidates: set[str] = set()
    for id, capacity, in_use in semaphores.values_list("id", "capacity", F("in_use")):
        if (free := room(in_use, capacity)) > 0:
            line = Ticket.objects.using(alias).of_parked().filter(semaphore_id=id).in_line()
            for kind in (Q(lacked=True), Q(lacked=False) & ~Exists(lacking)):
                oldest = line.filter(kind).values_list("external_id", flat=True)
                candidates.update(oldest[: min(free, CANDIDATES_READ)])
    return sorted(candidates)


def next_slots(alias: str, semaphore_ids: set[int]) -> dict[int, float]:
    """Semaphore id -> seconds until the next slot ends, for the rate limits
    (windowed semaphores) among these that parked tasks wait on: they gain
    room then, and no release will say so. By plain reads, no lock."""
    slots = Permit.objects.using(alias).counting().filter(semaphore=OuterRef("pk"))
    rows = (
        Semaphore.objects.using(alias)
        .rate_limits()
        .filter(id__in=semaphore_ids)
        .filter(Exists(Ticket.objects.of_parked().filter(semaphore=OuterRef("pk"))))
        .annotate(next_ends=Subquery(slots.values("slot_ends")[:1]), db_now=DatabaseNow())
        .values_list("id", "next_ends", "db_now")
    )
    return {
        id: max((ends - now).total_seconds(), 0.0) for id, ends, now in rows if ends is not None
    }


@dataclass(frozen=True, order=True)
class _Place:
    """One ticket: its place in its semaphore's line (``ranked_at``, then
    ``id``: ``engine/line.py``), key, count."""

    ranked_at: datetime
    id: int
    key: str = field(compare=False)
    count: int = field(compare=False)


@dataclass
class _Line:
    """A semaphore as the wake-up locked it, and the start of its line: the
    oldest tickets that hold back (at most its room's worth: one more
    could never leave room for anybody behind)."""

    capacity: int
    in_use: int
    holding_back: list[_Place] = field(default_factory=list)

    def fits(self, place: _Place) -> bool:
        """Whether ``place`` fits beside the older tickets that hold back."""
        kept = sum(p.count for p in self.holding_back if p < place and p.key != place.key)
        return fits(self.in_use, place.count, self.capacity, kept)

    def hold_back(self, place: _Place) -> None:
        self.holding_back.append(place)
        self.holding_back.sort()


def wake_once(connection: BaseDatabaseWrapper, freed: set[int]) -> list[int]:
    """One wake-up's transaction: under the semaphores' row locks, wake the
    oldest parked tasks that fit in the room on these semaphores (their
    tickets lack room everywhere now: it is kept for them); returns their
    ``ParkedTask`` ids, for the caller to publish once this is committed."""
    alias = connection.alias
    # Read before the transaction, to hold its lock for as short as can be
    # (grants wait on it); what another wake-up woke meanwhile is left out
    # under it.
    candidates = _candidates(alias, freed)
    if not candidates:
        return []
    tickets = Ticket.objects.using(alias)
    with backends.bounded_transaction(connection, app_settings.LOCK_WAIT_TIMEOUT):
        involved = freed | set(
            tickets.filter(external_id__in=candidates).values_list("semaphore_id", flat=True)
        )
        # Locked as the grant locks them (name order): the room read here
        # stays true until this commits, and two wake-ups never spend it twice.
        lines = {
            id: _Line(capacity, in_use)
            for id, capacity, in_use in Semaphore.objects.using(alias)
            .filter(id__in=involved)
            .locked()
            .values_list("id", "capacity", F("in_use"))
        }
        for id, line in lines.items():
            if (free := room(line.in_use, line.capacity)) > 0:
                first = tickets.holding_back().filter(semaphore_id=id).in_line()
                line.holding_back = [
                    _Place(*row)
                    for row in first.values_list("ranked_at", "id", "external_id", "count")[:free]
                ]
        waiting = dict(
            ParkedTask.objects.using(alias)
            .filter(key__in=candidates, woken_at__isnull=True)
            .exclude(not_before__gt=DatabaseNow())  # a debounced send's delay
            .values_list("key", "id")
        )
        places: dict[str, dict[int, tuple[_Place, bool]]] = defaultdict(dict)
        for ranked_at, id, key, semaphore_id, count, lacked in tickets.filter(
            external_id__in=list(waiting), semaphore_id__in=list(lines)
        ).values_list("ranked_at", "id", "external_id", "semaphore_id", "count", "lacked"):
            places[key][semaphore_id] = (_Place(ranked_at, id, key, count), lacked)
        chosen, lacking = _choose(places, lines)
        _hold_back(connection, lacking)
        woken = [waiting[key] for key in chosen]
        if woken:
            ParkedTask.objects.using(alias).filter(id__in=woken).update(woken_at=timezone.now())
    return woken


def _choose(
    places: Mapping[str, Mapping[int, tuple[_Place, bool]]], lines: Mapping[int, _Line]
) -> tuple[list[str], list[int]]:
    """A wake-up's decision: the tasks to wake (keys, oldest first), and the
    tickets that lack room from now on (newly: woken, or passed over).

    First in line first (by their first ticket): a task that fits beside
    the tickets ahead of it holding back on each of its semaphores is woken
    and holds back there; one that does not lacks room where it does not
    fit, and holds back those behind it there."""
    woken: list[str] = []
    lacking: list[int] = []
    for key in sorted(places, key=lambda key: min(p for p, _ in places[key].values())):
        asks = places[key]
        short = {s for s, (place, _) in asks.items() if not lines[s].fits(place)}
        for s, (place, lacked) in asks.items():
            if not lacked and (not short or s in short):
                lines[s].hold_back(place)
                lacking.append(place.id)
        if not short:
            woken.append(key)
    return woken, lacking


def _hold_back(connection: BaseDatabaseWrapper, ticket_ids: list[int]) -> None:
    """Mark these tickets as lacking room, and their semaphores' queues live
    until they expire at least."""
    if not ticket_ids:
        return
    tickets = Ticket.objects.using(connection.alias).filter(id__in=ticket_ids)
    tickets.update(lacked=True)
    latest = tickets.order_by().values("semaphore_id").annotate(latest=Max("expires_at"))
    with connection.cursor() as cursor:
        for semaphore_id, expires_at in latest.values_list("semaphore_id", "latest"):
            ticket_statements(connection).queue_until(cursor, [semaphore_id], expires_at)
