"""The metrics app's system check: ``prometheus_client`` must be installed."""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from django.core.checks import CheckMessage, Error, Tags, register

INSTALL_HINT = (
    'pip install "django-semaphore[metrics]" (or prometheus_client>=0.24). See docs/metrics.md.'
)


def prometheus_client_installed() -> bool:
    return find_spec("prometheus_client") is not None


@register(Tags.compatibility)
def check_prometheus_client(**kwargs: Any) -> list[CheckMessage]:
    if prometheus_client_installed():
        return []
    return [
        Error(
            "django_semaphore.metrics is installed but prometheus_client is not: "
            "nothing is counted and the metrics view cannot answer.",
            hint=INSTALL_HINT,
            id="django_semaphore_metrics.E001",
        )
    ]
