"""Settings of the example project, read from the environment (django-environ).

DATABASE_URL       default: SQLite in the project folder (immediate transactions)
CELERY_BROKER_URL  default: kombu's filesystem transport, no server needed
SECRET_KEY, DEBUG, ALLOWED_HOSTS
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import environ

from django_semaphore.beat import beat_schedule

BASE_DIR = Path(__file__).resolve().parent
RUNTIME_DIR = BASE_DIR.parent / ".runtime" / "example"

env = environ.Env(DEBUG=(bool, True))

SECRET_KEY = env("SECRET_KEY", default="example-project-not-secret")
DEBUG = env("DEBUG")
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_semaphore",
    # Prometheus metrics; scripts/demo sets PROMETHEUS_MULTIPROC_DIR so the
    # view also counts what the Celery worker's processes did.
    "django_semaphore.metrics",
    "example_project.demo",
    # Django's own tasks, on the database backend; scripts/demo starts its worker.
    "django_tasks_db",
]
if find_spec("django.tasks") is None:  # before Django 6: the backport
    INSTALLED_APPS.append("django_tasks")
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
ROOT_URLCONF = "example_project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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
WSGI_APPLICATION = "example_project.wsgi.application"

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Concurrent acquirers then queue for the write lock instead of failing.
    DATABASES["default"]["OPTIONS"] = {"transaction_mode": "IMMEDIATE", "timeout": 20}

USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DJANGO_SEMAPHORE = {
    # "export:customer:*" is a family: one semaphore per customer, capacity 2,
    # created on the customer's first export (see docs/families.md).
    # "mirror-syncs" is a rate limit: at most 5 mirror syncs started in any
    # minute, however short each one is (see docs/rates.md).
    # "bulk-exports": one at a time, the customers waiting taking turns
    # (share keys, see docs/shares.md and manage.py demo_shares).
    "SEMAPHORES": {
        "exports": 3,
        "backups": 1,
        "network": 2,
        "reports": 2,
        "search-index": 1,
        "thumbnails": 2,
        "mirror-syncs": {"rate": "5/m"},
        "export:customer:*": 2,
        "bulk-exports": 1,
    },
    # The demo's idle customers are deleted by the clean-up after 10 minutes.
    "MEMBER_IDLE_LIMIT": 600,
}

# "localhost": the filesystem transport ignores it, but kombu warns on every
# connection when a URL names no host.
_FILESYSTEM_BROKER = "filesystem://localhost//"
CELERY_BROKER_URL = env("CELERY_BROKER_URL", default=_FILESYSTEM_BROKER)
if CELERY_BROKER_URL == _FILESYSTEM_BROKER:
    # Kombu's filesystem transport, its messages written whole (broker.py).
    CELERY_BROKER_TRANSPORT = "example_project.broker:Transport"
    _queue = RUNTIME_DIR / "broker"
    for _folder in ("processed", "control"):
        (_queue / _folder).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_queue),
        "data_folder_out": str(_queue),
        "processed_folder": str(_queue / "processed"),
        "control_folder": str(_queue / "control"),  # broadcasts; default: ./control
    }
# The app's maintenance sweeps; the demo reclaims orphans every 30 s so that
# permits of killed processes visibly come back.
CELERY_BEAT_SCHEDULE = beat_schedule(release_orphans=30, wake_parked=30)
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Keep a worker's database connection for 100 tasks instead of opening one
# per task (docs/operations.md, "Celery workers and their connections").
CELERY_DB_REUSE_MAX = 100
