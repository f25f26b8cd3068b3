from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from django.db import connection

from django_semaphore.models import Semaphore


@pytest.fixture(scope="session", autouse=True)
def _report_database(django_db_setup, django_db_blocker):
    """Fail loudly, never skip, when the configured database is unreachable."""
    with django_db_blocker.unblock():
        connection.ensure_connection()
    print(f"\nRunning on {connection.vendor} ({connection.settings_dict['NAME']})")


def unique(prefix: str = "sem") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_semaphore(db) -> Callable[..., Semaphore]:
    def make(capacity: int = 1, name: str | None = None, fair: bool = False) -> Semaphore:
        return Semaphore.objects.create(name=name or unique(), capacity=capacity, fair=fair)

    return make


from tests.celery_worker import celery_worker  # noqa: E402, F401  (a fixture)
