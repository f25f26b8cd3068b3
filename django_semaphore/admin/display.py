"""How the console shows values: the usage bar, rates, durations and expiry times."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.timesince import timesince
from django.utils.translation import gettext, ngettext

from django_semaphore.models import CapacityChange, Permit, Ticket

# The admin's own palette, readable on its light and dark themes; the bar's
# colors (in use, full, over capacity), which the chart (chart.py) shares.
BLUE = "#79aec8"
AMBER = "#e09e00"
RED = "#ba2121"


def usage_bar(in_use: int, capacity: int) -> SafeString:
    """A 100-pixel SVG bar of ``in_use`` out of ``capacity``, with a label.

    Full is amber; over capacity (after capacity was lowered below what is
    held) is red, filled to the end and labelled with the excess.
    """
    if capacity:
        percent = in_use * 100 / capacity
        label = f"{percent:.0f}%"
    else:
        percent = 100.0 if in_use else 0.0
        label = "" if in_use else gettext("closed")
    if in_use > capacity:
        color, state = RED, "over-capacity"
        excess = gettext("over by %(count)d") % {"count": in_use - capacity}
        label = f"{label} · {excess}" if label else excess
    elif capacity and in_use == capacity:
        color, state = AMBER, "full"
    else:
        color, state = BLUE, "in-use" if in_use else "idle"
    title = gettext("%(in_use)d in use of %(capacity)d") % {"in_use": in_use, "capacity": capacity}
    return format_html(
        '<span class="semaphore-bar {state}" title="{title}" style="white-space: nowrap">'
        '<svg width="100" height="10" role="img" aria-label="{title}" '
        'style="vertical-align: middle">'
        '<rect width="100" height="10" rx="2" fill="currentColor" fill-opacity=".12"/>'
        '<rect width="{width}" height="10" rx="2" fill="{color}"/></svg> {label}</span>',
        state=state,
        title=title,
        width=f"{min(percent, 100.0):.0f}",
        color=color,
        label=label,
    )


def demand(shares: Iterable[Permit] | Iterable[Ticket]) -> str:
    """A request's or a parked task's semaphores, each with its count when
    more than one: "a, b (2)"."""
    return ", ".join(
        share.semaphore.name if share.count == 1 else f"{share.semaphore.name} ({share.count})"
        for share in shares
    )


def counted_link(count: int, url: str) -> SafeString | int:
    """``count`` as a link to the list of what it counts; a bare 0."""
    return format_html('<a href="{}">{}</a>', url, count) if count else 0


def limit_change(change: CapacityChange) -> str:
    """A capacity history row as old → new limit: "4 → 6", "5/min → 10/min",
    "5 → 5/min" (a window set), "5/min → 5" (removed)."""
    return f"{change.old_limit} → {change.new_limit}"


def expiry(expires_at: datetime | None, now: datetime) -> str:
    """When ``expires_at`` comes, in words from ``now``: "in 5 minutes",
    "expired 40 seconds ago", or never."""
    if expires_at is None:
        return gettext("never (no TTL)")
    if expires_at <= now:
        return gettext("expired %(time)s ago") % {"time": duration(expires_at, now)}
    return gettext("in %(time)s") % {"time": duration(now, expires_at)}


def elapsed(waited: timedelta) -> str:
    """A time measured elsewhere (by the database's clock), in ``duration``'s words."""
    end = datetime.fromtimestamp(0, UTC) + max(waited, timedelta(0))
    return duration(datetime.fromtimestamp(0, UTC), end)


def duration(start: datetime, end: datetime) -> str:
    """Like ``timesince``, but a short TTL reads "40 seconds", not "0 minutes"."""
    seconds = int((end - start).total_seconds())
    if seconds < 60:
        return ngettext("%(count)d second", "%(count)d seconds", seconds) % {"count": seconds}
    return timesince(start, end)
