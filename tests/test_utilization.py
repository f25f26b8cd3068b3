"""The utilization chart: the replay (pure), the queries, the SVG."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from xml.etree import ElementTree

import pytest
from django.contrib.auth import get_user_model

from django_semaphore import acquire, release, set_capacity
from django_semaphore.admin.chart import axis_ticks, describe, render_svg
from django_semaphore.limits import Limit
from django_semaphore.models import PermitRequest
from django_semaphore.utilization import (
    CapacityMark,
    Segment,
    Span,
    Utilization,
    build_utilization,
    load_utilization,
)
from tests.conftest import unique

START = datetime(2026, 1, 1, tzinfo=UTC)
END = START + timedelta(hours=24)


def at(hours: float) -> datetime:
    return START + timedelta(hours=hours)


def steps(utilization: Utilization) -> list[tuple[float, float, int, int]]:
    def hours(moment: datetime) -> float:
        return (moment - START).total_seconds() / 3600

    return [(hours(s.start), hours(s.end), s.in_use, s.capacity) for s in utilization.segments]


def mark(hours: float, old: int, new: int, by: str = "", reason: str = "") -> CapacityMark:
    return CapacityMark(at=at(hours), old=Limit(old), new=Limit(new), changed_by=by, reason=reason)


def test_nothing_happened():
    assert steps(build_utilization([], 3, [], START, END)) == [(0, 24, 0, 3)]


def test_grants_add_up_and_release():
    grants = [Span(1, at(1), at(5)), Span(2, at(2), at(3)), Span(1, at(4), None)]
    assert steps(build_utilization(grants, 3, [], START, END)) == [
        (0, 1, 0, 3),
        (1, 2, 1, 3),
        (2, 3, 3, 3),
        (3, 4, 1, 3),
        (4, 5, 2, 3),
        (5, 24, 1, 3),
    ]


def test_grants_overlapping_the_window_edges_are_clipped():
    grants = [
        Span(2, at(-5), at(3)),  # held when the window opens
        Span(1, at(-5), None),  # held all along
        Span(4, at(-9), at(-1)),  # over before the window: ignored
        Span(4, at(25), None),  # after the window: ignored
        Span(1, at(23), at(30)),  # still held when the window closes
    ]
    assert steps(build_utilization(grants, 5, [], START, END)) == [
        (0, 3, 3, 5),
        (3, 23, 1, 5),
        (23, 24, 2, 5),
    ]


def test_simultaneous_events_make_no_empty_segment():
    grants = [Span(1, at(1), at(2)), Span(1, at(2), at(3))]  # hand-over at 2h
    assert steps(build_utilization(grants, 1, [], START, END)) == [
        (0, 1, 0, 1),
        (1, 3, 1, 1),
        (3, 24, 0, 1),
    ]


def test_capacity_is_replayed_backwards_from_now():
    changes = [mark(6, 2, 5), mark(12, 5, 1)]
    grants = [Span(3, at(10), None)]
    utilization = build_utilization(grants, 1, changes, START, END)
    assert steps(utilization) == [
        (0, 6, 0, 2),
        (6, 10, 0, 5),
        (10, 12, 3, 5),
        (12, 24, 3, 1),
    ]
    assert utilization.was_over_capacity
    assert [s.over_capacity for s in utilization.segments] == [False, False, False, True]
    assert utilization.changes == changes


def test_changes_outside_the_window_are_ignored():
    changes = [mark(-3, 9, 4), mark(30, 4, 7)]
    assert steps(build_utilization([], 4, changes, START, END)) == [(0, 24, 0, 4)]


def test_peak_current_and_highest():
    grants = [Span(4, at(2), at(3)), Span(1, at(5), None)]
    utilization = build_utilization(grants, 3, [mark(1, 6, 3)], START, END)
    assert utilization.peak == Segment(at(2), at(3), 4, 3)
    assert utilization.current == Segment(at(5), END, 1, 3)
    assert utilization.highest == 6  # capacity was 6 in the first hour


def test_window_must_not_be_empty():
    with pytest.raises(ValueError, match="end after"):
        build_utilization([], 1, [], END, START)


@pytest.mark.parametrize(
    ("highest", "ticks"),
    [
        (0, [0, 1]),
        (1, [0, 1, 2]),
        (3, [0, 1, 2, 3, 4]),
        (4, [0, 1, 2, 3, 4, 5]),
        (10, [0, 5, 10, 15]),
        (37, [0, 10, 20, 30, 40]),
        (1000, [0, 500, 1000, 1500]),
    ],
)
def test_axis_ticks_are_round_and_leave_headroom(highest, ticks):
    assert axis_ticks(highest) == ticks


def test_description():
    idle = build_utilization([], 3, [], START, END)
    assert describe(idle) == "Nothing was in use; capacity is 3."
    busy = build_utilization(
        [Span(4, at(2), at(3)), Span(1, at(5), None)], 3, [mark(1, 6, 3)], START, END
    )
    assert describe(busy) == (
        "Peak 4 in use (capacity 3) at 02:00; now 1 of 3. "
        "Over capacity at times. 1 capacity change."
    )


def test_svg_is_well_formed_and_shows_every_part():
    changes = [mark(12, 5, 1, by="alice", reason="<script>alert(1)</script>")]
    grants = [Span(3, at(10), None)]
    svg = render_svg(build_utilization(grants, 1, changes, START, END), title="exports & co")

    root = ElementTree.fromstring(svg)  # well-formed XML, so every value was escaped
    ns = {"svg": "http://www.w3.org/2000/svg"}
    assert root.find("svg:title", ns).text == "exports & co"
    assert "Over capacity at times" in root.find("svg:desc", ns).text
    assert root.find(".//svg:path[@class='in-use']", ns) is not None
    assert root.find(".//svg:path[@class='capacity']", ns) is not None
    over = root.findall(".//svg:rect[@class='over-capacity']", ns)
    assert len(over) == 1
    marker = root.find(".//svg:g[@class='capacity-change']/svg:title", ns)
    assert marker.text == "12:00: capacity 5 → 1 by alice — <script>alert(1)</script>"
    assert "<script>" not in svg
    hours = [t.text for t in root.findall("svg:text", ns) if t.text and ":" in t.text]
    assert hours == [f"{h:02}:00" for h in range(3, 24, 3)]
    assert "<script" not in svg.lower()  # no JavaScript


def test_svg_paths_follow_the_steps():
    utilization = build_utilization([Span(2, at(12), None)], 2, [], START, END)
    svg = render_svg(utilization, title="t")
    area = re.search(r'class="in-use" d="([^"]+)"', svg).group(1)
    # Baseline, then flat at 0 until noon, up to 2 until the end, back down.
    assert area.startswith("M44 ")
    assert area.count("H") == 2
    assert area.endswith("Z")


# --- from the database ------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_load_replays_requests_and_capacity_changes(make_semaphore):
    sem = make_semaphore(capacity=3)
    user = get_user_model().objects.create_user(unique("ops"))
    done = acquire({sem.name: 2}, external_id=unique())
    release(done.external_id)
    held = acquire(sem.name, external_id=unique())
    other = make_semaphore(capacity=3)
    acquire(other.name, external_id=unique())  # another semaphore's: not counted
    ancient = acquire(sem.name, external_id=unique())  # released two days ago
    release(ancient.external_id)
    now = PermitRequest.objects.get(pk=ancient.pk).released_at
    # Whole hours apart, so no two events share a timestamp on any database.
    move = {
        done: (now - timedelta(hours=3), now - timedelta(hours=2)),
        held: (now - timedelta(hours=1), None),
        ancient: (now - timedelta(days=2), now - timedelta(days=2) + timedelta(hours=1)),
    }
    for request, (created_at, released_at) in move.items():
        PermitRequest.objects.filter(pk=request.pk).update(
            created_at=created_at, released_at=released_at
        )
    set_capacity(sem.name, 5, changed_by=user, reason="more")

    utilization = load_utilization(sem)

    assert utilization.end - utilization.start == timedelta(hours=24)
    assert [(s.in_use, s.capacity) for s in utilization.segments] == [
        (0, 3),
        (2, 3),
        (0, 3),
        (1, 3),
        (1, 5),
    ]
    assert utilization.current.in_use == 1
    assert utilization.current.capacity == 5
    assert utilization.peak.in_use == 2
    assert [(c.old, c.new, c.changed_by, c.reason) for c in utilization.changes] == [
        (Limit(3), Limit(5), str(user), "more")
    ]
