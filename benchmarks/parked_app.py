"""The Celery app and tasks of ``python -m benchmarks.parked``: one task that
parks when refused, one that retries as ``@holds_permit`` tasks do by default;
and the tenants' export task of ``python -m benchmarks.tenants``.

Both the driver and the worker import it. What they do is counted in Redis,
so the driver reads the worker's figures without a result backend: every
message published (``before_task_publish``, in every process), every run's
start and end (wall clock: one machine), every failure.
"""

from __future__ import annotations

import os
import time
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.settings")
django.setup()

import redis  # noqa: E402
from celery import Celery  # noqa: E402
from celery.signals import before_task_publish, task_failure  # noqa: E402

from django_semaphore import holds_permit  # noqa: E402

NAME = "bench-parked"
PUBLISHED, RUNS, FAILED = "bench-parked:published", "bench-parked:runs", "bench-parked:failed"
HOLD = float(os.environ.get("BENCH_HOLD", "0.02"))

app = Celery("bench_parked", broker=os.environ["BENCH_REDIS_URL"])
app.conf.update(
    task_ignore_result=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("BENCH_QUEUE", "bench-parked"),
)
counts = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])


def _run(task_id: str) -> None:
    started = time.time()
    time.sleep(HOLD)
    counts.rpush(RUNS, f"{started} {time.time()} {task_id}")


@app.task(bind=True)
@holds_permit(NAME, park=True)
def parked(self: Any) -> None:
    _run(self.request.id)


# Celery's default max_retries (3): what a project gets without choosing.
@app.task(bind=True)
@holds_permit(NAME, park=False)
def retried(self: Any) -> None:
    _run(self.request.id)


@app.task(bind=True)
def unlimited(self: Any) -> None:
    """No semaphore: run by a worker of ``capacity`` processes, what this
    machine's worker can do at that concurrency (the practical ideal)."""
    _run(self.request.id)


# --- tenants (``python -m benchmarks.tenants``) ----------------------------------

EXPORTS = "bench-exports"
STARTS = "bench-tenants:starts"


def tenant_demand(tenant: str, enqueued: float) -> dict[str, int]:
    """The shared semaphore and the tenant's own cap."""
    return {EXPORTS: 1, f"bench-export:customer:{tenant}": 1}


@app.task(bind=True)
@holds_permit(tenant_demand, park=True)
def export(self: Any, tenant: str, enqueued: float) -> None:
    """Records the delay from its enqueueing to its start (one machine)."""
    counts.rpush(STARTS, f"{tenant} {time.time() - enqueued}")
    time.sleep(HOLD)


@before_task_publish.connect
def _count_publish(**kwargs: Any) -> None:
    counts.incr(PUBLISHED)


@task_failure.connect
def _count_failure(**kwargs: Any) -> None:
    counts.incr(FAILED)
