"""The Celery beat schedule of the maintenance tasks, as plain data.

Merge it into the project's schedule::

    # settings.py
    from django_semaphore.beat import BEAT_SCHEDULE
    CELERY_BEAT_SCHEDULE = {**BEAT_SCHEDULE, ...}

or choose other intervals (seconds, a ``timedelta`` or a Celery ``crontab``;
``None`` leaves a task out)::

    from django_semaphore.beat import beat_schedule
    CELERY_BEAT_SCHEDULE = beat_schedule(release_orphans=60, clean_history=None)

Importing this module touches neither Django settings nor Celery, so it is
safe in a settings file; ``scheduled_tasks`` reads the project's schedule
when the system check asks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django_semaphore.exceptions import InvalidRequest

RELEASE_ORPHANS = "django_semaphore.release_orphans"
"""Task name (and schedule key) of the orphan sweep, ``tasks.release_orphans``."""
CLEAN_RELEASED = "django_semaphore.clean_released"
"""Task name (and schedule key) of ``tasks.clean_released``."""
CLEAN_HISTORY = "django_semaphore.clean_history"
"""Task name (and schedule key) of ``tasks.clean_history``."""
WAKE_PARKED = "django_semaphore.wake_parked"
"""Task name (and schedule key) of ``tasks.wake_parked``, the parked tasks' backstop."""

DEFAULT_INTERVALS: dict[str, timedelta] = {
    RELEASE_ORPHANS: timedelta(minutes=5),
    CLEAN_RELEASED: timedelta(hours=4),
    CLEAN_HISTORY: timedelta(hours=24),
    # Only does work while tasks are parked (two indexed reads otherwise).
    WAKE_PARKED: timedelta(minutes=1),
}
"""How often each task runs unless told otherwise (SPEC §3's defaults)."""


def beat_schedule(
    *,
    release_orphans: Any = DEFAULT_INTERVALS[RELEASE_ORPHANS],
    clean_released: Any = DEFAULT_INTERVALS[CLEAN_RELEASED],
    clean_history: Any = DEFAULT_INTERVALS[CLEAN_HISTORY],
    wake_parked: Any = DEFAULT_INTERVALS[WAKE_PARKED],
    queue: str | None = None,
) -> dict[str, dict[str, Any]]:
    """A fresh beat schedule with these intervals.

    Each interval is seconds, a ``timedelta`` or a Celery ``crontab``;
    ``None`` leaves that task out.

    Args:
        release_orphans: how often the orphan sweep runs.
        clean_released: how often old released requests are deleted.
        clean_history: how often old capacity history is deleted.
        wake_parked: how often parked tasks are checked (releases made where
            parking is not enabled, publishes that failed or were lost).
        queue: route the tasks to this queue (default: the default queue).

    Returns:
        Entries keyed ``"django_semaphore.<task>"``, ready for
        ``CELERY_BEAT_SCHEDULE`` / ``app.conf.beat_schedule``.

    Raises:
        InvalidRequest: an interval that is not positive seconds, a
            ``timedelta`` or a Celery schedule, or a queue that is not a name
            (refused here, in the settings file, not when beat starts).
    """
    if queue is not None and (not isinstance(queue, str) or not queue.strip()):
        raise InvalidRequest(f"queue must be a queue's name or None, not {queue!r}.")
    schedule: dict[str, dict[str, Any]] = {}
    for task, every in (
        (RELEASE_ORPHANS, release_orphans),
        (CLEAN_RELEASED, clean_released),
        (CLEAN_HISTORY, clean_history),
        (WAKE_PARKED, wake_parked),
    ):
        if every is None:
            continue
        every = _interval(task, every)
        options: dict[str, Any] = {}
        if isinstance(every, timedelta):
            # A run that waited a whole interval in the queue is superseded by
            # the next one: drop it rather than let runs pile up.
            options["expires"] = every.total_seconds()
        if queue is not None:
            options["queue"] = queue
        schedule[task] = {"task": task, "schedule": every, "options": options}
    return schedule


def _interval(task: str, every: Any) -> Any:
    """``every`` as beat takes it: a positive ``timedelta``, or a Celery
    schedule (``crontab``, ``solar``: anything with ``is_due``)."""
    interval = every
    if isinstance(every, int | float) and not isinstance(every, bool):
        # NaN, infinity and beyond timedelta's range are refused below.
        with contextlib.suppress(OverflowError, ValueError):
            interval = timedelta(seconds=every)
    if (isinstance(interval, timedelta) and interval > timedelta(0)) or hasattr(interval, "is_due"):
        return interval
    raise InvalidRequest(
        f"{task.rpartition('.')[2]} must be positive seconds, a timedelta or a Celery "
        f"schedule, or None, not {every!r}."
    )


BEAT_SCHEDULE: dict[str, dict[str, Any]] = beat_schedule()
"""The schedule with the default intervals, to merge into ``CELERY_BEAT_SCHEDULE``."""


def scheduled_tasks() -> set[str] | None:
    """The task names of the project's beat schedule: ``CELERY_BEAT_SCHEDULE``
    and the current Celery app's ``beat_schedule`` (an app configured in code,
    or from ``celeryconfig``); ``None`` when Celery is not installed."""
    # Imported here: settings files import this module, and Celery is optional.
    from django.conf import settings

    try:
        from celery import current_app
    except ImportError:
        return None
    schedules = [getattr(settings, "CELERY_BEAT_SCHEDULE", None), current_app.conf.beat_schedule]
    return {
        str(entry.get("task"))
        for schedule in schedules
        if isinstance(schedule, Mapping)
        for entry in schedule.values()
        if isinstance(entry, Mapping)
    }
