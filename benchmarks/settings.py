"""Django settings for the benchmark's client processes and its driver.

The database comes from ``BENCH_DATABASE_URL`` (set by ``python -m benchmarks``).
"""

from __future__ import annotations

import importlib.util
import os

import environ

from benchmarks import db

SECRET_KEY = "benchmark-only"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {"default": environ.Env.db_url_config(os.environ["BENCH_DATABASE_URL"])}
_default = DATABASES["default"]
if _default["ENGINE"] == "django.db.backends.sqlite3":
    _default["OPTIONS"] = {"transaction_mode": "IMMEDIATE", "timeout": 20}
elif _default["ENGINE"] == "django.db.backends.mysql":
    _default["OPTIONS"] = {"charset": "utf8mb4"}
elif _default["ENGINE"] == "django.db.backends.postgresql" and os.environ.get("BENCH_PREPARED"):
    # PostgreSQL as the seed's psycopg clients run: parameters bound by the
    # server, statements prepared after a few runs (python -m benchmarks --prepared).
    _default["OPTIONS"] = {"server_side_binding": True, "prepare_threshold": 5}
if _default["ENGINE"] == "django.db.backends.postgresql" and db.postgres_options():
    # --fast-commit / --durable: synchronous_commit for this session, as the raw clients'.
    _default.setdefault("OPTIONS", {})["options"] = db.postgres_options()

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django_semaphore",
]
# django-db-mutex is a peer, measured only where it is installed (the bench extra).
if importlib.util.find_spec("db_mutex") is not None:
    INSTALLED_APPS.append("db_mutex")

DJANGO_SEMAPHORE: dict[str, object] = {}
if os.environ.get("BENCH_RETRY_ATTEMPTS"):
    # python -m benchmarks.galera: more retries for clients spread over the nodes.
    DJANGO_SEMAPHORE["RETRY_ATTEMPTS"] = int(os.environ["BENCH_RETRY_ATTEMPTS"])
if os.environ.get("BENCH_FAMILY"):
    # python -m benchmarks.parked: the family of the stand-by figure, capacity 1.
    DJANGO_SEMAPHORE["SEMAPHORES"] = {os.environ["BENCH_FAMILY"]: 1}
if os.environ.get("BENCH_CLEANUP_BATCH"):
    # Scenario 6 with another clean-up batch size (python -m benchmarks --cleanup-batch).
    DJANGO_SEMAPHORE["CLEANUP_BATCH_SIZE"] = int(os.environ["BENCH_CLEANUP_BATCH"])
if os.environ.get("BENCH_DJANGO_TASKS"):
    # python -m benchmarks.own_tasks: Django's own tasks on django-tasks-db's
    # database backend (the backport's framework on Django 5.2).
    if importlib.util.find_spec("django.tasks") is None:
        INSTALLED_APPS.append("django_tasks")
    INSTALLED_APPS.append("django_tasks_db")
    TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
    # No Celery beat here (Celery is installed): each worker would warn.
    SILENCED_SYSTEM_CHECKS = ["django_semaphore.W020"]
if os.environ.get("BENCH_ADMIN"):
    # python -m benchmarks.why: the admin's pages, through Django's test client.
    INSTALLED_APPS[:0] = ["django.contrib.admin"]
    INSTALLED_APPS += ["django.contrib.sessions", "django.contrib.messages"]
    MIDDLEWARE = [
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "django.contrib.messages.middleware.MessageMiddleware",
    ]
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
    ROOT_URLCONF = "benchmarks.why"
    SILENCED_SYSTEM_CHECKS = ["django_semaphore.W002"]  # SQLite outside DEBUG
