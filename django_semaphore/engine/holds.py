"""How long released permits were held: ``hold_ended``, sent after
``permit_released``.

Release is one-way UPDATEs that read nothing back, so the grant time of
what they released is not at hand; reading it is one query on the released
rows, run only while something listens to ``hold_ended`` (the release by
key reads it with the rest of what it ended, see ``releasing.announce_key``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from django.db import Error, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore import signals
from django_semaphore.backends import datetime_from_db
from django_semaphore.engine.statements.release import release_statements

logger = logging.getLogger("django_semaphore")


def send_hold_ended(sender: Any, request_ids: Sequence[int], reason: str, using: str) -> None:
    """Send ``hold_ended`` with the hold times of these released requests'
    permits, if anything listens."""
    if not signals.hold_ended.has_listeners(sender):
        return
    connection = connections[using]
    try:
        # The permits of these requests that ended with ``reason``: that
        # leaves out a request in a sweep's batch that its holder released a
        # moment before (its own release reports it). Plain SQL
        # (``engine/statements/release.py``), not a queryset: it follows every
        # release, and building and compiling a queryset costs more than the
        # query (measured on MariaDB: 0.7 ms a release).
        rows = release_statements(connection).holds(request_ids, reason)
    except Error:
        # The release itself is done; a metric is not worth failing its caller.
        logger.warning("Could not read the hold times of released permits.", exc_info=True)
        return
    if holds := [hold(connection, *row) for row in rows]:
        signals.hold_ended.send_robust(sender=sender, holds=holds, reason=reason, using=using)


def hold(
    connection: BaseDatabaseWrapper, request_id: int, name: str, count: int, start: Any, end: Any
) -> signals.Hold:
    """``count`` permits of request ``request_id`` on semaphore ``name``,
    held from ``start`` to ``end``: raw values from the database, converted
    as the ORM would (SQLite returns text)."""
    elapsed = datetime_from_db(connection, end) - datetime_from_db(connection, start)
    return signals.Hold(request_id, name, count, max(0.0, float(elapsed.total_seconds())))
