"""How the admin screenshots in this folder were made (docs/admin.md shows them).

    .venv/bin/python docs/img/admin_screenshots.py

The example project on a scratch SQLite database, seeded with a day of
plausible history, served by ``runserver`` and photographed by the system's
headless Chromium through Selenium (as the browser tests do).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PORT = 18765


def seed() -> None:
    """A day of jobs on the example project's semaphores, and some holders now."""
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from django_semaphore import acquire, release, set_capacity
    from django_semaphore.guards import engine_writes
    from django_semaphore.models import CapacityChange, PermitRequest, Semaphore, Ticket

    random.seed(7)
    users = get_user_model().objects
    users.create_superuser("ops", password="ops")
    alice = users.create_user("alice", is_staff=True)
    bob = users.create_user("bob", is_staff=True)
    now = timezone.now()
    hour = timedelta(hours=1)
    keys = iter(range(1, 10_000))

    def past_job(sem: Semaphore, start: datetime, end: datetime, count: int, owner: str) -> None:
        key = f"{sem.name}-job-{next(keys)}"
        acquire({sem.name: count}, external_id=key, owner=owner)
        release(key)
        PermitRequest.objects.filter(external_id=key).update(created_at=start, released_at=end)

    def simulate(sem: Semaphore, capacity: Any, busy: float, quiet_for: float = 1) -> None:
        """Jobs that start only when there is room: ``capacity(moment)``.

        They all end ``quiet_for`` hours before now, before today's holders came.
        """
        ends: list[datetime] = []
        moment, stop = now - 24 * hour, now - quiet_for * hour
        while moment < stop:
            ends = [end for end in ends if end > moment]
            if len(ends) < capacity(moment) and random.random() < busy:
                end = min(moment + timedelta(minutes=random.randint(15, 140)), stop)
                worker = f"celery@worker-{random.randint(1, 4)} pid {random.randint(1000, 9999)}"
                past_job(sem, moment, end, 1, worker)
                ends.append(end)
            moment += timedelta(minutes=random.randint(3, 12))

    def change(sem: Semaphore, new: int, by: Any, reason: str, ago: timedelta) -> None:
        set_capacity(sem.name, new, changed_by=by, reason=reason)
        latest = CapacityChange.objects.filter(semaphore=sem).latest("id")
        CapacityChange.objects.filter(pk=latest.pk).update(changed_at=now - ago)

    def holder(sem: Semaphore, count: int, owner: str, minutes: int, ttl: int | None) -> None:
        key = f"{sem.name}-{random.choice(['nightly', 'export', 'sync'])}-{next(keys)}"
        acquire({sem.name: count}, external_id=key, owner=owner, ttl=ttl)
        PermitRequest.objects.filter(external_id=key).update(
            created_at=now - timedelta(minutes=minutes)
        )

    exports = Semaphore.objects.get(name="exports")  # declared in settings: 3
    backups = Semaphore.objects.get(name="backups")  # 1
    network = Semaphore.objects.get(name="network")  # 2
    reports = Semaphore.objects.get(name="reports")  # 2
    imports = Semaphore.objects.create(name="imports", capacity=4)

    # exports: raised to 5 for the quarter-end run 14 h ago, back to 3 at 6 h.
    raised = (now - 14 * hour, now - 6 * hour)
    # Jobs started while it was 5 run on after it went back to 3: over capacity.
    simulate(exports, lambda moment: 5 if raised[0] <= moment < raised[1] else 3, 0.45)
    change(exports, 5, alice, "Quarter-end exports", 14 * hour)
    change(exports, 3, bob, "Database load too high", 6 * hour)
    simulate(network, lambda moment: 2, 0.25)
    simulate(imports, lambda moment: 4, 0.2)
    past_job(backups, now - 20 * hour, now - 17 * hour, 1, "cron@db-1")
    past_job(backups, now - 9 * hour, now - 7.5 * hour, 1, "cron@db-1")
    past_job(reports, now - 11 * hour, now - 10 * hour, 2, "web-2 pid 311")

    holder(exports, 1, "celery@worker-1 pid 4242", 38, ttl=900)
    holder(exports, 2, "celery@worker-3 pid 5120", 12, ttl=900)
    holder(network, 1, "web-1 pid 2718", 3, ttl=60)
    holder(imports, 2, "celery@worker-2 pid 4711", 55, ttl=None)
    # backups: raised to 2 for a second window, then lowered to 1 while both
    # are held: over capacity.
    holder(backups, 1, "cron@db-1", 95, ttl=None)
    change(backups, 2, bob, "Second backup window", timedelta(minutes=30))
    holder(backups, 1, "cron@db-2", 20, ttl=None)
    change(backups, 1, alice, "Storage array degraded", timedelta(minutes=10))

    # On exports a big rebuild waits in line ahead of a smaller job; an
    # urgent one (priority 100: 100 s ahead) came a minute after the small
    # one and goes before it, not before the rebuild (tickets as a waiting
    # acquire(...) leaves them).
    with engine_writes():  # the line's state, as the waiting acquires would leave it
        Semaphore.objects.filter(pk=exports.pk).update(queued_until=now + 2 * hour)
    # Each customer's exports carry its share key.
    for count, owner, waited, key, priority, share in [
        (3, "celery@worker-2 pid 6021", 7, "exports-quarter-end-rebuild", 0, "acme"),
        (1, "web-2 pid 3141", 2, "exports-csv-9f2c41", 0, "globex"),
        (1, "web-1 pid 2718", 1, "exports-board-report-1d07", 100, "acme"),
    ]:
        Ticket.objects.create(
            semaphore=exports,
            external_id=key,
            owner=owner,
            count=count,
            created_at=now - timedelta(minutes=waited),
            priority=priority,
            ranked_at=now - timedelta(minutes=waited, seconds=priority),
            share=share,
            turn_at=now - timedelta(minutes=waited),
            expires_at=now + 2 * hour,
        )


