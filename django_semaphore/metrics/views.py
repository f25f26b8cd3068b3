"""The Prometheus exposition view; mount it with
``path("metrics/", include("django_semaphore.metrics.urls"))``.

It checks nobody: restricting it (staff only, an internal port, a network
policy) is the project's job, see docs/metrics.md.
"""

from __future__ import annotations

from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase

from django_semaphore.metrics.checks import INSTALL_HINT


def metrics(request: HttpRequest) -> HttpResponseBase:
    """This process's metrics (or every process's, in multiprocess mode) and
    the semaphores' gauges, in the format the scraper asks for."""
    if not apps.is_installed("django_semaphore.metrics"):
        raise ImproperlyConfigured(
            'Add "django_semaphore.metrics" to INSTALLED_APPS: without it nothing is counted.'
        )
    try:
        # Imported here so the URLconf loads without it and the app's check
        # can say what is missing.
        from django_semaphore.metrics import exposition
    except ImportError as exc:
        raise ImproperlyConfigured(f"prometheus_client is missing: {INSTALL_HINT}") from exc
    return exposition.respond(request)
