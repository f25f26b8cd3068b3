"""The settings checks speak before anything breaks: malformed settings are
reported by ``check``, never a traceback at start-up; each check id has one
meaning, and every id is documented; REFUSED_VIEW is validated when given."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from django_semaphore import checks, holds_permit
from django_semaphore.conf import DEFAULTS, app_settings
from tests.conftest import static_checks

ROOT = Path(__file__).resolve().parent.parent

START_UP = """
import tests.settings as base
from django.conf import settings
values = {{key: getattr(base, key) for key in dir(base) if key.isupper()}}
settings.configure(**{{**values, "DJANGO_SEMAPHORE": {value}}})
import django
django.setup()
print("started")
from django.core.management import call_command
call_command("check")
"""


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ('"not a dict"', "django_semaphore.E001"),
        ('["PARK_TASKS"]', "django_semaphore.E001"),
        ('{"PARK_TASKS": "yes"}', "django_semaphore.E020"),
        ('{"PARK_TASKS": None}', "django_semaphore.E020"),
        ('{"DATABASE": "nope", "SHARDS": 3}', "django_semaphore.E003"),
        ('{"SEMAPHORES": {"exports": -1}}', "django_semaphore.E009"),
        ('{"REFUSED_VIEW": "no.such.view"}', "django_semaphore.E017"),
    ],
)
def test_malformed_settings_are_reported_by_check_not_at_start_up(value, expected, tmp_path):
    # On SQLite whatever the pass: Django 6's model checks ask a MySQL server
    # its version, on every alias, and the test settings' shard alias names a
    # database that only exists while tests run.
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "",
        "DATABASE_URL": f"sqlite:///{tmp_path}/db.sqlite3",
    }
    result = subprocess.run(
        [sys.executable, "-c", START_UP.format(value=value)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.stdout.strip() == "started", result.stderr  # ready() did not raise
    assert result.returncode != 0
    assert expected in result.stderr
    # Only the check's own SystemCheckError, no other traceback.
    assert result.stderr.count("Traceback") == 1
    assert "SystemCheckError" in result.stderr


@pytest.mark.parametrize(
    "value", ["not a dict", {"PARK_TASKS": "yes"}, {"LEASE": -1, "SEMAPHORES": ["x"]}]
)
def test_ready_goes_on_with_malformed_settings(settings, value):
    from django.apps import apps

    settings.DJANGO_SEMAPHORE = value
    apps.get_app_config("django_semaphore").ready()  # no ImproperlyConfigured

    # The app's own check: Django 6's model checks would ask a MySQL server its version.
    assert [m.id for m in checks.check_settings() if m.id.startswith("django_semaphore.E")]


# --- one id per meaning -------------------------------------------------------------------


def emitted_ids() -> set[str]:
    """Every id checks.py can report."""
    source = (ROOT / "django_semaphore" / "checks.py").read_text()
    literal = set(re.findall(r'id="(django_semaphore\.[EW]\d{3})"', source))
    numbered = {f"django_semaphore.E{n:03d}" for n in (1, 2, *checks.SETTING_IDS.values())}
    repairs = {f"django_semaphore.W{n:03d}" for n, _ in checks.INCONSISTENCIES.values()}
    return literal | numbered | repairs


def test_each_setting_has_its_own_error_id():
    assert set(checks.SETTING_IDS) == set(DEFAULTS)
    ids = [*checks.SETTING_IDS.values(), 1, 2]  # E001 not a dict, E002 an unknown key
    assert len(ids) == len(set(ids))


def test_each_warning_id_is_reported_by_one_place():
    source = (ROOT / "django_semaphore" / "checks.py").read_text()
    written = re.findall(r'id="django_semaphore\.(W\d{3})"', source) + [
        f"W{n:03d}" for n, _ in checks.INCONSISTENCIES.values()
    ]
    # W003 is written twice on purpose, one meaning: the configuration points
    # the app at what looks like a replica (a router sends its writes
    # elsewhere, or its alias is a test mirror).
    assert {id: written.count(id) for id in written if written.count(id) > 1} == {"W003": 2}


def test_every_id_is_in_the_settings_docs_table():
    table = (ROOT / "docs" / "settings.md").read_text()
    documented = set(re.findall(r"^\| `(django_semaphore\.[EW]\d{3})` \|", table, re.MULTILINE))
    assert documented == emitted_ids()


# --- REFUSED_VIEW ---------------------------------------------------------------------------


def page(request, exception):
    return None


NOT_CALLABLE = 3


@pytest.mark.parametrize(
    "value",
    [3, None, "", "nodots", "no.such.module", f"{__name__}.missing", f"{__name__}.NOT_CALLABLE"],
)
def test_a_bad_refused_view_is_e017(settings, value):
    settings.DJANGO_SEMAPHORE = {"REFUSED_VIEW": value}
    assert "django_semaphore.E017" in [m.id for m in checks.check_settings()]


@pytest.mark.parametrize("path", [".", ".view", ".."])
def test_a_path_import_module_refuses_with_other_errors_is_e017_not_a_crash(settings, path):
    """``import_string`` raises ValueError or TypeError, not ImportError, here."""
    settings.DJANGO_SEMAPHORE = {"REFUSED_VIEW": path}
    assert "django_semaphore.E017" in [m.id for m in checks.check_settings()]


def test_a_given_refused_view_is_imported_at_each_read(settings):
    settings.DJANGO_SEMAPHORE = {"REFUSED_VIEW": f"{__name__}.page"}
    assert checks.check_settings() == []
    assert app_settings.REFUSED_VIEW is page


def test_the_default_refused_view_is_not_imported_by_the_check(settings, monkeypatch):
    import django.utils.module_loading as loading

    imported: list[str] = []
    real = loading.import_string
    monkeypatch.setattr(
        "django_semaphore.conf.import_string", lambda path: imported.append(path) or real(path)
    )
    settings.DJANGO_SEMAPHORE = {}

    assert checks.check_settings() == []
    assert imported == []
    assert DEFAULTS["REFUSED_VIEW"] == "django_semaphore.integrations.views.permit_refused"


# --- names given to @holds_permit that nothing declares ------------------------------------


def named_warnings() -> dict[str, Any]:
    """W013 by the name it reports."""
    return {
        re.search(r"names '([^']+)'", m.msg)[1]: m  # type: ignore[index]
        for m in static_checks()
        if m.id == "django_semaphore.W013"
    }


def test_a_typo_is_reported_with_the_closest_declared_name(settings):
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": {"exports": 3, "export:customer:*": 2, "backups": 1}}

    @holds_permit("exprots")
    def export() -> None: ...

    @holds_permit({"export:customer:7": 1, "backups": 1})
    def declared() -> None: ...

    @holds_permit(lambda customer: f"exprot:customer:{customer}")
    def computed(customer: int) -> None: ...

    reported = named_warnings()
    assert reported["exprots"].hint.startswith("Did you mean 'exports'? Fix the name")
    assert not [name for name in reported if name.startswith(("export", "backups", "exprot:"))]


def test_a_count_beyond_the_declared_capacity_is_an_error(settings):
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": {"exports": 3, "export:customer:*": 2}}

    @holds_permit({"exports": 4})
    def too_many() -> None: ...

    @holds_permit({"export:customer:7": 3})
    def too_many_of_a_member() -> None: ...

    @holds_permit({"exports": 3, "export:customer:8": 2})
    def fits() -> None: ...

    errors = [m for m in static_checks() if m.id == "django_semaphore.E018"]
    assert sorted(re.search(r"of '([^']+)'", m.msg)[1] for m in errors) == [  # type: ignore[index]
        "export:customer:7",
        "exports",
    ]


def test_nothing_is_said_where_settings_declare_no_semaphore(settings):
    settings.DJANGO_SEMAPHORE = {}

    @holds_permit("exprots")
    def export() -> None: ...

    assert named_warnings() == {}


CHECK_IN_A_FRESH_PROCESS = """
import {module} as base
from django.conf import settings
values = {{key: getattr(base, key) for key in dir(base) if key.isupper()}}
semaphores = {{**values["DJANGO_SEMAPHORE"]["SEMAPHORES"], **{add}}}
for name in {remove}:
    del semaphores[name]
