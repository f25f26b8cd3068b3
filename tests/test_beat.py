"""The beat schedule: its data, and a real ``celery beat`` + worker running it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery.schedules import crontab
from django.db import connection
from django.db.models import DurationField, Value

from django_semaphore import acquire, release
from django_semaphore import tasks as maintenance_tasks
from django_semaphore.backends import DatabaseNow
from django_semaphore.beat import BEAT_SCHEDULE, beat_schedule
from django_semaphore.models import PermitRequest, Semaphore
from django_semaphore.states import ReleaseReason, State
from tests.celery_app import app
from tests.celery_worker import celery_process
from tests.conftest import unique


def test_default_schedule_runs_the_four_tasks_every_5_min_4_h_24_h_and_1_min():
    assert {name: entry["schedule"] for name, entry in BEAT_SCHEDULE.items()} == {
        "django_semaphore.release_orphans": timedelta(minutes=5),
        "django_semaphore.clean_released": timedelta(hours=4),
        "django_semaphore.clean_history": timedelta(hours=24),
        "django_semaphore.wake_parked": timedelta(minutes=1),
    }
    for name, entry in BEAT_SCHEDULE.items():
        assert entry["task"] == name
        assert getattr(maintenance_tasks, name.partition(".")[2]).name == name
        assert app.tasks[name].ignore_result
        # A run stuck in the queue for a whole interval is dropped, not piled up.
        assert entry["options"] == {"expires": entry["schedule"].total_seconds()}


def test_schedule_intervals_queue_and_omissions_are_configurable():
    nightly = crontab(hour=3, minute=0)
    schedule = beat_schedule(
        release_orphans=60,
        clean_released=nightly,
        clean_history=None,
        wake_parked=None,
        queue="maintenance",
    )
    assert set(schedule) == {"django_semaphore.release_orphans", "django_semaphore.clean_released"}
    orphans = schedule["django_semaphore.release_orphans"]
    assert orphans["schedule"] == timedelta(seconds=60)
    assert orphans["options"] == {"expires": 60.0, "queue": "maintenance"}
    assert schedule["django_semaphore.clean_released"]["schedule"] is nightly
    assert schedule["django_semaphore.clean_released"]["options"] == {"queue": "maintenance"}
    # Fresh data on every call: merging and editing one never changes another.
    assert beat_schedule() == BEAT_SCHEDULE
    assert beat_schedule() is not beat_schedule()


def test_beat_module_imports_in_a_settings_file():
    """No settings configured yet, and Celery is not imported."""
    code = (
        "import sys, django_semaphore.beat as beat;"
        "print(len(beat.BEAT_SCHEDULE), 'celery' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={}, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["4", "False"]


# --- a real beat -------------------------------------------------------------------


@pytest.fixture
def celery_beat(celery_worker: Any, tmp_path: Path) -> Iterator[Path]:
    """``celery beat`` with the maintenance schedule every 2 s (tests.settings),
    sending to the test worker's queue."""
    log = tmp_path / "beat.log"
    arguments = ["beat", f"--schedule={tmp_path / 'beat-schedule'}", "--max-interval=1"]
    with celery_process(
        [*arguments, "--loglevel=INFO"],
        test_database=str(connection.settings_dict["NAME"]),
        queue=celery_worker.queue,
        log=log,
        SEMAPHORE_TEST_BEAT="1",
    ):
        yield log


def days_ago(days: float) -> Any:
    return DatabaseNow() - Value(timedelta(days=days), DurationField())


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_beat_releases_expired_and_stale_requests_and_cleans_up(celery_worker, celery_beat):
    sem = Semaphore.objects.create(name=unique(), capacity=4)
    expired = acquire(sem.name, external_id=unique(), ttl=3600)
    stale = acquire(sem.name, external_id=unique())
    healthy = acquire(sem.name, external_id=unique(), ttl=3600)
    old = acquire(sem.name, external_id=unique())
    release(old.external_id)
    PermitRequest.objects.filter(pk=expired.pk).update(expires_at=days_ago(1 / 86400))
    PermitRequest.objects.filter(pk=stale.pk).update(created_at=days_ago(2))
    PermitRequest.objects.filter(pk=old.pk).update(released_at=days_ago(8))

    deadline = time.monotonic() + 60
    while PermitRequest.objects.filter(pk__in=[expired.pk, stale.pk], state=State.ACQUIRED) or (
        PermitRequest.objects.filter(pk=old.pk).exists()
    ):
        assert time.monotonic() < deadline, (
            celery_beat.read_text(errors="replace")[-3000:] + celery_worker.log_tail()
        )
        time.sleep(0.25)

    expired.refresh_from_db()
    stale.refresh_from_db()
    healthy.refresh_from_db()
    assert (expired.state, expired.release_reason) == (State.RELEASED, ReleaseReason.EXPIRED)
    assert (stale.state, stale.release_reason) == (State.RELEASED, ReleaseReason.STALE)
    assert healthy.state == State.ACQUIRED
    beat_log = celery_beat.read_text(errors="replace")
    assert "Sending due task django_semaphore.release_orphans" in beat_log
