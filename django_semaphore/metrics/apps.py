from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class MetricsConfig(AppConfig):
    """Opt-in: connects the Prometheus receivers in every process that loads
    the app, Celery workers included, which never import the URLconf."""

    name = "django_semaphore.metrics"
    label = "django_semaphore_metrics"
    verbose_name = _("Semaphore metrics")

    def ready(self) -> None:
        # Imported here, as Django asks: models can be imported only now, and
        # the collector only with prometheus_client installed.
        from django_semaphore.metrics import checks

        if not checks.prometheus_client_installed():
            return  # the check reports it; the project still starts for `manage.py check`
        from django_semaphore.metrics import collector, events

        events.connect_receivers()
        collector.register_in_default_registry()
