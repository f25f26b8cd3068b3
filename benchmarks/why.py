"""How long "why is it waiting?" takes behind a long line.

Parks ``--parked`` tasks on one semaphore of capacity 4 whose permits are
all held (rows written directly, as parking writes them: a ``ParkedTask``
and its lacking ``Ticket`` each), then times, ``--repeat`` times each, for
the *last* task in line (every other one older, keeping room):

- ``why_waiting``: ``blockers.why_waiting(task id)``, the reads behind both;
- ``--why``: ``manage.py semaphore_status --why <task id>``, in process;
- ``admin page``: the parked task's admin page (its *why it waits*), through
  Django's test client as a logged-in superuser;
- ``semaphore page``: the semaphore's admin page (its line, with who has
  room, and its 24-hour chart).

Usage (the database is created if missing and migrated; the semaphore's
rows are replaced)::

    python -m benchmarks.why --database-url postgres://semaphore@127.0.0.1:54321/bench_why
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.urls import path

from benchmarks import db

NAME = "why-bench"
CAPACITY = 4


def configure(database_url: str) -> None:
    import django

    os.environ["BENCH_DATABASE_URL"] = database_url
    os.environ["BENCH_ADMIN"] = "1"
    os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.settings"
    django.setup()


def urls() -> list[Any]:
    from django.contrib import admin

    return [path("admin/", admin.site.urls)]


def __getattr__(name: str) -> Any:
    # ROOT_URLCONF is this module: its patterns, built once Django is set up.
    if name == "urlpatterns":
        return urls()
    raise AttributeError(name)


def fill(parked: int) -> str:
    """The full semaphore and ``parked`` tasks in its line; the last one's id."""
    from django.db import transaction
    from django.utils import timezone

    from django_semaphore import acquire
    from django_semaphore.models import ParkedTask, Semaphore, Ticket

    Semaphore.objects.filter(name=NAME).delete()
    ParkedTask.objects.filter(task_name="benchmarks.why").delete()
    semaphore = Semaphore.objects.create(name=NAME, capacity=CAPACITY)
    for n in range(CAPACITY):
        acquire(NAME, external_id=f"why-holder-{uuid.uuid4().hex}", owner=f"web-{n}", ttl=3600)
    now = timezone.now()
    ids = [uuid.uuid4().hex for _ in range(parked)]
    with transaction.atomic():
        ParkedTask.objects.bulk_create(
            ParkedTask(
                task_id=task_id,
                key=task_id,
                task_name="benchmarks.why",
                body=b"{}",
                content_type="application/json",
                content_encoding="utf-8",
                parked_at=now,
                expires_at=now + timedelta(days=1),
            )
            for task_id in ids
        )
        Ticket.objects.bulk_create(
            Ticket(
                semaphore=semaphore,
                external_id=task_id,
                count=1,
                lacked=True,
                created_at=now,
                expires_at=now + timedelta(days=1),
            )
            for task_id in ids
        )
    return ids[-1]


def timed(run: Callable[[], Any], repeat: int) -> dict[str, float]:
    run()  # warm: imports, templates, the first connection
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    return {"median_ms": statistics.median(times), "max_ms": max(times)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--parked", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    db.ensure_database(db.Target.parse(args.database_url))
    configure(args.database_url)

    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.test import Client
    from django.urls import reverse

    from django_semaphore.blockers import why_waiting
    from django_semaphore.models import ParkedTask, Semaphore

    call_command("migrate", verbosity=0)
    last = fill(args.parked)
    waiting = why_waiting(last)
    assert waiting is not None, "the last task should wait"
    assert waiting.lacking, "the last task should lack room"
    assert waiting.blockers[0].older == args.parked - 1

    user = get_user_model().objects.filter(username="why-bench").first()
    if user is None:
        user = get_user_model().objects.create_superuser("why-bench", password="why-bench")
    client = Client()
    client.force_login(user)
    parked_page = reverse(
        "admin:django_semaphore_parkedtask_change",
        args=[ParkedTask.objects.get(task_id=last).pk],
    )
    semaphore_page = reverse(
        "admin:django_semaphore_semaphore_change", args=[Semaphore.objects.get(name=NAME).pk]
    )

    def page(url: str) -> None:
        response = client.get(url)
        assert response.status_code == 200, response.status_code

    rows = {
        "why_waiting": timed(lambda: why_waiting(last), args.repeat),
        "--why": timed(
            lambda: call_command("semaphore_status", "--why", last, stdout=io.StringIO()),
            args.repeat,
        ),
        "admin page": timed(lambda: page(parked_page), args.repeat),
        "semaphore page": timed(lambda: page(semaphore_page), args.repeat),
    }
    vendor = db.Target.parse(args.database_url).vendor
    print(f"{vendor}, {args.parked} parked tasks, the last in line, {args.repeat} runs each:")
    for what, figures in rows.items():
        print(
            f"  {what:15} median {figures['median_ms']:7.1f} ms   max {figures['max_ms']:7.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
