"""What a release ships, checked as PyPI and a new user would see it.

The wheel and sdist are built from this checkout, checked with ``twine check``
and ``check-wheel-contents``, and the wheel is installed alone into a fresh
virtualenv and used there from a directory outside the checkout: so a
template, migration or static file that the source tree has but the wheel
lacks fails here, not after the upload. The docs site is built with warnings
as errors. Marked ``once``: none of this depends on the database under test.
"""

from __future__ import annotations

import email.parser
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.once, pytest.mark.timeout(600)]

# Run inside the fresh virtualenv: migrate, one acquire and release, the
# admin's semaphore page (the app's own template), a clean system check.
SMOKE = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import django
    from django.conf import settings

    settings.configure(
        DEBUG=True,
        SECRET_KEY="smoke",
        ALLOWED_HOSTS=["testserver"],
        USE_TZ=True,
        DATABASES={"default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(Path.cwd() / "smoke.sqlite3"),
            "OPTIONS": {"transaction_mode": "IMMEDIATE"},
        }},
        INSTALLED_APPS=[
            "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
            "django.contrib.sessions", "django.contrib.messages", "django_semaphore",
        ],
        MIDDLEWARE=[
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
            "django.contrib.messages.middleware.MessageMiddleware",
        ],
        TEMPLATES=[{
            "BACKEND": "django.template.backends.django.DjangoTemplates",
            "APP_DIRS": True,
            "OPTIONS": {"context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]},
        }],
        ROOT_URLCONF="smoke_urls",
        STATIC_URL="static/",
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        DJANGO_SEMAPHORE={"SEMAPHORES": {"smoke": 1}},
    )
    django.setup()

    import django_semaphore
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.test import Client
    from django_semaphore import ReleaseOutcome, acquire, release
    from django_semaphore.models import Semaphore

    assert "site-packages" in django_semaphore.__file__, django_semaphore.__file__
    call_command("migrate", verbosity=0)
    call_command("makemigrations", "django_semaphore", "--check", "--dry-run", verbosity=0)
    call_command("check", fail_level="WARNING")
    grant = acquire("smoke", external_id="smoke-1", ttl=60)
    assert grant.token("smoke") >= 1
    assert release("smoke-1") is ReleaseOutcome.RELEASED
    assert release("smoke-1") is ReleaseOutcome.ALREADY_RELEASED

    client = Client()
    client.force_login(get_user_model().objects.create_superuser("admin", "a@b.c", "pw"))
    page = client.get(f"/admin/django_semaphore/semaphore/{Semaphore.objects.get().pk}/change/")
    assert page.status_code == 200, page.status_code
    assert b"Capacity history" in page.content
    print("smoke: ok")
    """
)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist, and the wheel built from that sdist (what ``python -m build`` does)."""
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--outdir", out, REPO)
    return out


def run(*command: str | Path, cwd: Path | None = None) -> str:
    """Run `command`, failing the test with its output when it fails."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "DJANGO_SETTINGS_MODULE"}}
    result = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def only(dist: Path, pattern: str) -> Path:
    (found,) = dist.glob(pattern)
    return found


def test_wheel_and_sdist_pass_the_index_checks(dist: Path) -> None:
    files = [only(dist, "*.whl"), only(dist, "*.tar.gz")]
    run(sys.executable, "-m", "twine", "check", "--strict", *files)
    run(sys.executable, "-m", "check_wheel_contents", "--config", REPO / "pyproject.toml", files[0])


def test_wheel_ships_every_file_of_the_package(dist: Path) -> None:
    tracked = run("git", "ls-files", "django_semaphore", cwd=REPO).split()
    with zipfile.ZipFile(only(dist, "*.whl")) as wheel:
        shipped = set(wheel.namelist())
    assert tracked
    assert sorted(set(tracked) - shipped) == []


def test_version_is_the_changelogs_latest_release(dist: Path) -> None:
    with zipfile.ZipFile(only(dist, "*.whl")) as wheel:
        (metadata,) = (name for name in wheel.namelist() if name.endswith(".dist-info/METADATA"))
        headers = email.parser.Parser().parsestr(wheel.read(metadata).decode())
    changelog = (REPO / "CHANGELOG.md").read_text()
    latest = re.search(r"^## \[(\d[^\]]*)\]", changelog, re.MULTILINE)
    assert latest is not None
    assert headers["Version"] == latest.group(1)


def test_wheel_installs_alone_and_works(dist: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    run(venv / "bin" / "python", "-m", "pip", "install", "-q", only(dist, "*.whl"))
    project = tmp_path / "project"  # not the checkout: only the wheel is importable
    project.mkdir()
    (project / "smoke_urls.py").write_text(
        "from django.contrib import admin\nfrom django.urls import path\n"
        "urlpatterns = [path('admin/', admin.site.urls)]\n"
    )
    (project / "smoke.py").write_text(SMOKE)
    assert "smoke: ok" in run(venv / "bin" / "python", "smoke.py", cwd=project)


def test_docs_site_builds_without_warnings(tmp_path: Path) -> None:
    run(sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", tmp_path, cwd=REPO)
    assert (tmp_path / "reference" / "index.html").exists()
