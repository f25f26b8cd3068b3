"""What the ``owner`` column says, for people and for liveness checkers.

Owners written by ``holds_permit`` for Celery tasks follow one format that the
Celery liveness checker parses back; any other owner is free text.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass
from types import FrameType

from django_semaphore.validation import MAX_LENGTH

TASK_OWNER = re.compile(
    r"^task:(?P<task_id>\S+) (?P<task_name>\S+) on (?P<hostname>\S+) pid (?P<pid>\d+)$"
)

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

    def __str__(self) -> str:
        # The task name is the only part that can be long; trim it, not the id.
        fixed = len(f"task:{self.task_id}  on {self.hostname} pid {self.pid}")
        name = self.task_name[: max(1, MAX_LENGTH - fixed)]
        return f"task:{self.task_id} {name} on {self.hostname} pid {self.pid}"

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
        )


def this_process() -> str:
    """``host pid N``: where a permit taken outside a task is held."""
    return f"{socket.gethostname()} pid {os.getpid()}"


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
