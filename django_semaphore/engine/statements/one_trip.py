"""The grant in one round trip: the common case -- every semaphore named
has room, no line is live, no rate window -- decided and written by
the database in a single call, in one transaction of its own.

The migrations install it as a routine (``ROUTINE``), which the server
parses once per connection: PostgreSQL functions, one for one name (on a
record and scalars) and one for any number (on arrays); a MariaDB
procedure, for one name. Several names on MariaDB go as one anonymous block
(``BEGIN NOT ATOMIC``) of the same statements, sent like any statement.
They run the grant's own statements (``grant_routine.py`` renders them):
the manager's locking read (the app's one lock order), the release totals
read once the locks are held, the room check of ``LockedSemaphore.in_use``,
then the request's insert (its unique key settles repeated calls: a taken
key fails as the general path's insert does), the counters' updates and the
permits' insert, in semaphore id order.

The routines also refuse, in the same call: a caller that fails fast (for
one name after waiting briefly at the head for a release, nobody ahead of
it), and, for one name, a caller that waits (its ticket taken: every
waiter waits in line; the first in line waits at the head for a release,
the next queued behind it; see ``grant_routine.py``).

Anything else answers "not here" without writing anything, and the grant
goes the general way (``grant.grant``): a refusal that needs more (a
reclaim of expired permits, a taken key's request), a waiter's refusal on
several names, a waiter with a share key until it has its tickets (its
key's turn is read there), a missing name (a family's member is created
there), a live line on several names, a rate limit, a count above the
capacity.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore import backends
from django_semaphore.conf import app_settings
from django_semaphore.engine.statements import SQL, built, placeholders, routine
from django_semaphore.engine.statements.grant_routine import grant_routine

# A function on PostgreSQL, a procedure on MariaDB (routines.py renders it, a
# migration installs it as frozen text).
ROUTINE = routine("django_semaphore_grant")
# PostgreSQL's function for one name: scalars where the general one keeps
# arrays, a third less of the server's time per call.
ONE_NAME_ROUTINE = routine("django_semaphore_grant_one")


@dataclass
class Granted:
    """What the one-trip grant wrote."""

    request_id: int
    granted_at: datetime
    expires_at: datetime | None
    fencing_tokens: dict[str, int]
    in_use: dict[str, int]  # each semaphore's permits in use once granted


@dataclass
class Refused:
    """The one-trip grant's refusal: what ``fairness.admit`` says of it in
    the general grant."""

    lacking: tuple[tuple[int, str, int], ...]  # (id, name, capacity) of those without room
    rounds: int  # capacities' worth of grants that come before its own (one name)
    ticket_taken: bool  # it took its ticket (or marked it lacking room; one name)
    grants: int  # the fencing counter: the grants made before the refusal (one name)
    at: datetime | None = None  # the routine's clock (one name): a ticket it took ranks from it


@dataclass(frozen=True)
class Line:
    """Where the call stands in the semaphore's line, for the routine that
    can refuse (one name)."""

    ticketed: bool  # it holds tickets (only the general grant deletes them elsewhere)
    lacked: bool  # its ticket lacked room
    ticket_life: float | None  # seconds a ticket it takes lives; None: it takes none
    priority: int  # where a ticket it takes ranks (``line.ranked``)
    shared: bool = False  # it has a share key


class OneTripStatements(SQL):
    """The one-trip grant, for one connection."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        super().__init__(connection)
        self.vendor = connection.vendor
        self.blocks = backends.bounds_each_statement(connection)

    def applies(self) -> bool:
        """Whether this database grants in one trip (MariaDB, PostgreSQL)."""
        return self.vendor == "postgresql" or self.blocks

    def grant(
        self,
        counts: dict[str, int],
        key: str,
        owner: str,
        ttl: int | None,
        lock_wait: float,
        line: Line,
    ) -> Granted | Refused | None:
        """Grant ``counts`` (name -> permits) to ``key``, committed, or refuse
        a caller that fails fast or waits in line; ``None``: not in
        one trip (nothing written).
        Outside any transaction."""
        names = sorted(counts)
        one_name = len(names) == 1
        if line.ticketed and not one_name:
            return None
        if line.shared and line.ticket_life is not None and not line.ticketed:
            return None
        if (one_name or self.vendor == "postgresql") and not backends.routines_installed(
            self.connection
        ):
            return None  # MariaDB's block of several names is no routine
        params: list[Any]
        wait = max(1, math.ceil(lock_wait))
        head_start = line.priority * app_settings.PRIORITY_STEP.total_seconds()
        in_line = [line.ticketed, line.lacked, line.ticket_life, line.priority, head_start]
        fails_fast = line.ticket_life is None
        if one_name and self.vendor == "postgresql":
            sql = f"SELECT * FROM {ONE_NAME_ROUTINE}({placeholders(11)})"
            params = [names[0], counts[names[0]], key, owner, ttl, backends.lock_timeout(lock_wait)]
            params += in_line
        elif self.vendor == "postgresql":
            sql = f"SELECT * FROM {ROUTINE}(%s, %s, %s, %s, %s, %s, %s)"
            params = [names, [counts[n] for n in names], key, owner, ttl]
            params += [backends.lock_timeout(lock_wait), fails_fast]
        elif one_name:
            sql = f"CALL {ROUTINE}({placeholders(11)})"
            params = [names[0], counts[names[0]], ttl, key, owner, wait, *in_line]
        else:
            sql = grant_routine(self.connection).block(len(names), wait)
            pairs = [value for name in names for value in (name, counts[name])]
            params = [key, owner, ttl, fails_fast, *names, *pairs * len(names)]
        with self.connection.cursor() as cursor:
            cursor.execute(sql, params)
            rows = cursor.fetchall()
            if self.vendor != "postgresql":
                while cursor.nextset():  # the block's or the call's closing status
                    pass
        # Declined: no row (PostgreSQL) or a row of NULLs; refused: a row
        # with no request per name without room: its id and capacity, and
        # for one name where the call stands in its line.
        if not rows or rows[0][3] is None:
            return None
        request_id, granted_at, expires_at = rows[0][:3]
        stamp = functools.partial(backends.datetime_from_db, self.connection)
        if request_id is None:
            lacking = tuple((int(row[6]), row[3], int(row[7])) for row in rows)
            rounds, ticket_taken = rows[0][8:] or (0, False)
            return Refused(
                lacking, int(rounds), bool(ticket_taken), int(rows[0][4]), stamp(granted_at)
            )
        return Granted(
            int(request_id),
            stamp(granted_at),
            stamp(expires_at),
            {row[3]: int(row[4]) for row in rows},
            {row[3]: int(row[5]) for row in rows},
        )


def one_trip_statements(connection: BaseDatabaseWrapper) -> OneTripStatements:
    """This connection's one-trip grant."""
    return built(OneTripStatements, connection)
