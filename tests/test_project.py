"""Guards: migrations in step with models, checks clean, import-safe package."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command

from django_semaphore import checks
from tests.conftest import static_checks

REPOSITORY = Path(__file__).resolve().parent.parent


@pytest.mark.django_db
def test_migrations_match_the_models():
    out = StringIO()
    call_command("makemigrations", "django_semaphore", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()


def unsilenced(messages):
    return [message for message in messages if not message.is_silenced()]


def test_system_checks_are_clean():
    assert unsilenced(static_checks()) == []


def test_package_imports_without_configured_settings():
    code = (
        "import django_semaphore, django_semaphore.exceptions, django_semaphore.states;"
        "print(sorted(django_semaphore.__all__))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={}, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "acquire" in result.stdout


def check_ids(settings, value):
    settings.DJANGO_SEMAPHORE = value
    return [message.id for message in static_checks()]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("not a dict", "django_semaphore.E001"),
        ({"LOCK_WAIT": 5}, "django_semaphore.E002"),
        ({"DATABASE": "nope"}, "django_semaphore.E003"),
        ({"LOCK_WAIT_TIMEOUT": 0}, "django_semaphore.E004"),
        ({"PRELOCK_TIMEOUT": "5"}, "django_semaphore.E011"),
        ({"RETRY_ATTEMPTS": 0}, "django_semaphore.E005"),
        ({"CLEANUP_BATCH_SIZE": 2.5}, "django_semaphore.E012"),
        ({"STALENESS_LIMIT": timedelta(0)}, "django_semaphore.E006"),
        ({"RELEASED_RETENTION": "7d"}, "django_semaphore.E013"),
        ({"LIVENESS_CHECKERS": "a.b"}, "django_semaphore.E007"),
        ({"LIVENESS_CHECKERS": ["no.such.Checker"]}, "django_semaphore.E007"),
        ({"VIEW_STATUS_CODE": 200}, "django_semaphore.E008"),
        ({"SEMAPHORES": {"x": -1}}, "django_semaphore.E009"),
        ({"SEMAPHORES": ["x"]}, "django_semaphore.E009"),
    ],
)
def test_bad_settings_are_reported(settings, value, expected):
    assert expected in check_ids(settings, value)


def test_check_hints_point_at_pages_of_the_docs_site(settings):
    """An installed project has no docs/ folder: a hint names the page on
    the docs site, and every page a hint names is one of the site's."""
    settings.DJANGO_SEMAPHORE = {"LOCK_WAIT_TIMEOUT": 0}
    [message] = [m for m in static_checks() if m.id == "django_semaphore.E004"]
    assert message.hint == f"See {checks.SITE}settings/."
    source = Path(checks.__file__).read_text()
    pages = set(re.findall(r"\{SITE\}([\w-]+)/", source))
    assert pages >= {"settings", "clusters", "operations", "maintenance"}
    assert all((REPOSITORY / "docs" / f"{page}.md").exists() for page in pages)
    assert not re.search(r"docs/[\w-]+\.md", source)


def test_good_settings_pass(settings):
    good = {
        "DATABASE": "default",
        "LOCK_WAIT_TIMEOUT": 2.5,
        "RETRY_ATTEMPTS": 5,
        "STALENESS_LIMIT": 3600,
        "HISTORY_RETENTION": timedelta(days=3),
        "LIVENESS_CHECKERS": [],
        "VIEW_STATUS_CODE": 503,
        "SEMAPHORES": {"a": 0, "b": 10},
    }
    settings.DJANGO_SEMAPHORE = good
    assert unsilenced(static_checks()) == []


def test_sqlite_without_immediate_transactions_is_warned(settings, monkeypatch):
    plain = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
    monkeypatch.setitem(settings.DATABASES, "plain", plain)
    settings.DJANGO_SEMAPHORE = {"DATABASE": "plain"}
    assert "django_semaphore.W001" in [m.id for m in static_checks()]


def test_sqlite_outside_debug_is_warned(settings):
    settings.DEBUG = False
    ids = [m.id for m in static_checks()]
    vendor = settings.DATABASES["default"]["ENGINE"]
    assert ("django_semaphore.W002" in ids) == vendor.endswith("sqlite3")


class ElsewhereRouter:
    def db_for_write(self, model, **hints):
        return "semaphores" if model._meta.app_label == "django_semaphore" else None


def test_alias_that_is_not_where_writes_go_is_warned(settings):
    settings.DJANGO_SEMAPHORE = {"DATABASE": "default"}
    settings.DATABASE_ROUTERS = [f"{__name__}.ElsewhereRouter"]
    assert "django_semaphore.W003" in [m.id for m in static_checks()]


def test_mirror_alias_is_warned(settings):
    settings.DJANGO_SEMAPHORE = {"DATABASE": "semaphores"}  # a TEST MIRROR of default
    assert "django_semaphore.W003" in [m.id for m in static_checks()]


@pytest.fixture
def beat_warnings(settings, monkeypatch):
    """The beat check's warnings with this schedule in settings and this one
    in the current Celery app's conf (an app configured in code)."""
    from celery import current_app

    from django_semaphore.checks import check_beat_schedule

    def warnings(in_settings, in_app=None):
        settings.CELERY_BEAT_SCHEDULE = in_settings
        monkeypatch.setitem(current_app.conf, "beat_schedule", in_app or {})
        return check_beat_schedule()

    return warnings


def test_a_beat_schedule_with_the_apps_sweeps_passes(beat_warnings):
    from django_semaphore.beat import BEAT_SCHEDULE, RELEASE_ORPHANS, WAKE_PARKED

    assert beat_warnings(BEAT_SCHEDULE) == []
    assert beat_warnings({}, BEAT_SCHEDULE) == []  # app.conf.beat_schedule, set in code
    # Under keys of the project's own choosing, at its own intervals.
    chosen = {
        "sweep": {"task": RELEASE_ORPHANS, "schedule": 60},
        "parked": {"task": WAKE_PARKED, "schedule": 30},
    }
    assert beat_warnings(chosen) == []


def test_a_beat_schedule_without_the_apps_sweeps_is_warned_with_what_to_add(beat_warnings):
    from django_semaphore.beat import RELEASE_ORPHANS, WAKE_PARKED

    (warning,) = beat_warnings({"other": {"task": "project.tasks.report", "schedule": 60}})

    assert warning.id == "django_semaphore.W020"
    assert RELEASE_ORPHANS in warning.msg
    assert WAKE_PARKED in warning.msg
    assert "BEAT_SCHEDULE" in warning.hint


def test_a_beat_schedule_with_some_of_the_apps_sweeps_names_the_missing(beat_warnings):
    from django_semaphore.beat import CLEAN_HISTORY, RELEASE_ORPHANS, WAKE_PARKED, beat_schedule

    partly = beat_schedule(release_orphans=None, clean_released=None)
    (warning,) = beat_warnings(partly)

    assert RELEASE_ORPHANS in warning.msg
    assert WAKE_PARKED not in warning.msg
    assert CLEAN_HISTORY not in warning.msg
    # Only the clean-ups missing: they bound the tables, nothing waits on them.
    assert beat_warnings(beat_schedule(clean_released=None, clean_history=None)) == []


def test_without_celery_the_beat_schedule_is_not_checked(settings, monkeypatch):
    from django_semaphore.checks import check_beat_schedule

    settings.CELERY_BEAT_SCHEDULE = {}
    monkeypatch.setitem(sys.modules, "celery", None)  # what an import finds without Celery

    assert check_beat_schedule() == []
