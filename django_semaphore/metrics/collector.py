"""Per-semaphore gauges, read from the database when Prometheus scrapes.

Nothing is kept in process memory: every process (and every host) answers
with the same figures, in one query, whichever of them serves the scrape.
A family's members are one series unless ``METRICS_PER_MEMBER`` names it
(``series``).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Iterable

from django.db import Error
from prometheus_client import REGISTRY
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from django_semaphore import routing
from django_semaphore.metrics import series
from django_semaphore.models import Semaphore, Ticket
from django_semaphore.parking import with_parked

logger = logging.getLogger("django_semaphore")


# Each semaphore's gauges: its figure in ``series.Gauges``, the metric's name, its help.
GAUGES = (
    ("capacity", "django_semaphore_capacity", "Permits the semaphore grants at most."),
    (
        "window",
        "django_semaphore_window_seconds",
        "A rate limit's window: at most capacity grants in this many seconds; "
        "0 for a concurrency limit.",
    ),
    (
        "in_use",
        "django_semaphore_in_use",
        "Permits held now, or on a rate limit granted in its current window "
        "(above capacity after capacity was lowered).",
    ),
    ("waiters", "django_semaphore_waiters", "Waiters queued (live tickets)."),
    (
        "longest_wait",
        "django_semaphore_longest_wait_seconds",
        "How long the oldest queued waiter has waited; 0 when none.",
    ),
    (
        "parked",
        "django_semaphore_parked_tasks",
        "Celery tasks parked until this semaphore has room for them.",
    ),
    (
        "oldest_parked",
        "django_semaphore_oldest_parked_seconds",
        "How long the first parked task in line has waited (database clock); 0 when none.",
    ),
)


class SemaphoreCollector(Collector):
    """Capacity, a rate limit's window, permits in use, waiters,
    the longest wait, parked tasks and the oldest of them, of every semaphore (a family's members
    together, see ``series``); waiters per share key; and whether the database answered."""

    def describe(self) -> Iterable[Metric]:
        # What register() reads instead of calling collect(): no query at start-up.
        return self._families()

    def collect(self) -> Iterable[Metric]:
        *per_semaphore, per_share, up = families = self._families()
        alias = routing.current_alias()
        try:
            rows = list(
                with_parked(Semaphore.objects.db_manager(alias).with_usage())
                .order_by()
                .values(*series.COLUMNS)
            )
            shared = list(Ticket.objects.db_manager(alias).live().per_share("semaphore__name"))
        except Error:
            logger.warning("Metrics: could not read the semaphores' usage.", exc_info=True)
            up.add_metric([], 0)
            return [up]
        up.add_metric([], 1)
        gauges = series.gauges_by_label(rows)
        for label in sorted(gauges):
            for (figure, _, _), family in zip(GAUGES, per_semaphore, strict=True):
                family.add_metric([label], getattr(gauges[label], figure))
        waiters: Counter[tuple[str, str]] = Counter()
        for name, share, n in shared:
            waiters[series.event_label(name), series.share_label(share)] += n
        for labels, n in sorted(waiters.items()):
            per_share.add_metric(list(labels), n)
        return families

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            *(GaugeMetricFamily(name, text, labels=["semaphore"]) for _, name, text in GAUGES),
            GaugeMetricFamily(
                "django_semaphore_waiters_per_share",
                "Waiters queued (live tickets) with a share key, by key: a key SHARE_WEIGHTS "
                "names, any other as 'other'.",
                labels=["semaphore", "share"],
            ),
            GaugeMetricFamily(
                "django_semaphore_database_up",
                "1 if this scrape could read the semaphores from the database, else 0.",
            ),
        ]


@functools.cache
def register_in_default_registry() -> SemaphoreCollector:
    """Once per process: the default registry is what a single-process
    exposition (or the project's own) serves."""
    collector = SemaphoreCollector()
    REGISTRY.register(collector)
    return collector
