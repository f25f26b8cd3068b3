"""Test settings: one database chosen by ``DATABASE_URL`` (SQLite by default).

The test command runs the suite once per database: SQLite, MariaDB, PostgreSQL.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import environ

env = environ.Env()

SECRET_KEY = "tests-only"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_sqlite_dir = Path(tempfile.gettempdir()) / "django-semaphore-tests"
_sqlite_dir.mkdir(exist_ok=True)

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{_sqlite_dir}/db.sqlite3")}
_default = DATABASES["default"]
if _default["ENGINE"] == "django.db.backends.sqlite3":
    # A file, not :memory:, so threads and processes share one database; named
    # after the database so two runs with different DATABASE_URLs never collide.
    _default["TEST"] = {"NAME": f"{_default['NAME']}.test"}
    _default["OPTIONS"] = {"transaction_mode": "IMMEDIATE", "timeout": 20}
elif _default["ENGINE"] == "django.db.backends.mysql":
    _default["OPTIONS"] = {"charset": "utf8mb4"}
    _default["TEST"] = {"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"}

# The same database under a second alias, on its own connection: lets tests
# give the app "its own alias" (DJANGO_SEMAPHORE["DATABASE"]).
DATABASES["semaphores"] = {**_default, "TEST": {**_default.get("TEST", {}), "MIRROR": "default"}}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_semaphore",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DJANGO_SEMAPHORE = {"SEMAPHORES": {"declared-in-settings": 4}}
