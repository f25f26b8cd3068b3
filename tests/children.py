"""The processes and threads a test starts: bounded in time, unable to hang a run.

Why this module exists: a child that reports through a ``multiprocessing``
queue cannot exit while what it put still fills the pipe, so a parent that
joins its children before draining the queue waits forever (the
join-before-drain deadlock), and pytest then waits at exit for its
non-daemon children. Here children report through an :class:`Outbox` (a file
per writer, never a pipe); every spawned child enforces its own deadline,
dumping its stacks and exiting when it passes it; and :func:`join` stops
every worker, with their stacks in the failure, when one overruns or the test
fails or times out (``tests/conftest.py`` stops any child a test leaves).

Spawned children unpickle their target by importing its module before Django
is set up, so this module, like the clients', imports nothing that needs the
app registry.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from shutil import rmtree
from typing import Any, TextIO

# Spawned, not forked: forking a process that runs threads (Django's, a
# driver's) can deadlock the child. Each child sets Django up on its own.
SPAWN = multiprocessing.get_context("spawn")

# Where every process of the run writes its stacks on SIGUSR1 (set by
# tests/conftest.py, or by scripts/watchdog.py for a whole run).
STACKS_VARIABLE = "SEMAPHORE_STACKS_DIR"

Worker = BaseProcess | threading.Thread

# What children write lives in the checkout's runtime dir, never in /tmp.
RUNTIME = Path(__file__).resolve().parent.parent / ".runtime"


@dataclass
class Outbox:
    """What workers report, one file per writing process and thread: a write
    never waits for a reader, so no worker is ever kept from exiting."""

    directory: str

    @classmethod
    def create(cls) -> Outbox:
        RUNTIME.mkdir(exist_ok=True)
        outbox = cls(tempfile.mkdtemp(prefix="outbox-", dir=RUNTIME))
        # Only the creator's copy removes the files; a child's unpickled copy does not.
        weakref.finalize(outbox, rmtree, outbox.directory, ignore_errors=True)
        return outbox

    def put(self, item: Any) -> None:
        path = Path(self.directory) / f"{os.getpid()}-{threading.get_ident()}"
        with path.open("ab") as file:
            pickle.dump(item, file)

    def items(self) -> list[Any]:
        """Everything put so far, each writer's items in the order it put them."""
        items = []
        for path in sorted(Path(self.directory).iterdir()):
            with path.open("rb") as file:
                while True:
                    try:
                        items.append(pickle.load(file))
                    except EOFError:
                        break
        return items


def stacks_file(pid: int) -> Path:
    directory = Path(os.environ.get(STACKS_VARIABLE) or RUNTIME / "stacks")
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"stacks-{pid}.txt"


def dump_stacks_on_signal() -> TextIO:
    """SIGUSR1 makes this process write every thread's stack to its stacks
    file, which is returned (appending, so dumps never overwrite each other)."""
    path = stacks_file(os.getpid())
    path.unlink(missing_ok=True)  # a former process's of the same pid
    file = path.open("a")
    faulthandler.register(signal.SIGUSR1, file=file, all_threads=True)
    return file


@dataclass(frozen=True)
class ChildStart:
    """What a spawned child does before anything else: unpickled first of its
    arguments, it arms the child's deadline and stack dumps and sets Django
    up on the test's database, so the arguments after it (the target, and
    objects of modules that import the app's models) unpickle with Django
    ready."""

    database: dict[str, Any]
    bound: float

    def __reduce__(self) -> tuple[Any, ...]:
        return (_start_child, (self.database, self.bound))


def _start_child(database: dict[str, Any], bound: float) -> None:
    import django

    faulthandler.dump_traceback_later(bound, exit=True, file=dump_stacks_on_signal())
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django.db import connections

    connections["default"].settings_dict.update(database)


def in_child_process(started: None, target: Callable[..., None], *args: Any) -> None:
    """Entry point of a spawned child: its start (``ChildStart``) is done by
    the time its arguments are unpickled, so it only works."""
    target(*args)


def spawn(
    target: Callable[..., None], *args: Any, bound: float, database: dict[str, Any] | None = None
) -> BaseProcess:
    """Start ``target(*args)`` in a spawned child on this test's database (or on
    ``database``'s settings), which ends itself ``bound`` seconds from now."""
    from django.db import connection

    database = database or {"NAME": connection.settings_dict["NAME"]}
    process = SPAWN.Process(
        target=in_child_process,
        args=(ChildStart(database, bound), target, *args),
        daemon=True,
    )
    process.start()
    return process


def start_threads(target: Callable[..., None], args: tuple[Any, ...], count: int) -> list[Any]:
    """``count`` daemon threads running ``target(*args)``: one left running never
    keeps the test process from exiting."""
    threads = [threading.Thread(target=target, args=args, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def join(workers: Sequence[Worker], within: float) -> None:
    """Wait for every worker to end, each process with exit code 0. A worker
    still running after ``within`` seconds, a failed process, or the test
    failing meanwhile (pytest-timeout's signal included): stop every worker
    and fail with their stacks."""
    deadline = time.monotonic() + within
    try:
        for worker in workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [worker for worker in workers if worker.is_alive()]
        assert not hung, f"{len(hung)} worker(s) hung past {within:.0f}s:\n{stop(hung)}"
        failed = [w.exitcode for w in workers if isinstance(w, BaseProcess) and w.exitcode]
        assert not failed, f"clients exited with {failed}:\n{stop(workers)}"
    except BaseException:
        print(stop(workers), file=sys.stderr)  # shown with the failure
        raise


def stop(workers: Iterable[Worker]) -> str:
    """End the workers still alive and return their stacks: each process's
    from its stacks file (dumped on SIGUSR1, or by its own deadline), this
    process's threads from a dump of its own."""
    workers = list(workers)
    processes = [w for w in workers if isinstance(w, BaseProcess) and w.is_alive()]
    for process in processes:
        _signal(process, signal.SIGUSR1)
    time.sleep(0.5 if processes else 0)
    for process in processes:
        _signal(process, signal.SIGKILL)
        process.join(timeout=10)
    stacks = [
        f"--- child {worker.pid}:\n{stacks_file(worker.pid).read_text(errors='replace')}"
        for worker in workers
        if isinstance(worker, BaseProcess) and worker.pid and stacks_file(worker.pid).exists()
    ]
    if any(isinstance(w, threading.Thread) and w.is_alive() for w in workers):
        stacks.append(f"--- this process (pid {os.getpid()}):\n{own_stacks()}")
    return "\n".join(stacks)


def own_stacks() -> str:
    with tempfile.TemporaryFile("w+") as file:
        faulthandler.dump_traceback(file, all_threads=True)
        file.seek(0)
        return file.read()


def _signal(process: BaseProcess, number: signal.Signals) -> None:
    if process.pid is not None:
        with suppress(ProcessLookupError):
            os.kill(process.pid, number)
