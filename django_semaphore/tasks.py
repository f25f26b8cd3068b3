"""Celery tasks for leak recovery and clean-up; thin wrappers over ``sweep``.

Scheduled by the beat entries in :mod:`django_semaphore.beat`. Each returns
nothing (``ignore_result``): what it did is logged on ``django_semaphore``.
Safe to run twice at once (two beat hosts): the sweeps split the work.
"""

from __future__ import annotations

from celery import shared_task

from django_semaphore import sweep
from django_semaphore.parking import wake


@shared_task(name="django_semaphore.release_orphans", ignore_result=True)  # type: ignore[untyped-decorator]
def release_orphans() -> None:
    """Release expired, stale and dead-owner requests; repair half-released
    ones; delete waiters' tickets that expired."""
    sweep.release_orphans()
    sweep.clean_tickets()


@shared_task(name="django_semaphore.clean_released", ignore_result=True)  # type: ignore[untyped-decorator]
def clean_released(time_budget: float | None = sweep.DEFAULT_TIME_BUDGET) -> None:
    """Delete requests released longer ago than ``RELEASED_RETENTION``, and
    family members idle longer than ``MEMBER_IDLE_LIMIT``."""
    sweep.clean_released(time_budget=time_budget)
    sweep.clean_idle_members(time_budget=time_budget)


@shared_task(name="django_semaphore.clean_history", ignore_result=True)  # type: ignore[untyped-decorator]
def clean_history(time_budget: float | None = sweep.DEFAULT_TIME_BUDGET) -> None:
    """Delete capacity history older than ``HISTORY_RETENTION``."""
    sweep.clean_history(time_budget=time_budget)


@shared_task(name="django_semaphore.wake_parked", ignore_result=True)  # type: ignore[untyped-decorator]
def wake_parked() -> None:
    """The backstop of parked tasks' wake-ups: drop expired ones, publish
    again those whose woken run never started, wake what fits."""
    sweep.sweep_parked()


@shared_task(name=wake.WAKE_SLOTS, ignore_result=True)  # type: ignore[untyped-decorator]
def wake_slots(alias: str, semaphore_ids: list[int]) -> None:
    """A rate limit's next slot has ended, or a debounced send's delay
    (published with a countdown by ``wake.schedule_slots``, ``wake.wake_later``):
    wake the parked tasks that fit, and publish a rate limit's next wake-up
    while tasks still wait."""
    wake.wake(alias, semaphore_ids)
    wake.schedule_slots(alias, set(semaphore_ids))
