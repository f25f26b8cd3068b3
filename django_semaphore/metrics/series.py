"""Which series a semaphore is reported in: its own, or its family's.

A family (``"export:customer:*"``) has a member per customer, created on
first use: a series per member would grow Prometheus' series (its memory,
every query over them) with the number of customers. So a family's members
are one series, labelled with the family's pattern, unless
``METRICS_PER_MEMBER`` names the family; every other semaphore is its own
series. The gauges (``collector``) and the event counters (``events``)
follow the same rule, so a family's grants and its usage share a label.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

from django_semaphore import conf
from django_semaphore.conf import app_settings


def event_label(name: str) -> str:
    """The ``semaphore`` label of an event on ``name``: the pattern of the
    family that matches it (first match, as members are created), unless
    that family is reported per member; a declared name is its own."""
    if name in app_settings.SEMAPHORES:
        return name
    family = conf.family_of(name)
    if family is None or family.pattern in app_settings.METRICS_PER_MEMBER:
        return name
    return family.pattern


def share_label(share: str) -> str:
    """The ``share`` label of a waiter's share key: the key itself where
    ``SHARE_WEIGHTS`` names it (a mapping: keys the project chose, a bounded
    number), ``"other"`` for any other key, so that a key per customer does
    not grow a series per customer."""
    weights = app_settings.SHARE_WEIGHTS
    return share if isinstance(weights, Mapping) and share in weights else "other"


@dataclass
class Gauges:
    """One series' gauges: a semaphore's, or a family's members' together.

    Capacity, permits in use, waiters and parked tasks add up over the
    members; the longest wait and the oldest parked task are the worst of
    them (what an alert on a queue that does not move wants). The window
    (seconds; 0 for a concurrency limit) is the longest of them: members
    share their family's unless one was changed on its own.
    """

    capacity: int = 0
    window: int = 0
    in_use: int = 0
    waiters: int = 0
    longest_wait: float = 0.0
    parked: int = 0
    oldest_parked: float = 0.0

    def add(self, row: Mapping[str, Any], *, with_capacity: bool = True) -> None:
        # MySQL returns the annotated counts as Decimal.
        self.capacity += int(row["capacity"]) if with_capacity else 0
        self.window = max(self.window, row["window"] or 0)
        self.in_use += int(row["in_use"])
        self.waiters += int(row["waiters"])
        self.longest_wait = max(self.longest_wait, _seconds(row["longest_wait"]))
        self.parked += int(row["parked"])
        self.oldest_parked = max(self.oldest_parked, _seconds(row["oldest_parked"]))


COLUMNS = ("name", "family", *(field.name for field in fields(Gauges)))
"""What the scrape selects of each row: its name, family and gauges, nothing
else of ``with_usage()`` and ``with_parked()`` (no holders' subquery)."""


def gauges_by_label(rows: Iterable[Mapping[str, Any]]) -> dict[str, Gauges]:
    """The rows (``COLUMNS``) folded into their series, by label.

    A family's default row (its template, named by the pattern) holds
    nothing and is not a member: it only makes the family's series exist
    while it has no members, and adds no capacity to it.
    """
    per_member = app_settings.METRICS_PER_MEMBER
    patterns = {family.pattern for family in conf.families()}
    series: dict[str, Gauges] = {}
    for row in rows:
        family = row["family"] or (row["name"] if row["name"] in patterns else "")
        if family and family not in per_member:
            series.setdefault(family, Gauges()).add(row, with_capacity=bool(row["family"]))
        else:
            series.setdefault(row["name"], Gauges()).add(row)
    return series


def _seconds(waited: timedelta | None) -> float:
    """0 when nothing waits; a clock stepped back reads 0, never negative."""
    return max(waited.total_seconds(), 0.0) if waited else 0.0
