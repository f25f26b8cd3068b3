"""Django settings of the fault suite's client processes and Celery worker.

The database and broker come from the environment (set by the runner), so a
fault run never touches the test suite's databases.
"""

from __future__ import annotations

import os

import environ

SECRET_KEY = "faults-only"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {"default": environ.Env.db_url_config(os.environ["FAULTS_DATABASE_URL"])}
DATABASES["default"]["OPTIONS"] = {"charset": "utf8mb4", "connect_timeout": 3}

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django_semaphore",
]

DJANGO_SEMAPHORE = {
    "LOCK_WAIT_TIMEOUT": float(os.environ.get("FAULTS_LOCK_WAIT_TIMEOUT", "2")),
    "RETRY_ATTEMPTS": int(os.environ.get("FAULTS_RETRY_ATTEMPTS", "3")),
    "LIVENESS_CHECKERS": ["benchmarks.faults.history.local_pid_liveness"],
}

CELERY_BROKER_URL = os.environ.get("FAULTS_REDIS_URL", "redis://127.0.0.1:63801/0")
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("FAULTS_CELERY_QUEUE", "faults")
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
