"""The utilization chart of the semaphore page: in use (on a rate limit, the
grants in its window) against capacity over the last day
(``utilization``), drawn as inline SVG with a text description: no
JavaScript, no extra table."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone
from django.utils.html import format_html, format_html_join
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
    """Maps times and counts to SVG coordinates, already formatted as text:
    ``format_html`` escapes its arguments into strings before formatting, so
    numbers are passed to it ready-made."""

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
        Markup safe to insert into a page; every value went through
        ``format_html``. Hovering a capacity-change marker shows who changed
        it, when and why (an SVG ``<title>``, no script).
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

    grid = _each(
        '<line x1="{left}" x2="{right}" y1="{y}" y2="{y}" stroke="currentColor" '
        'stroke-opacity=".15"/>'
        '<text x="{label_x}" y="{y}" text-anchor="end" dominant-baseline="middle">{value}</text>',
        {"left": left, "right": right, "label_x": LEFT - 6},
        ({"y": scale.y(t), "value": t} for t in ticks),
    )
    hours = _each(
        '<line x1="{x}" x2="{x}" y1="{top}" y2="{bottom}" stroke="currentColor" '
        'stroke-opacity=".08"/><text x="{x}" y="{label_y}" text-anchor="middle">{text}</text>',
        {"top": TOP, "bottom": baseline, "label_y": _number(float(baseline) + 16)},
        (
            {"x": scale.x(at), "text": timezone.localtime(at).strftime("%H:%M")}
            for at in _hour_marks(utilization.start, utilization.end)
        ),
    )
    over = _each(
        '<rect class="over-capacity" x="{x}" y="{y}" width="{width}" height="{height}" '
        'fill="{color}"><title>{text}</title></rect>',
        {"color": RED},
        (
            {
                "x": scale.x(s.start),
                "y": scale.y(s.in_use),
                "width": _number(max(float(scale.x(s.end)) - float(scale.x(s.start)), 1.0)),
                "height": _number(float(scale.y(s.capacity)) - float(scale.y(s.in_use))),
                "text": _("%(in_use)d %(counted)s, capacity %(capacity)d")
                % {"in_use": s.in_use, "counted": _counted(utilization), "capacity": s.capacity},
            }
            for s in segments
            if s.over_capacity
        ),
    )
    markers = _each(
        '<g class="capacity-change"><title>{text}</title>'
        '<line x1="{x}" x2="{x}" y1="{top}" y2="{bottom}" stroke="{color}" stroke-width="2"/>'
        '<line x1="{x}" x2="{x}" y1="{top}" y2="{bottom}" stroke="transparent" '
        'stroke-width="10"/><circle cx="{x}" cy="{top}" r="4" fill="{color}"/></g>',
        {"top": TOP, "bottom": baseline, "color": AMBER},
        (
            {"text": _describe_change(change), "x": scale.x(change.at)}
            for change in utilization.changes
        ),
    )
    return format_html(
        '<svg class="semaphore-utilization" xmlns="http://www.w3.org/2000/svg" '
        'viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        'font-family="sans-serif" font-size="11" fill="currentColor" '
        'style="max-width: 100%; height: auto">'
        "<title>{title}</title><desc>{summary}</desc>"
        "{grid}{hours}"
        '<path class="in-use" d="{area}" fill="{in_use}" fill-opacity=".55" stroke="{in_use}"/>'
        "{over}"
        '<path class="capacity" d="{capacity_line}" fill="none" stroke="{capacity}" '
        'stroke-width="2" stroke-dasharray="6 3"/>'
        "{markers}"
        '<g transform="translate({left} {legend_y})">'
        '<rect y="-8" width="14" height="10" fill="{in_use}" fill-opacity=".55"/>'
        '<text x="18">{in_use_label}</text>'
        '<line x1="90" x2="108" y1="-3" y2="-3" stroke="{capacity}" stroke-width="2" '
        'stroke-dasharray="6 3"/><text x="112">{capacity_label}</text>'
        '<rect x="190" y="-8" width="14" height="10" fill="{over_color}"/>'
        '<text x="208">{over_label}</text>'
        '<circle cx="317" cy="-3" r="4" fill="{change}"/><text x="326">{change_label}</text>'
        "</g></svg>",
        width=WIDTH,
        height=HEIGHT,
        title=title,
        summary=describe(utilization),
        grid=grid,
        hours=hours,
        area=" ".join(area),
        in_use=BLUE,
        over=over,
        capacity_line=" ".join(capacity_line),
        capacity=CAPACITY,
        markers=markers,
        left=LEFT,
        legend_y=HEIGHT - 12,
        in_use_label=_("in window") if utilization.windowed else _("in use"),
        capacity_label=_("capacity"),
        over_color=RED,
        over_label=_("over capacity"),
        change=AMBER,
        change_label=_("capacity change"),
    )


def _each(template: str, shared: dict[str, Any], rows: Iterable[dict[str, Any]]) -> SafeString:
    """``template`` filled in once per row, with the row's values and the ``shared`` ones."""
    return format_html_join("", template, ({**shared, **row} for row in rows))


def _hour_marks(start: datetime, end: datetime, every: int = 3) -> list[datetime]:
    """Whole local hours divisible by ``every`` inside the period."""
    local = timezone.localtime(start).replace(minute=0, second=0, microsecond=0)
    marks = []
    at = local + timedelta(hours=1)
    while at < end:
        if timezone.localtime(at).hour % every == 0:
            marks.append(at)
        at += timedelta(hours=1)
    return marks


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
