"""Answering a scrape: prometheus_client's Django view on the right registry."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponseBase
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.django import PrometheusDjangoView
from prometheus_client.multiprocess import MultiProcessCollector

from django_semaphore.metrics.collector import SemaphoreCollector


def respond(request: HttpRequest) -> HttpResponseBase:
    return PrometheusDjangoView.as_view(registry=scraped_registry())(request)


def scraped_registry() -> CollectorRegistry:
    """Single process: the default registry, where the app registered the
    semaphores' collector. Multiprocess mode: every process's counters from
    ``PROMETHEUS_MULTIPROC_DIR``, plus the semaphores' gauges, which come from
    the database and so must not be summed across processes."""
    if not PrometheusDjangoView.multiprocess_mode:
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    registry.register(SemaphoreCollector())
    return registry
