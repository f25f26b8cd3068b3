"""The Celery app of the redelivery scenario (configured from faults settings)."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.faults.settings")

app = Celery("faults")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.imports = ["benchmarks.faults.tasks"]
