"""Test settings: one database chosen by ``DATABASE_URL`` (SQLite by default).

The test command runs the suite once per database: SQLite, MariaDB, PostgreSQL.
"""

from __future__ import annotations

import uuid
from importlib.util import find_spec
from pathlib import Path

import environ

from django_semaphore.beat import BEAT_SCHEDULE, beat_schedule

env = environ.Env()

SECRET_KEY = "tests-only"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Under this checkout, so two checkouts' runs never share a database file.
_sqlite_dir = Path(__file__).resolve().parent.parent / ".runtime" / "tests"
_sqlite_dir.mkdir(parents=True, exist_ok=True)

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

# A worker started by the tests runs against the test database, not this one.
if _test_database := env("SEMAPHORE_TEST_DATABASE_NAME", default=""):
    _default["NAME"] = _test_database

# The same database under a second alias, on its own connection: lets tests
# give the app "its own alias" (DJANGO_SEMAPHORE["DATABASE"]).
DATABASES["semaphores"] = {**_default, "TEST": {**_default.get("TEST", {}), "MIRROR": "default"}}

# A second, separate database, for semaphores sharded by name over two aliases
# (tests/test_routing.py). Created only when a test asks for it.
_shard_test = {**_default.get("TEST", {})}
if "NAME" in _shard_test:
    _shard_test["NAME"] = f"{_shard_test['NAME']}.shard"
DATABASES["shard"] = {**_default, "NAME": f"{_default['NAME']}_shard", "TEST": _shard_test}

# SQLite beside any server: the differential test runs one history on both
# (tests/test_differential.py). A file of each pass's own (passes run side
# by side); created only when a test asks for it.
_beside = _sqlite_dir / f"beside-{Path(str(_default['NAME'])).name}.sqlite3"
DATABASES["sqlite"] = {
    "ENGINE": "django.db.backends.sqlite3",
    "NAME": str(_beside),
    "TEST": {"NAME": f"{_beside}.test"},
}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_semaphore",
    "django_semaphore.metrics",
    "tests.testapp",
    # Django's own tasks' database and RQ backends, whose workers
    # tests/test_django_tasks.py runs.
    "django_tasks_db",
    "django_rq",
]
# RQ, for Django tasks on the RQ backend: a queue of this test run's own
# (its workers are told its name), so parallel runs never take its jobs.
RQ_QUEUE = env("SEMAPHORE_RQ_QUEUE", default=f"tests-{uuid.uuid4().hex[:8]}")
_redis = {"URL": env("SEMAPHORE_REDIS_URL", default="redis://127.0.0.1:63791/0")}
RQ_QUEUES = {"default": _redis, RQ_QUEUE: _redis}  # django-rq reads results via "default"
# Django's own tasks: django.tasks from Django 6, the django-tasks backport before.
_TASKS = "django.tasks" if find_spec("django.tasks") else "django_tasks"
if _TASKS == "django_tasks":
    INSTALLED_APPS.append("django_tasks")
TASKS = {
    "default": {"BACKEND": f"{_TASKS}.backends.immediate.ImmediateBackend"},
    "database": {"BACKEND": "django_tasks_db.DatabaseBackend"},
    "rq": {"BACKEND": "django_tasks_rq.RQBackend", "QUEUES": [RQ_QUEUE]},
    # The immediate backend with @task(semaphores=...).
    "permits": {"BACKEND": "tests.own_tasks.PermitImmediateBackend"},
    # django-tasks-db's backend, its sends deciding who may wait.
    "permits-database": {"BACKEND": "tests.own_tasks.PermitDatabaseBackend"},
}
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.urls"
STATIC_URL = "static/"
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
# A family too, for the real worker's tasks whose semaphore is computed
# (tests/tasks.py, per_member): created on first use, capacity 1 each.
DJANGO_SEMAPHORE = {"SEMAPHORES": {"declared-in-settings": 4, "celery-family:*": 1}}
# A worker started with a short lease (tests/test_leases.py): a holder it
# loses gives its permits back within seconds.
if _lease := env.int("SEMAPHORE_TEST_LEASE", default=0):
    DJANGO_SEMAPHORE["LEASE"] = _lease
# SQLite outside DEBUG is what the SQLite test pass is for (tests force DEBUG off);
# the RQ backend cannot defer, as the tests of Django's own tasks know; tests
# hold semaphores they create, not the ones settings declare.
# E018: tests/views.py's too_many asks beyond a declared capacity on purpose.
SILENCED_SYSTEM_CHECKS = [
    "django_semaphore.W002",
    "django_semaphore.I001",
    "django_semaphore.W013",
    "django_semaphore.E018",
]

# Celery, for the tests that run a real worker against a real Redis broker.
CELERY_BROKER_URL = env("SEMAPHORE_REDIS_URL", default="redis://127.0.0.1:63791/0")
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
CELERY_TASK_DEFAULT_QUEUE = env("SEMAPHORE_CELERY_QUEUE", default="django-semaphore-tests")
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

# The app's schedule, as a project merges it (check_beat_schedule wants it);
# a beat started by the tests (test_beat) runs the maintenance tasks every 2 s.
CELERY_BEAT_SCHEDULE = (
    beat_schedule(release_orphans=2, clean_released=2, clean_history=2)
    if env("SEMAPHORE_TEST_BEAT", default="")
    else BEAT_SCHEDULE
)
