"""The README's first command, run as a new user would: on a clean checkout,
non-interactively, until the admin answers, a demo task (Celery's and a
Django task) has completed, the rate-limited mirror syncs have started, and
the metrics view shows what the Celery worker's processes granted."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent

# Independent of the database under test: runs once per test command.
pytestmark = pytest.mark.once

_WITH_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL);"
    " os.execvp(sys.argv[1], sys.argv[1:])"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def admin_login_answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/login/", timeout=2) as page:
            return page.status == 200 and b"Log in" in page.read()
    except (urllib.error.URLError, OSError):
        return False


def worker_grants_exposed(port: int) -> bool:
    """Grants on the semaphores only the demo's Celery tasks take, as the web
    process serves them: counted in the worker's children, summed through
    PROMETHEUS_MULTIPROC_DIR."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics/", timeout=5) as page:
            exposition = page.read().decode()
    except (urllib.error.URLError, OSError):
        return False
    return any(
        sample.name == "django_semaphore_grants_total"
        and sample.labels.get("semaphore") in {"backups", "network"}
        and sample.value > 0
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    )


def demo_tasks_done(database: Path, module: str = "tasks") -> int:
    """Tasks of the demo's ``module`` (Celery's ``tasks``, Django's own
    ``jobs``) that held their permit and released it."""
    if not database.exists():
        return 0
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5) as db:
        try:
            (count,) = db.execute(
                "SELECT COUNT(*) FROM django_semaphore_permitrequest"
                " WHERE owner LIKE ? AND release_reason = 'released'",
                [f"task:% example_project.demo.{module}.%"],
            ).fetchone()
        except sqlite3.OperationalError:  # not migrated yet, or busy
            return 0
    return int(count)


def mirror_sync_slots(database: Path) -> list[datetime]:
    """When the slots of the demo's rate limit (5 mirror syncs a minute) end,
    oldest first: one per sync it granted."""
    if not database.exists():
        return []
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5) as db:
        try:
            rows = db.execute(
                "SELECT p.slot_ends FROM django_semaphore_permit p"
                " JOIN django_semaphore_semaphore s ON s.id = p.semaphore_id"
                " WHERE s.name = 'mirror-syncs' ORDER BY p.slot_ends"
            ).fetchall()
        except sqlite3.OperationalError:  # not migrated yet, or busy
            return []
    return [datetime.fromisoformat(ends) for (ends,) in rows]


def test_first_readme_command_on_a_clean_checkout(tmp_path):
    checkout = tmp_path / "checkout"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(checkout)], check=True)
    port = free_port()
    log = (tmp_path / "demo.log").open("wb")
    # A new user's shell: none of the test run's Django, database or broker
    # settings, so the demo runs on its embedded defaults (SQLite, filesystem broker).
    env = {k: v for k, v in os.environ.items() if k in {"PATH", "HOME", "LANG", "TMPDIR"}}
    env.update(PORT=str(port), C_FORCE_ROOT="1")
    demo = subprocess.Popen(
        # As from a terminal, where Ctrl-C reaches the script: a test run
        # launched in the background of a non-interactive shell inherits
        # SIGINT ignored, and a shell cannot trap a signal ignored on entry.
        [sys.executable, "-c", _WITH_DEFAULT_SIGINT, "bash", "scripts/demo"],
        cwd=checkout,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, to check nothing outlives it
    )
    try:
        deadline = time.monotonic() + 600  # a fresh virtualenv is installed first
        database = checkout / "example_project" / "db.sqlite3"
        while not (
            admin_login_answers(port)
            and demo_tasks_done(database)
            and demo_tasks_done(database, "jobs")  # a Django task, on its database worker
            and mirror_sync_slots(database)
            and worker_grants_exposed(port)
        ):
            assert demo.poll() is None, (tmp_path / "demo.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "demo.log").read_text()[-3000:]
            time.sleep(1)
        # The first screen is the exports semaphore's page (behind the login),
        # with a day of history on its chart.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as page:
            assert "/admin/django_semaphore/semaphore/" in page.url
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5) as db:
            (changes,) = db.execute("SELECT COUNT(*) FROM django_semaphore_capacitychange")
            mirrors = db.execute(
                'SELECT capacity, "window" FROM django_semaphore_semaphore'
                " WHERE name = 'mirror-syncs'"
            ).fetchall()
        assert changes == (2,)
        # The rate limit declared in settings: never six syncs in a minute.
        assert mirrors == [(5, 60)]
        slots = mirror_sync_slots(database)
        assert all(b - a >= timedelta(seconds=60) for a, b in zip(slots, slots[5:], strict=False))
        # No surprises for a new user: the traffic generator waited for the
        # web server, and nothing failed.
        traffic = (checkout / ".runtime" / "example" / "traffic.log").read_text()
        assert "GET " in traffic
        assert "unreachable" not in traffic
        assert "Traceback" not in (tmp_path / "demo.log").read_text()
    finally:
        demo.send_signal(signal.SIGINT)  # what Ctrl-C sends
        try:
            demo.wait(timeout=60)
        finally:
            leftovers = _processes_in_group(demo.pid)
            if leftovers:
                os.killpg(demo.pid, signal.SIGKILL)
    assert leftovers == [], "processes outlived Ctrl-C"


def _processes_in_group(pgid: int) -> list[int]:
    deadline = time.monotonic() + 30
    while True:
        members = [
            int(entry.name)
            for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and _pgid_and_state(entry) == (pgid, True)
        ]
        if not members or time.monotonic() > deadline:
            return members
        time.sleep(0.5)


def _pgid_and_state(proc: Path) -> tuple[int, bool] | None:
    """(process group, alive); zombies are not alive."""
    try:
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[2]), fields[0] != "Z"


def test_the_demo_broker_shows_a_message_only_once_it_is_written(tmp_path, monkeypatch):
    """kombu's filesystem transport writes a message file in place, so a
    worker listing the folder mid-write read it empty and died; the demo's
    transport renames it into place once written."""
    from kombu import Connection

    from example_project import broker

    options = {
        "data_folder_in": str(tmp_path),
        "data_folder_out": str(tmp_path),
        "control_folder": str(tmp_path / "control"),
    }
    listed_before_the_rename = []
    rename = os.replace

    def replace(staged, path):
        listed_before_the_rename.extend(os.listdir(tmp_path))
        rename(staged, path)

    monkeypatch.setattr(broker.os, "replace", replace)
    connection = Connection(
        "filesystem://localhost//", transport=broker.Transport, transport_options=options
    )
    with connection, connection.SimpleQueue("demo") as queue:
        queue.put({"n": 1})
        assert queue.get(timeout=1).payload == {"n": 1}

    assert listed_before_the_rename
    assert not [name for name in listed_before_the_rename if name.endswith(".demo.msg")]
