"""Counters and histograms of what happens in this process, fed by signals.

Each process counts its own events: run prometheus_client's multiprocess
mode (``PROMETHEUS_MULTIPROC_DIR``) where several processes serve or acquire
(gunicorn workers, Celery prefork children); see docs/metrics.md. A family's
members are counted in one series unless ``METRICS_PER_MEMBER`` names it
(``series``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import Counter, Histogram

from django_semaphore import signals
from django_semaphore.metrics.series import event_label
from django_semaphore.models import PermitRequest, Semaphore

# Waits run from a fail-fast refusal (milliseconds) to a caller's timeout
# (minutes); holds from a view's response to a nightly job.
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
HOLD_BUCKETS = (0.05, 0.25, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)

GRANTS = Counter(
    "django_semaphore_grants",
    "Requests granted, on each of their semaphores (idempotent repeats are not grants).",
    ["semaphore"],
)
EXHAUSTIONS = Counter(
    "django_semaphore_exhaustions",
    "acquire() calls refused for want of room (after their timeout, if any), "
    "on each semaphore that lacked it.",
    ["semaphore"],
)
RELEASES = Counter(
    "django_semaphore_releases",
    "Permits released, by release_reason; any reason but 'released' is a reclaim.",
    ["semaphore", "reason"],
)
RETRIES = Counter(
    "django_semaphore_retries",
    "Transient database errors retried, by kind (contention, disconnect).",
    ["kind"],
)
COUNTER_DRIFT = Counter(
    "django_semaphore_counter_drift",
    "In-use counters the verifier found differing from the permits they count "
    "(a bug: alert on any increase).",
    ["semaphore"],
)
WAIT = Histogram(
    "django_semaphore_wait_seconds",
    "From an acquire() call to its answer, by outcome (granted, exhausted).",
    ["semaphore", "outcome"],
    buckets=WAIT_BUCKETS,
)
HOLD = Histogram(
    "django_semaphore_hold_seconds",
    "From grant to release of a permit (database clock), by release_reason.",
    ["semaphore", "reason"],
    buckets=HOLD_BUCKETS,
)


def on_permit_acquired(sender: Any, request: PermitRequest, **kwargs: Any) -> None:
    for name in request.fencing_tokens:
        GRANTS.labels(event_label(name)).inc()


def on_acquire_finished(
    sender: Any,
    names: Sequence[str],
    granted: bool,
    lacking: Sequence[str],
    waited: float,
    **kwargs: Any,
) -> None:
    outcome = "granted" if granted else "exhausted"
    for name in names:
        WAIT.labels(event_label(name), outcome).observe(waited)
    for name in lacking:
        EXHAUSTIONS.labels(event_label(name)).inc()


def on_hold_ended(sender: Any, holds: Sequence[signals.Hold], reason: str, **kwargs: Any) -> None:
    for hold in holds:
        label = event_label(hold.semaphore)
        RELEASES.labels(label, reason).inc()
        HOLD.labels(label, reason).observe(hold.seconds)


def on_database_retry(sender: Any, kind: str, **kwargs: Any) -> None:
    RETRIES.labels(kind).inc()


def on_counter_drift(sender: Any, drift: signals.Drift, **kwargs: Any) -> None:
    COUNTER_DRIFT.labels(event_label(drift.semaphore)).inc()


def connect_receivers() -> None:
    """Connect every receiver above (idempotent: each has a ``dispatch_uid``)."""
    for signal, receiver in (
        (signals.permit_acquired, on_permit_acquired),
        (signals.acquire_finished, on_acquire_finished),
        (signals.hold_ended, on_hold_ended),
        (signals.database_retry, on_database_retry),
        (signals.counter_drift, on_counter_drift),
    ):
        signal.connect(
            receiver,
            sender=Semaphore if signal is signals.counter_drift else PermitRequest,
            dispatch_uid=f"django_semaphore.metrics.{receiver.__name__}",
        )
