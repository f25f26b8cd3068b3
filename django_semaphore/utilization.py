"""A semaphore's recent utilization, replayed from the history it already has.

Nothing is sampled or stored for the chart. Every grant is a ``PermitRequest``
(``created_at``, ``released_at``) with a ``Permit`` (``count``) on the
semaphore, so replaying grants as +count and releases as -count gives the
exact in-use step function; replaying the ``CapacityChange`` rows backwards
from today's capacity gives the capacity line. On a rate limit (a windowed
semaphore) a grant counts from its grant until its slot ends
(``Permit.slot_ends``), released or not, so that span is replayed instead:
the chart then plots the grants in the window, as ``in_use`` counts them. The clean-up sweeps keep
released requests for 7 days and capacity history for 30 by default, so the
last 24 hours are complete unless ``RELEASED_RETENTION`` is set below a day.

``load_utilization()`` runs the queries, ``build_utilization()`` is the pure
replay (unit-tested without a database); the admin draws it
(``admin/chart.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from django_semaphore import routing
from django_semaphore.backends import DatabaseNow
from django_semaphore.limits import Limit
from django_semaphore.models import CapacityChange, Permit, Semaphore
from django_semaphore.states import State

PERIOD = timedelta(hours=24)


@dataclass(frozen=True)
class Span:
    """A permit's life on the semaphore: ``count`` held from ``start`` to
    ``end``; or, ``slot``, a rate limit's grant counted until its slot ends."""

    count: int
    start: datetime
    end: datetime | None  # None: still held
    slot: bool = False


@dataclass(frozen=True)
class CapacityMark:
    """A change of capacity or window, as drawn on the chart."""

    at: datetime
    old: Limit
    new: Limit
    changed_by: str
    reason: str


@dataclass(frozen=True)
class Segment:
    """A stretch of time during which neither usage nor capacity changed."""

    start: datetime
    end: datetime
    in_use: int
    capacity: int

    @property
    def over_capacity(self) -> bool:
        return self.in_use > self.capacity


@dataclass(frozen=True)
class Utilization:
    """In use and capacity over ``[start, end]``, as consecutive segments;
    ``windowed``: a rate limit at ``end``, whose "in use" is its grants in
    the window."""

    start: datetime
    end: datetime
    segments: list[Segment]
    changes: list[CapacityMark]
    windowed: bool = False

    @property
    def peak(self) -> Segment:
        """The first segment with the most permits in use."""
        return max(self.segments, key=lambda segment: segment.in_use)

    @property
    def current(self) -> Segment:
        return self.segments[-1]

    @property
    def was_over_capacity(self) -> bool:
        return any(segment.over_capacity for segment in self.segments)

    @property
    def highest(self) -> int:
        """The largest value the chart must show: usage or capacity."""
        return max(max(s.in_use, s.capacity) for s in self.segments)


def build_utilization(
    grants: Iterable[Span],
    capacity_now: int,
    changes: Sequence[CapacityMark],
    start: datetime,
    end: datetime,
    *,
    windowed: bool = False,
) -> Utilization:
    """Replay grants and capacity changes into segments covering ``[start, end]``.

    Args:
        grants: every permit on the semaphore that overlaps the period (others
            are ignored).
        capacity_now: the semaphore's capacity at ``end``.
        changes: the capacity changes made inside the period, oldest first.
        start, end: the period drawn.
        windowed: the semaphore is a rate limit at ``end`` (its grants' spans
            end with their slots).

    Returns:
        The period as consecutive segments; adjacent equal ones are merged.
    """
    if end <= start:
        raise ValueError("The period must end after it starts.")
    inside = [change for change in changes if start < change.at < end]
    # A permit held counts only while the semaphore has no window (a rate
    # limit counts its grants' slots instead), as ``in_use`` counts it.
    plain = _plain_periods(inside, start, end, windowed)
    deltas: dict[datetime, int] = defaultdict(int)
    in_use = 0
    for grant in (piece for g in grants for piece in ([g] if g.slot else _clip(g, plain))):
        if grant.start >= end or (grant.end is not None and grant.end <= start):
            continue
        if grant.start <= start:
            in_use += grant.count
        else:
            deltas[grant.start] += grant.count
        if grant.end is not None and grant.end < end:
            deltas[grant.end] -= grant.count

    # The capacity before the first change is that change's old value;
    # without changes it never moved.
    capacity = inside[0].old.capacity if inside else capacity_now
    capacity_at = {change.at: change.new.capacity for change in inside}

    segments: list[Segment] = []
    cursor = start
    for moment in sorted({*deltas, *capacity_at}):
        _append(segments, Segment(cursor, moment, in_use, capacity))
        in_use += deltas.get(moment, 0)
        capacity = capacity_at.get(moment, capacity)
        cursor = moment
    _append(segments, Segment(cursor, end, in_use, capacity))
    return Utilization(start=start, end=end, segments=segments, changes=inside, windowed=windowed)


