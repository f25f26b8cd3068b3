"""Django's own tasks of the demo (``django.tasks``; the backport's before
Django 6), run by the database backend's worker: each holds permits keyed
by its task result's id and, refused, is deferred until a release makes
room for it."""

from __future__ import annotations

import random
import time

from django_semaphore import holds_permit

try:
    from django.tasks import task  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # Django 5.2
    from django_tasks import task  # type: ignore[no-redef,unused-ignore]


@task()
@holds_permit("thumbnails", ttl=60)
def make_thumbnails(album_id: int) -> str:
    """Two albums at a time, enqueued in bursts of six: a refused run is
    deferred (see the admin's parked tasks) and runs when one finishes."""
    time.sleep(random.uniform(1, 3))
    return f"album {album_id}: thumbnails made"
