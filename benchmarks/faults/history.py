"""The history recorder: one append-only JSON-lines file per client process.

Each event is written with a single ``os.write`` on an ``O_APPEND`` file, so
it is in the kernel before the next statement runs: a client SIGKILLed at any
point leaves a history that is complete up to the kill. Times are
``time.monotonic()``, one clock for every process of the machine.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OWNER_PREFIX = "faults-client"


class Recorder:
    """Appends events to ``path``; every event gets the monotonic time ``t``."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, event: str, **fields: Any) -> None:
        fields["e"] = event
        fields.setdefault("t", time.monotonic())
        os.write(self.fd, (json.dumps(fields, separators=(",", ":")) + "\n").encode())


def read(path: Path) -> Iterator[dict[str, Any]]:
    """The events of one history; a line cut short by a kill is dropped."""
    if not path.exists():  # killed before it wrote anything
        return
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def owner(client: str) -> str:
    """The owner column of a client's requests: names its pid for the sweep."""
    return f"{OWNER_PREFIX} {client} pid {os.getpid()}"


def local_pid_liveness(owner: str) -> Any:
    """Liveness checker for the sweep: a fault client is dead when its pid is."""
    from django_semaphore.liveness import Liveness

    if not owner.startswith(OWNER_PREFIX):
        return Liveness.UNKNOWN
    pid = int(owner.rpartition(" pid ")[2])
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return Liveness.DEAD
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    if state == "Z" or b"benchmarks.faults" not in cmdline:
        return Liveness.DEAD
    return Liveness.ALIVE