def _plain_periods(
    changes: Sequence[CapacityMark], start: datetime, end: datetime, windowed: bool
) -> list[tuple[datetime, datetime]]:
    """When, inside ``[start, end]``, the semaphore had no window."""
    periods = []
    since = start if (not changes[0].old.is_rate if changes else not windowed) else None
    for change in changes:
        if not change.new.is_rate and since is None:
            since = change.at
        elif change.new.is_rate and since is not None:
            periods.append((since, change.at))
            since = None
    if since is not None:
        periods.append((since, end))
    return periods


def _clip(grant: Span, periods: list[tuple[datetime, datetime]]) -> list[Span]:
    """The parts of a held permit's span inside ``periods``."""
    return [
        Span(grant.count, max(grant.start, begin), min(grant.end or finish, finish))
        for begin, finish in periods
        if grant.start < finish and (grant.end is None or grant.end > begin)
    ]


def _append(segments: list[Segment], segment: Segment) -> None:
    if segment.end <= segment.start:
        return
    last = segments[-1] if segments else None
    if last is not None and (last.in_use, last.capacity) == (segment.in_use, segment.capacity):
        segments[-1] = replace(last, end=segment.end)
    else:
        segments.append(segment)


def load_utilization(semaphore: Semaphore, *, period: timedelta = PERIOD) -> Utilization:
    """Read the last ``period`` of a semaphore's history and replay it.

    "Now" is the database's clock, the one that stamped ``created_at`` and
    ``released_at``. Permits count exactly as in the admin's "in use" column:
    a permit is in use while its own state is ACQUIRED (a request whose
    permits were released but whose own row was not yet, after a crash, is
    not in use; the sweep completes it), and a rate limit's permit while its
    slot lasts.
    """
    using = routing.current_alias()
    capacity_now, window_now, end = (
        Semaphore.objects.using(using)
        .values_list("capacity", "window", DatabaseNow())
        .get(pk=semaphore.pk)
    )
    start = end - period
    permits = Permit.objects.using(using).filter(semaphore_id=semaphore.pk)
    fields = ("count", "request__created_at", "request__released_at")
    # Three queries, each on an index: what is held now (semaphore, state),
    # what was released inside the period (state, released_at), and the
    # slots of a rate limit that ended inside it or last beyond it
    # (semaphore, slot_ends). One OR-ed query would scan the semaphore's
    # whole retained history instead.
    unslotted = permits.filter(slot_ends__isnull=True)
    held = unslotted.filter(state=State.ACQUIRED).values_list(*fields)
    released = unslotted.filter(
        state=State.RELEASED,
        request__state=State.RELEASED,
        request__released_at__gt=start,
        request__created_at__lt=end,
    ).values_list(*fields)
    slots = permits.filter(slot_ends__gt=start, request__created_at__lt=end).values_list(
        "count", "request__created_at", "slot_ends"
    )
    grants = [Span(*row) for row in [*held, *released]] + [Span(*row, slot=True) for row in slots]
    changes = [
        CapacityMark(
            at=change.changed_at,
            old=change.old_limit,
            new=change.new_limit,
            changed_by="" if change.changed_by is None else str(change.changed_by),
            reason=change.reason,
        )
        for change in CapacityChange.objects.using(using)
        .filter(semaphore_id=semaphore.pk, changed_at__gt=start)
        .select_related("changed_by")
        .order_by("changed_at", "id")
    ]
    return build_utilization(
        grants, capacity_now, changes, start, end, windowed=window_now is not None
    )
