"""``scripts/servers.py stop`` leaves no server behind, nested runtime dirs
included, and ``servers.py leftovers`` finds any process a test run leaked.

Real servers, started in a runtime dir of their own (inside this checkout's,
so an interrupted run is still stopped by ``servers.py stop``) on free ports:
the servers the rest of the suite uses are never touched. Marked ``once``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.faults.runner import servers_module

pytestmark = [pytest.mark.once, pytest.mark.timeout(300)]

servers = servers_module()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A runtime dir with its own ports; removed afterwards, with whatever its
    symlinks point to (a PostgreSQL cluster kept in /tmp)."""
    root = servers.REPO / ".runtime" / "servers-test"
    shutil.rmtree(root, ignore_errors=True)
    monkeypatch.setenv("SEMAPHORE_RUNTIME_DIR", str(root))
    for name in ("mariadb", "postgres", "redis"):
        monkeypatch.setenv(f"SEMAPHORE_{name.upper()}_PORT", str(free_port()))
    yield root
    servers.stop()  # a failed test may have left servers running
    links = [link for link in root.glob("**/*") if link.is_symlink()]
    for target in [link.resolve() for link in links]:
        shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)


def test_stop_ends_every_server_nested_ones_too(runtime: Path, monkeypatch) -> None:
    servers.start(["mariadb", "postgres", "redis"])
    with monkeypatch.context() as nested:  # as the fault suite keeps its own
        nested.setenv("SEMAPHORE_RUNTIME_DIR", str(runtime / "faults"))
        nested.setenv("SEMAPHORE_MARIADB_PORT", str(free_port()))
        nested.setenv("SEMAPHORE_REDIS_PORT", str(free_port()))
        servers.start(["mariadb", "redis"])
    running = servers.leftover_processes(runtime)
    # mariadbd twice, redis twice, PostgreSQL's postmaster and its helpers
    assert len(running) >= 6, running

    servers.stop()

    assert servers.leftover_processes(runtime) == {}


def test_stop_fails_when_a_process_is_left_in_the_runtime_dir(runtime: Path) -> None:
    runtime.mkdir(parents=True)
    stray = subprocess.Popen(["sleep", "300"], cwd=runtime)
    try:
        with pytest.raises(servers.ServerError, match=rf"pid {stray.pid}: sleep 300"):
            servers.stop()
    finally:
        stray.kill()
        stray.wait()
    servers.stop()


def test_a_process_of_the_run_that_outlives_it_is_found(tmp_path: Path) -> None:
    run_id = f"leftover-{tmp_path.name}"
    marked = {**os.environ, servers.RUN_MARKER: run_id}
    # Detached, as a server is: no longer in the run's session or process tree.
    leaked = subprocess.Popen(["sleep", "300"], env=marked, start_new_session=True)
    unrelated = subprocess.Popen(["sleep", "300"])
    try:
        assert servers.processes_of_run(run_id, grace=0) == {leaked.pid: "sleep 300"}
    finally:
        for process in (leaked, unrelated):
            process.kill()
            process.wait()
    assert servers.processes_of_run(run_id, grace=0) == {}
