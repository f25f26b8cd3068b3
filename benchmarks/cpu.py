"""What a cycle costs in CPU, on each side of the connection.

On a small machine the clients and the server share the cores, so cycles/s
mixes two costs: the database's work per cycle (what bounds a server whose
clients run elsewhere, as in production) and the client's (Python, the
driver, Django). The benchmark reports both per cycle; the server's is read
from ``/proc`` when the server runs on this machine, and is left out otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from benchmarks import db

TICK = os.sysconf("SC_CLK_TCK")


class ServerClock:
    """CPU seconds used so far by a database server on this machine."""

    def __init__(self, target: db.Target) -> None:
        self.pid = _server_pid(target)
        # PostgreSQL serves each connection from a child of the postmaster.
        self.with_children = target.vendor == "postgresql"

    @property
    def available(self) -> bool:
        return self.pid is not None and Path(f"/proc/{self.pid}").exists()

    def seconds(self) -> float | None:
        if self.pid is None or not self.available:
            return None
        server = _usage(self.pid)
        if not self.with_children:
            return server.own + server.reaped
        while True:
            # Children count themselves until reaped (zombies too), then in
            # the parent's reaped time. One reaped while /proc is being read
            # would be in neither: read again until no child was reaped
            # during the scan.
            children = sum(u.own for u in map(_usage_if_alive, _pids()) if u.parent == self.pid)
            after = _usage(self.pid)
            if after.reaped == server.reaped:
                return after.own + after.reaped + children
            server = after


class Usage(NamedTuple):
    own: float  # user + system CPU seconds
    reaped: float  # the same, of its ended children it has reaped
    parent: int


def _usage(pid: int) -> Usage:
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may hold spaces: split after its parenthesis.
    fields = text[text.rindex(")") + 2 :].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return Usage((utime + stime) / TICK, (cutime + cstime) / TICK, int(fields[1]))


def _usage_if_alive(pid: int) -> Usage:
    try:
        return _usage(pid)
    except (OSError, ValueError):
        return Usage(0.0, 0.0, 0)  # ended and reaped meanwhile


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _server_pid(target: db.Target) -> int | None:
    """The server's pid from its own pid file, if that file is on this machine."""
    if target.vendor == "sqlite":
        return None  # in the client's own process
    conn = db.connect(target, autocommit=True)
    try:
        cursor = conn.cursor()
        if target.vendor == "mysql":
            cursor.execute("SELECT @@pid_file, @@datadir")
            pid_file, datadir = cursor.fetchone()
            path = Path(datadir, pid_file)  # pid_file may be relative to datadir
        else:
            cursor.execute("SELECT current_setting('data_directory')")
            path = Path(cursor.fetchone()[0], "postmaster.pid")
        return int(path.read_text().split()[0])
    except Exception:
        return None  # not readable from here (a remote server, or no privilege)
    finally:
        conn.close()
