"""Generate demo load: download exports over HTTP and enqueue tasks, forever."""

from __future__ import annotations

import random
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from example_project.demo.jobs import make_thumbnails
from example_project.demo.tasks import (
    build_export,
    refresh_search_index,
    render_report,
    run_backup,
    sync_mirror,
)


class Command(BaseCommand):
    help = "Send export downloads and tasks at the demo, so permits come and go."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--url", default="http://127.0.0.1:8000")
        parser.add_argument("--clients", type=int, default=4)
        parser.add_argument("--seconds", type=float, default=0, help="0: until stopped")
        parser.add_argument(
            "--wait", type=float, default=120, help="seconds to wait for the web server"
        )

    def handle(
        self, *args: Any, url: str, clients: int, seconds: float, wait: float, **options: Any
    ) -> None:
        # Started beside the web server: a first request before it listens
        # would only log "connection refused".
        self.wait_until_answering(url, wait)
        stop = threading.Event()
        downloaders = [
            threading.Thread(target=self.download, args=(f"{url}/exports/report.csv", stop))
            for _ in range(clients)
        ] + [
            # Three clients on a handful of customers: now and then a customer
            # has a third download at once, and gets 429.
            threading.Thread(target=self.download_customers, args=(url, stop))
            for _ in range(3)
        ]
        for thread in downloaders:
            thread.start()
        deadline = time.monotonic() + seconds if seconds else float("inf")
        try:
            n = 0
            while time.monotonic() < deadline:
                n += 1
                build_export.delay(n)
                # One refresh at a time; the sends meanwhile are discarded.
                refresh_search_index.delay()
                if n % 3 == 0:
                    run_backup.delay(random.choice(["db-1", "db-2", "files"]))
                if n % 60 == 2:
                    # Every mirror twice, about every 90 s: the rate limit
                    # (5 a minute) starts five and parks the sixth until
                    # the first one's minute is over.
                    for mirror in ["eu", "us", "asia"] * 2:
                        sync_mirror.delay(mirror)
                if n % 20 == 1:
                    # A burst: a backlog of parked tasks draining, two at a time.
                    for page in range(12):
                        render_report.delay(n, page)
                if n % 20 == 3:
                    # Django's own tasks: six albums, two at a time, the
                    # others deferred until a release makes room.
                    for album in range(6):
                        make_thumbnails.enqueue(n * 10 + album)
                time.sleep(random.uniform(1, 2))
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()
            for thread in downloaders:
                thread.join()

    def wait_until_answering(self, url: str, seconds: float) -> None:
        """Return once the server at `url` answers HTTP at all (any status)."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5):
                    return
            except urllib.error.HTTPError:  # an answer, even if not a 200
                return
            except OSError as error:
                if time.monotonic() > deadline:
                    raise CommandError(f"{url} did not answer within {seconds:.0f}s") from error
                time.sleep(0.5)

    def download_customers(self, url: str, stop: threading.Event) -> None:
        while not stop.is_set():
            customer = random.randint(1, 4)
            self.download(f"{url}/exports/customer/{customer}/report.csv", stop, once=True)

    def download(self, url: str, stop: threading.Event, once: bool = False) -> None:
        while not stop.is_set():
            try:
                with urllib.request.urlopen(url, timeout=30) as response:
                    response.read()
                outcome = "200"
            except urllib.error.HTTPError as error:
                outcome = f"{error.code} (Retry-After {error.headers.get('Retry-After')})"
            except OSError as error:  # the server is starting or stopping
                outcome = f"unreachable: {error}"
            self.stdout.write(f"GET {url} -> {outcome}")
            stop.wait(random.uniform(0.2, 1.5))
            if once:
                return