def photograph(base: str) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1440,900",
        "--force-device-scale-factor=1",
        "--hide-scrollbars",
        "--lang=en-US",
        f"--user-data-dir={tempfile.mkdtemp()}",
    ]:
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))

    def shoot(path: str, name: str) -> None:
        browser.get(base + path)
        time.sleep(0.5)
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(1440, height)
        time.sleep(0.3)
        browser.save_screenshot(str(HERE / f"{name}.png"))
        browser.set_window_size(1440, 900)

    try:
        browser.get(f"{base}/admin/login/")
        browser.find_element(By.NAME, "username").send_keys("ops")
        browser.find_element(By.NAME, "password").send_keys("ops")
        browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        time.sleep(1)
        browser.get(f"{base}/admin/django_semaphore/semaphore/?q=exports")
        browser.find_element(By.ID, "toggle-nav-sidebar").click()  # room for the columns
        semaphore = browser.find_element(By.LINK_TEXT, "exports").get_attribute("href")
        shoot("/admin/django_semaphore/semaphore/", "admin-changelist")
        shoot(str(semaphore).removeprefix(base), "admin-semaphore")
        shoot("/admin/django_semaphore/permitrequest/?state__exact=ACQUIRED", "admin-requests")
    finally:
        browser.quit()


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="semaphore-screenshots-"))
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{scratch / 'db.sqlite3'}",
        "DJANGO_SETTINGS_MODULE": "example_project.settings",
        "PYTHONPATH": str(REPO),
    }
    python = sys.executable
    subprocess.run([python, "manage.py", "migrate", "-v0"], cwd=REPO, env=env, check=True)
    subprocess.run([python, __file__, "--seed"], cwd=REPO, env=env, check=True)
    server = subprocess.Popen(
        [python, "manage.py", "runserver", "--noreload", f"127.0.0.1:{PORT}"], cwd=REPO, env=env
    )
    try:
        time.sleep(3)
        photograph(f"http://127.0.0.1:{PORT}")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    if sys.argv[1:] == ["--seed"]:
        seed()
    else:
        main()
