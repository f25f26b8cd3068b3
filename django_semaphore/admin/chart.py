"""The utilization chart of the semaphore page: in use (on a rate limit, the
grants in its window) against capacity over the last day
(``utilization``), drawn as inline SVG with a text description: no
JavaScript, no extra table."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.template.loader import render_to_string
from django.utils import timezone
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_semaphore.admin.display import AMBER, BLUE, RED
from django_semaphore.utilization import CapacityMark, Utilization

WIDTH = 760
HEIGHT = 240
LEFT, RIGHT, TOP, BOTTOM = 44, 12, 12, 52  # the bottom margin holds axis labels and the legend
# The capacity line's color; the others are the usage bar's (display.py). Text
# and grid use currentColor so they follow the theme.
CAPACITY = "#417690"


@dataclass(frozen=True)
class _Scale:
    """Maps times and counts to SVG coordinates, already formatted as text
    for the template."""

    start: datetime
    seconds: float
    top: int

    def x(self, at: datetime) -> str:
        fraction = (at - self.start).total_seconds() / self.seconds
        return _number(LEFT + min(max(fraction, 0.0), 1.0) * (WIDTH - LEFT - RIGHT))

    def y(self, value: int) -> str:
        return _number(TOP + (HEIGHT - TOP - BOTTOM) * (1 - value / self.top))


def _number(value: float) -> str:
    return f"{value:.1f}".removesuffix(".0")


def axis_ticks(highest: int) -> list[int]:
    """Round y-axis ticks from 0 to just above ``highest`` (one step of headroom)."""
    rough = max(highest, 1) / 4
    magnitude = 10 ** math.floor(math.log10(rough)) if rough >= 1 else 1
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= rough)
    return list(range(0, (highest // step + 1) * step + 1, step))


def render_svg(utilization: Utilization, *, title: str) -> SafeString:
    """Draw in use vs capacity over the period as a self-contained ``<svg>``.

    Args:
        utilization: what ``load_utilization()`` or ``build_utilization()`` returned.
        title: the chart's accessible name, e.g. the semaphore's name.

    Returns:
        Markup safe to insert into a page, rendered from the template
        ``utilization.svg``, which escapes every value. Hovering a
        capacity-change marker shows who changed it, when and why (an SVG
        ``<title>``, no script).
    """
    ticks = axis_ticks(utilization.highest)
    scale = _Scale(
        start=utilization.start,
        seconds=(utilization.end - utilization.start).total_seconds(),
        top=ticks[-1],
    )
    segments = utilization.segments
    left, right, baseline = scale.x(utilization.start), scale.x(utilization.end), scale.y(0)

    # Step paths: horizontal while nothing changes, vertical at each change.
    area = [f"M{left} {baseline}"]
    capacity_line = [f"M{left} {scale.y(segments[0].capacity)}"]
    for segment in segments:
        area.append(f"V{scale.y(segment.in_use)} H{scale.x(segment.end)}")
        capacity_line.append(f"V{scale.y(segment.capacity)} H{scale.x(segment.end)}")
    area.append(f"V{baseline} Z")
    counted = _counted(utilization)
    return render_to_string(
        "admin/django_semaphore/semaphore/utilization.svg",
        {
            "width": WIDTH,
            "height": HEIGHT,
            "title": title,
            "summary": describe(utilization),
            "windowed": utilization.windowed,
            "left": left,
            "right": right,
            "top": TOP,
            "baseline": baseline,
            "label_x": LEFT - 6,
            "label_y": _number(float(baseline) + 16),
            "legend_y": HEIGHT - 12,
            "grid": [(scale.y(t), t) for t in ticks],
            "hours": [
                (scale.x(at), at.strftime("%H:%M"))
                for at in _whole_hours(utilization.start, utilization.end)
                if at.hour % 3 == 0
            ],
            "area": " ".join(area),
            "over_capacity": [
                {
                    "x": scale.x(s.start),
                    "y": scale.y(s.in_use),
                    "width": _number(max(float(scale.x(s.end)) - float(scale.x(s.start)), 1.0)),
                    "height": _number(float(scale.y(s.capacity)) - float(scale.y(s.in_use))),
                    "text": _("%(in_use)d %(counted)s, capacity %(capacity)d")
                    % {"in_use": s.in_use, "counted": counted, "capacity": s.capacity},
                }
                for s in segments
                if s.over_capacity
            ],
            "capacity_line": " ".join(capacity_line),
            "changes": [
                (scale.x(change.at), _describe_change(change)) for change in utilization.changes
            ],
            "in_use_color": BLUE,
            "capacity_color": CAPACITY,
            "over_color": RED,
            "change_color": AMBER,
        },
    )


def _whole_hours(start: datetime, end: datetime) -> Iterator[datetime]:
    """The whole hours inside the period, in local time."""
    at = timezone.localtime(start).replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    while at < end:
        yield timezone.localtime(at)
        at += timedelta(hours=1)


def _counted(utilization: Utilization) -> str:
    """What the area counts: permits held, or a rate limit's grants in its window."""
    return _("in a window") if utilization.windowed else _("in use")


def _describe_change(change: CapacityMark) -> str:
    text = _("%(time)s: capacity %(old)s → %(new)s") % {
        "time": timezone.localtime(change.at).strftime("%H:%M"),
        "old": change.old,
        "new": change.new,
    }
    if change.changed_by:
        text += " " + _("by %(user)s") % {"user": change.changed_by}
    if change.reason:
        text += f" — {change.reason}"
    return text


def describe(utilization: Utilization) -> str:
    """One sentence for people who cannot see the chart (and for its ``<desc>``)."""
    peak, current = utilization.peak, utilization.current
    if peak.in_use == 0:
        idle = _("Nothing was granted") if utilization.windowed else _("Nothing was in use")
        text = _("%(idle)s; capacity is %(capacity)d.") % {
            "idle": idle,
            "capacity": current.capacity,
        }
    else:
        text = _(
            "Peak %(peak)d %(counted)s (capacity %(peak_capacity)d) at %(peak_time)s; "
            "now %(now)d of %(capacity)d."
        ) % {
            "peak": peak.in_use,
            "counted": _counted(utilization),
            "peak_capacity": peak.capacity,
            "peak_time": timezone.localtime(peak.start).strftime("%H:%M"),
            "now": current.in_use,
            "capacity": current.capacity,
        }
    if utilization.was_over_capacity:
        text += " " + _("Over capacity at times.")
    if utilization.changes:
        count = len(utilization.changes)
        text += " " + ngettext(
            "%(count)d capacity change.", "%(count)d capacity changes.", count
        ) % {"count": count}
    return text
