"""Celery tasks of the demo; each holds permits keyed by its own task id and,
with the library's defaults, waits its turn (parked) when it finds no room."""

from __future__ import annotations

import random
import time
from typing import Any

from celery import shared_task

from django_semaphore import PermitTask, holds_permit


@shared_task(bind=True)
@holds_permit("exports", ttl=60)
def build_export(self: Any, report_id: int) -> str:
    """At most three exports at once, counting those the web is streaming."""
    time.sleep(random.uniform(1, 4))
    return f"report {report_id} built"


@shared_task(bind=True)
@holds_permit("bulk-exports", ttl=60, share=lambda customer, report_id: customer)
def customer_export(self: Any, customer: str, report_id: int) -> str:
    """One customer's bulk export, one at a time for all customers. Its
    share key is the customer: the customers waiting take turns, so one
    customer's backlog never puts another's export behind it all
    (``manage.py demo_shares``; docs/shares.md). To cap each customer as
    well, ask for its family member beside the shared semaphore:
    ``lambda customer, report_id: ["bulk-exports", f"export:customer:{customer}"]``."""
    time.sleep(random.uniform(1, 2))
    return f"{customer}: report {report_id} built"


@shared_task(bind=True)
@holds_permit({"backups": 1, "network": 1}, ttl=120)
def run_backup(self: Any, host: str) -> str:
    """One backup at a time, and it also takes one of the two network slots."""
    time.sleep(random.uniform(2, 5))
    return f"{host} backed up"


@shared_task(bind=True)
@holds_permit({"network": 1, "mirror-syncs": 1}, ttl=60)
def sync_mirror(self: Any, mirror: str) -> str:
    """One of the two network slots while it runs, and one of the five syncs
    a minute the mirrors accept (a rate limit): a sixth in a minute is
    parked until the first of them is a minute old."""
    time.sleep(random.uniform(1, 3))
    return f"{mirror} synced"


@shared_task(bind=True)
@holds_permit("reports", ttl=60)
def render_report(self: Any, batch: int, page: int) -> str:
    """Two at a time, enqueued in bursts: the rest are parked (see the admin's
    parked tasks) and woken first in, first out as each one finishes."""
    time.sleep(random.uniform(1, 2))
    return f"batch {batch} page {page} rendered"


@shared_task(bind=True, base=PermitTask)
@holds_permit("search-index", ttl=60, on_conflict="discard")
def refresh_search_index(self: Any) -> str:
    """Sent after every export: one refresh waits or runs at a time, and a
    send meanwhile is discarded (told that one's id) instead of queueing."""
    time.sleep(random.uniform(2, 4))
    return "search index refreshed"
