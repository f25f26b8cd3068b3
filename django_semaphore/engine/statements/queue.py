"""PostgreSQL's grants wait their turn in a queue that a grant's update of
the semaphore row does not reorder.

Every grant updates the rows it locked (the counters, the fencing counter).
On PostgreSQL an update makes a new version of the row, so the callers
queued on the old version's lock all wake when the holder commits, find
the row changed, and race for the new version: each grant wakes every
waiter, and who gets in next is left to chance. Measured on one hot
semaphore with 64 clients, the seed's SQL with that one update added fell
from 1,025 to 557 cycles/s and its slowest 1% waited 609 ms instead of 87.

So before its locking read a grant takes a transaction-level advisory lock
per name: waiters queue there, in the lock manager's order, and each commit
wakes one. Rows are still what decides (every other path locks them alone);
the queue only orders the grants. The keys are taken in ascending order, so
grants never wait on each other in a circle, and all of them before any
row, so a grant never waits on a row that another grant holds. Names whose
hashes collide share a queue: they wait on each other a little, nothing
more.

The routine also bounds the transaction's lock waits (``lock_timeout``, the
queue's wait included). MariaDB queues row-lock waiters in order and
updates rows in place: it has no such routine.
"""

from __future__ import annotations

from collections.abc import Sequence

from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore import backends
from django_semaphore.engine.statements import routine

# routines.py renders it, a migration installs it; the one-trip grant runs its
# statements (``waits_sql``).
ROUTINE = routine("django_semaphore_queue")
# The advisory locks' first key, "SEMA": their own key space, apart from
# the one-key locks a project takes itself. The second is the name's hash.
LOCK_CLASS = 0x53454D41


def waits_sql(names_sql: str, lock_wait_sql: str) -> str:
    """PL/pgSQL that bounds the transaction's lock waits to ``lock_wait_sql``
    and waits for the turn of ``names_sql`` (``text[]``): the routine's, and
    the one-trip grant's for several names."""
    return (
        f" PERFORM set_config('lock_timeout', {lock_wait_sql}, true);\n"
        f" IF cardinality({names_sql}) = 1 THEN\n"
        f"  PERFORM pg_advisory_xact_lock({LOCK_CLASS}, hashtext(({names_sql})[1]));\n"
        " ELSE\n"
        "  DECLARE k integer; BEGIN\n"
        f"   FOR k IN SELECT DISTINCT hashtext(n) FROM unnest({names_sql}) AS n ORDER BY 1 LOOP\n"
        f"    PERFORM pg_advisory_xact_lock({LOCK_CLASS}, k);\n"
        "   END LOOP;\n"
        "  END;\n"
        " END IF;\n"
    )


def waits_for_one_sql(name_sql: str, lock_wait_sql: str) -> str:
    """The same for one name (``name_sql``: text): the one-trip grant's for one."""
    return (
        f" PERFORM set_config('lock_timeout', {lock_wait_sql}, true);\n"
        f" PERFORM pg_advisory_xact_lock({LOCK_CLASS}, hashtext({name_sql}));\n"
    )


def create_sql() -> str:
    """The routine's ``CREATE`` (``routines.creates`` lists it)."""
    return (
        f"CREATE OR REPLACE FUNCTION {ROUTINE}(p_names text[], p_lock_wait text)"
        f" RETURNS void LANGUAGE plpgsql VOLATILE AS $queue$\nBEGIN\n"
        f"{waits_sql('p_names', 'p_lock_wait')}END\n$queue$"
    )


def enter(connection: BaseDatabaseWrapper, names: Sequence[str], lock_wait: float) -> None:
    """First in a grant's transaction: bound its lock waits to ``lock_wait``
    seconds and wait for the names' turn. Without this version's routine
    (``backends.routines_installed``) the grant waits on the rows alone:
    they decide, the queue only orders."""
    if not backends.routines_installed(connection):
        backends.start_bounded_transaction(connection, lock_wait)
        return
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {ROUTINE}(%s, %s)", [list(names), backends.lock_timeout(lock_wait)])
