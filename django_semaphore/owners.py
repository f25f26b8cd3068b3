"""What the ``owner`` column says, for people and for liveness checkers.

Owners written by ``holds_permit`` for Celery tasks follow one format that the
Celery liveness checker parses back; any other owner is free text. Each owner
this package writes ends with the process that holds the permit:
``<host> pid <pid> started <ticks>``, where ``started`` (Linux only) is when
that process started, in clock ticks after boot, so that a later process
given the same pid is not taken for it (``gone_from_this_machine``).
"""

from __future__ import annotations

import functools
import os
import re
import socket
import sys
from dataclasses import dataclass
from types import FrameType

from django_semaphore.validation import MAX_LENGTH

PROCESS = r"(?P<hostname>\S+) pid (?P<pid>\d+)(?: started (?P<started>\d+))?$"
PROCESS_OWNER = re.compile(PROCESS)
TASK_OWNER = re.compile(rf"^task:(?P<task_id>\S+) (?P<task_name>\S+) on {PROCESS}")

# The pid of a task owner whose permit no process holds: kept between the
# task's own retries (``integrations.celery_tasks``), it is alive as long as the task is.
NO_PROCESS = 0


@dataclass(frozen=True)
class TaskOwner:
    """A Celery task run that holds permits."""

    task_id: str
    task_name: str
    hostname: str  # the worker's node name, e.g. ``celery@web-3``
    pid: int
    started: int | None = None  # the process's start (``process_start``), where known

    def __str__(self) -> str:
        where = f"{self.hostname} pid {self.pid}{_since(self.started)}"
        # The task name is the only part that can be long; trim it, not the id.
        name = self.task_name[: max(1, MAX_LENGTH - len(f"task:{self.task_id}  on {where}"))]
        return f"task:{self.task_id} {name} on {where}"

    @classmethod
    def parse(cls, owner: str) -> TaskOwner | None:
        match = TASK_OWNER.match(owner)
        if match is None:
            return None
        return cls(
            task_id=match["task_id"],
            task_name=match["task_name"],
            hostname=match["hostname"],
            pid=int(match["pid"]),
            started=None if match["started"] is None else int(match["started"]),
        )


def _since(started: int | None) -> str:
    return "" if started is None else f" started {started}"


def this_process() -> str:
    """``host pid N started T``: where a permit taken outside a task is held."""
    pid = os.getpid()
    return f"{socket.gethostname()} pid {pid}{_since(own_start(pid))}"


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (the 22nd
    field of Linux's ``/proc/<pid>/stat``); ``None`` where that cannot be
    read (another system, no such process)."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may
    hold spaces and parentheses), from the state on."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return file.read().rpartition(b")")[2].decode().split()
    except OSError:
        return None


# This process's start, read once per pid (a forked child reads its own).
own_start = functools.cache(process_start)


def gone_from_this_machine(owner: str) -> bool:
    """Whether ``owner`` ends with a process of this machine (its host name,
    or a Celery node name ``name@host``) that is gone: no process has its
    pid, the one that has is a zombie, or it started at another time than
    the owner says (the pid was given to a later process). ``False``
    wherever that cannot be told: another machine, no pid (a task between
    retries), a system without POSIX signals."""
    match = PROCESS_OWNER.search(owner)
    if match is None or int(match["pid"]) == NO_PROCESS or os.name != "posix":
        return False
    if (match["hostname"].partition("@")[2] or match["hostname"]) != socket.gethostname():
        return False
    pid = int(match["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        pass  # another user's process; a pid no process can have
    fields = _stat(pid)
    if fields is None:  # no /proc, or it ended meanwhile: the next sweep tells
        return False
    started = match["started"]
    return fields[0] == "Z" or (started is not None and int(started) != int(fields[19]))


def process_owner(label: str) -> str:
    """``label on host pid N``: the owner of a permit this process holds (the
    label trimmed to fit, never the process)."""
    where = this_process()
    if not label:
        return where
    return f"{label[: max(1, MAX_LENGTH - len(where) - 4)]} on {where}"


def caller_owner() -> str:
    """The owner recorded when the caller names none: ``module.qualname on
    host pid N`` of the nearest caller outside this package.

    Walks frames with ``sys._getframe`` (no ``inspect.stack()``, which reads
    source files): cheap enough for every acquire.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and _is_ours(frame.f_globals.get("__name__", "")):
        frame = frame.f_back
    if frame is None:
        return this_process()
    return process_owner(f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_qualname}")


def _is_ours(module: str) -> bool:
    return module == "django_semaphore" or module.startswith("django_semaphore.")
