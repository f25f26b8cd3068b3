"""The Celery app and tasks of ``python -m benchmarks.parked``: one task with
the library's defaults (it parks when refused), one that retries
(``park=False``), one whose line is capped (``max_waiting``), one sent
under ``on_conflict="discard"``, one per member of a family; and the tenants' export task
of ``python -m benchmarks.tenants``.

Both the driver and the worker import it. What they do is counted in Redis,
so the driver reads the worker's figures without a result backend: every
message published (``before_task_publish``, in every process), every run's
start and end (wall clock: one machine), every failure, and every stand-by
wait, by worker process.
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

from django_semaphore import PermitTask, holds_permit  # noqa: E402
from django_semaphore.exceptions import LineFull  # noqa: E402
from django_semaphore.waiting import standby  # noqa: E402

NAME = "bench-parked"
FAMILY = os.environ["BENCH_FAMILY"]  # declared by benchmarks.settings, capacity 1
PUBLISHED, RUNS, FAILED = "bench-parked:published", "bench-parked:runs", "bench-parked:failed"
STANDBYS = "bench-parked:standbys"  # worker pid -> stand-by waits
HOLD = float(os.environ.get("BENCH_HOLD", "0.02"))
MAX_WAITING = int(os.environ.get("BENCH_MAX_WAITING", "10"))
LINE_FULL = "bench-parked:line-full"  # failures that were LineFull refusals

app = Celery("bench_parked", broker=os.environ["BENCH_REDIS_URL"])
app.conf.update(
    task_ignore_result=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("BENCH_QUEUE", "bench-parked"),
)
if os.environ.get("BENCH_DB_REUSE_MAX"):
    # The worker's Django fix-up closes the connection every 2 x so many
    # task starts and ends, instead of around every task.
    app.conf["CELERY_DB_REUSE_MAX"] = int(os.environ["BENCH_DB_REUSE_MAX"])
counts = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])


def _run(task_id: str) -> None:
    started = time.time()
    time.sleep(HOLD)
    counts.rpush(RUNS, f"{started} {time.time()} {task_id}")


# No park=, no PARK_TASKS, Celery's default max_retries (3): what a
# project gets without choosing.
@app.task(bind=True)
@holds_permit(NAME)
def default(self: Any) -> None:
    _run(self.request.id)


@app.task(bind=True)
@holds_permit(NAME, park=False)
def retried(self: Any) -> None:
    _run(self.request.id)


@app.task(bind=True)
@holds_permit(NAME, max_waiting=MAX_WAITING)
def capped(self: Any) -> None:
    """At most ``MAX_WAITING`` wait parked; the rest fail with ``LineFull``."""
    _run(self.request.id)


@app.task(bind=True, base=PermitTask)
@holds_permit(NAME, on_conflict="discard")
def once(self: Any, hold: float) -> None:
    """One at a time: sent while another is sent, waits or runs, it is
    discarded (the sender is told that one's id)."""
    started = time.time()
    time.sleep(hold)
    counts.rpush(RUNS, f"{started} {time.time()} {self.request.id}")


@app.task(bind=True)
@holds_permit(lambda member: FAMILY.replace("*", member))
def family(self: Any, member: str) -> None:
    _run(self.request.id)


def _counted_stand_by(task_id: str, demand: Any, claim: Any) -> str | None:
    """``standby.stand_by``, counting the calls that waited: with nothing
    released, a wait lasts ``STANDBY_WAIT`` (2 s); a call that parks at once
    (the holds known long, or tasks parked first) takes milliseconds."""
    started = time.monotonic()
    key = _stand_by(task_id, demand, claim)
    if time.monotonic() - started >= standby.STANDBY_WAIT / 2:
        counts.hincrby(STANDBYS, str(os.getpid()), 1)
    return key


_stand_by = standby.stand_by
standby.stand_by = _counted_stand_by


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
    """Records when it was enqueued and when it started (one machine)."""
    counts.rpush(STARTS, f"{tenant} {enqueued} {time.time()}")
    time.sleep(HOLD)


@app.task(bind=True, base=PermitTask)
@holds_permit(tenant_demand, max_waiting=100_000)
def export_when_sent(self: Any, tenant: str, enqueued: float) -> None:
    """``export``, parked as it is sent when it has no room (a send policy,
    ``max_waiting``, makes ``PermitTask`` decide then): it waits in the
    semaphores' line, not in the broker's queue."""
    counts.rpush(STARTS, f"{tenant} {enqueued} {time.time()}")
    time.sleep(HOLD)


@app.task(bind=True, base=PermitTask)
@holds_permit(tenant_demand, max_waiting=100_000, share=lambda tenant, enqueued: tenant)
def export_shared(self: Any, tenant: str, enqueued: float) -> None:
    """``export_when_sent``, the tenant its share key on the shared semaphore."""
    counts.rpush(STARTS, f"{tenant} {enqueued} {time.time()}")
    time.sleep(HOLD)


@before_task_publish.connect
def _count_publish(**kwargs: Any) -> None:
    counts.incr(PUBLISHED)


@task_failure.connect
def _count_failure(exception: BaseException | None = None, **kwargs: Any) -> None:
    counts.incr(FAILED)
    if isinstance(exception, LineFull):
        counts.incr(LINE_FULL)
