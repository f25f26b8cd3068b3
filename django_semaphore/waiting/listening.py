"""PostgreSQL: a release in another process wakes this process's pollers.

A release sends ``NOTIFY`` after its commit (``notify``, called by
``waiting.released`` where waiting was seen lately), and each process with
waiters on a PostgreSQL alias ``LISTEN``\\s on one daemon connection
(``Listener``), waking its pollers' probes on each notification. Best effort
both ways: the probes remain the fallback, and MariaDB and SQLite have no
notify at all.

**Behind a transaction pooler** (PgBouncer's ``pool_mode = transaction``) a
``LISTEN`` registers on a server connection that goes back to the pool once
the statement ends: the notifications reach another client, or none. The
listener connects through the alias ``LISTEN_DATABASES`` names instead (a
direct connection to the same database); without one, an alias known to be
pooled (``pooled``) has no listener, its waiters poll, and its releases send
no ``NOTIFY``.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import suppress

from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore import process
from django_semaphore.conf import app_settings
from django_semaphore.waiting.waiters import WAITERS

logger = logging.getLogger("django_semaphore")

CHANNEL = "django_semaphore_room"
# Seconds a listener waits for a notification before it checks that it is
# still wanted, after a failed connection before it tries again, and with no
# waiter before it closes its connection (waiters come and go between holds).
LISTEN_CHECK, LISTEN_RETRY, LISTEN_IDLE = 1.0, 2.0, 2.0


def notifies(connection: BaseDatabaseWrapper) -> bool:
    """Whether the alias can notify listeners: PostgreSQL through psycopg 3."""
    driver = getattr(connection, "Database", None)
    return connection.vendor == "postgresql" and getattr(driver, "__name__", "") == "psycopg"


def pooled(alias: str) -> bool:
    """Whether ``alias`` goes through a transaction pooler, as far as can be
    known: Django asks for ``DISABLE_SERVER_SIDE_CURSORS`` there. The server
    cannot say (PgBouncer answers ``SHOW pool_mode`` on its admin console only)."""
    return bool(connections[alias].settings_dict.get("DISABLE_SERVER_SIDE_CURSORS"))


def listen_alias(alias: str) -> str | None:
    """The alias whose connection listens for releases on ``alias``: the one
    ``LISTEN_DATABASES`` names, else ``alias`` unless it is ``pooled``;
    None where nobody listens (the waiters poll) or nothing can notify."""
    via = app_settings.LISTEN_DATABASES.get(alias, None if pooled(alias) else alias)
    if via is None or not (notifies(connections[alias]) and notifies(connections[via])):
        return None
    return via


def notify(connection: BaseDatabaseWrapper, names: list[str]) -> None:
    """``NOTIFY`` the freed semaphores' names, best effort (the listeners'
    probes are the fallback); outside any transaction of the release."""
    payload = "\n".join(names)
    if len(payload.encode()) >= 7900:  # NOTIFY's payload limit is 8000 bytes
        payload = ""  # wakes every poller of the alias
    with suppress(DatabaseError), connection.cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, payload])


class Listener(process.State):
    """One daemon thread per PostgreSQL alias that this process waits on: it
    ``LISTEN``\\s on its own connection while this process has waiters there,
    wakes their pollers on each notification, and closes its connection (and
    sleeps) while it has none."""

    def reset(self) -> None:
        """No thread: in a forked child, the parent's did not survive the fork."""
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self._listening: set[str] = set()
        self._stopping = False

    def stop(self) -> None:
        """End every listener of this process, each closing its connection
        (a test run's teardown drops the database only once nobody is
        connected); a later waiter starts one again."""
        with WAITERS.changed:
            self._stopping = True
            WAITERS.changed.notify_all()
        with self._lock:
            threads, self._threads = list(self._threads.values()), {}
        for thread in threads:
            thread.join(LISTEN_CHECK + LISTEN_RETRY + 1)
        with WAITERS.changed:
            self._stopping = False

    def listening(self, alias: str) -> bool:
        """Whether this process listens on ``alias`` now."""
        return alias in self._listening

    def wanted(self, alias: str) -> None:
        """Make sure a listener runs for ``alias``, if it has one (``listen_alias``)."""
        via = listen_alias(alias)
        if via is None:
            return
        with self._lock:
            thread = self._threads.get(alias)
            if thread is None or not thread.is_alive():
                thread = threading.Thread(
                    target=self._run,
                    args=(alias, via),
                    name=f"semaphore-listener-{alias}",
                    daemon=True,
                )
                self._threads[alias] = thread
                thread.start()

    def _run(self, alias: str, via: str) -> None:
        try:
            while self._wanted(alias, via):
                try:
                    self._listen(alias, via)
                except Exception as exc:  # a lost connection: the probes carry on meanwhile
                    logger.info("Listening for releases on %r failed, will retry: %s", alias, exc)
                    self._listening.discard(alias)
                    with suppress(Exception):
                        connections[via].close()
                    time.sleep(LISTEN_RETRY)
        finally:
            self._listening.discard(alias)
            connections[via].close()  # this thread's own connection

    def _wanted(self, alias: str, via: str) -> bool:
        """Until this process waits on ``alias`` (closing the connection after
        ``LISTEN_IDLE`` without a waiter): False when stopped."""
        with WAITERS.changed:
            waiting = lambda: WAITERS.waiting_on(alias) or self._stopping  # noqa: E731
            if not WAITERS.changed.wait_for(waiting, timeout=LISTEN_IDLE):
                self._listening.discard(alias)
                connections[via].close()
                WAITERS.changed.wait_for(waiting)
            return not self._stopping

    def _listen(self, alias: str, via: str) -> None:
        """Listen on ``via`` while this process waits on ``alias``; wake on
        each notification."""
        connection = connections[via]
        if connection.connection is None or not connection.is_usable():
            connection.close()
            connection.ensure_connection()
            connection.connection.execute(f"LISTEN {CHANNEL}")
            self._listening.add(alias)
        while True:
            for notice in connection.connection.notifies(timeout=LISTEN_CHECK):
                names = notice.payload.split("\n") if notice.payload else None
                WAITERS.room_made(alias, names, here=False)
            with WAITERS.changed:
                if self._stopping or not WAITERS.waiting_on(alias):
                    return


LISTENER = Listener()
