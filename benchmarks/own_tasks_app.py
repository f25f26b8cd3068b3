"""The Django task of ``python -m benchmarks.own_tasks``: it holds one permit
of ``NAME`` for ``BENCH_HOLD`` seconds and returns when it started and
ended (wall clock: one machine), which the driver reads from its result.
Both the driver and the workers import it."""

from __future__ import annotations

import importlib
import os
import time

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.settings")
os.environ.setdefault("BENCH_DJANGO_TASKS", "1")
django.setup()

from django_semaphore import holds_permit  # noqa: E402
from django_semaphore.integrations.django_tasks import frameworks  # noqa: E402

NAME = "bench-own-tasks"
HOLD = float(os.environ.get("BENCH_HOLD", "0.02"))

# django.tasks on Django 6, the backport's on Django 5.2.
task = importlib.import_module(frameworks()[0].__name__).task


@task()
@holds_permit(NAME)
def held() -> list[float]:
    return _run()


@task()
def free() -> list[float]:
    """The same without a semaphore: what the workers do by themselves."""
    return _run()


def _run() -> list[float]:
    started = time.time()
    time.sleep(HOLD)
    return [started, time.time()]