settings.configure(
    **{{
        **values,
        "DJANGO_SEMAPHORE": {{"SEMAPHORES": semaphores}},
        # tests/views.py's too_many asks beyond a declared capacity on purpose.
        "SILENCED_SYSTEM_CHECKS": ["django_semaphore.E018"],
    }}
)
import django
django.setup()
from django.core.management import call_command
call_command("check")
"""


@pytest.mark.parametrize(
    ("module", "add", "remove", "typo", "closest"),
    [
        # Held by the URLconf's views, which only the check imports here.
        ("tests.settings", {"viewz": 1}, [], "views", "viewz"),
        # Held by an installed app's tasks module, imported as Celery's autodiscovery does.
        ("example_project.settings", {"report": 1}, ["reports"], "reports", "report"),
    ],
)
def test_check_finds_the_names_of_views_and_tasks_as_a_project_runs_it(
    module, add, remove, typo, closest, tmp_path
):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "",
        "DATABASE_URL": f"sqlite:///{tmp_path}/db.sqlite3",
    }
    script = CHECK_IN_A_FRESH_PROCESS.format(module=module, add=add, remove=remove)
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 0, result.stderr
    warning = f"(django_semaphore.W013) @holds_permit names {typo!r}, which SEMAPHORES neither"
    assert warning in result.stderr
    assert f"HINT: Did you mean {closest!r}?" in result.stderr
