"""Spawned clients of the metrics tests. Children unpickle their target by
importing this module before Django is set up: it imports nothing that needs
the app registry."""

from __future__ import annotations

import uuid

from django.db import connections

from django_semaphore import acquire, release
from tests.children import Outbox


def acquire_and_release(name: str, times: int) -> None:
    try:
        for _ in range(times):
            key = uuid.uuid4().hex
            # Three clients on a capacity of 2: each waits its turn (fail-fast
            # would make the counts depend on how the clients overlap).
            acquire(name, external_id=key, owner="metrics-client", timeout=30)
            release(key)
    finally:
        connections.close_all()


def scrape(results: Outbox) -> None:
    """Put the metrics view's answer, as this process serves it, in ``results``."""
    from django.test import RequestFactory

    from django_semaphore.metrics.views import metrics

    try:
        results.put(metrics(RequestFactory().get("/metrics/")).content.decode())
    finally:
        connections.close_all()
