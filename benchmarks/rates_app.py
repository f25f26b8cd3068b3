"""The Celery app of ``python -m benchmarks.rates``' Celery figure: one task
with Celery's own ``rate_limit`` and no semaphore, which logs its start.

Both the driver and the workers import it; no Django. Each run's start time
(``time.time()``: one machine, one clock) is pushed to a Redis list that the
driver reads after the run, as it reads the app's grants from the database.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

RATE = int(os.environ.get("BENCH_RATE", "200"))
STARTS = os.environ.get("BENCH_STARTS", "bench-rates:starts")

app = Celery("bench_rates", broker=os.environ["BENCH_REDIS_URL"])
app.conf.update(
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("BENCH_QUEUE", "bench-rates"),
)
log = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])


# Celery's limit is a token bucket per worker (each node, whatever its pool).
@app.task(rate_limit=f"{RATE}/s")  # type: ignore[untyped-decorator]  # Celery has no hints
def tick() -> None:
    log.rpush(STARTS, repr(time.time()))
