"""Leak recovery and clean-up: what the beat tasks, the ``semaphore_sweep``
command and the admin run.

- :func:`release_orphans` releases requests whose holder will not release
  them: TTL expired (``expired``), owner reported dead by a liveness checker
  (``owner_dead``), held past ``STALENESS_LIMIT`` (``stale``); completes
  half-released requests (rows edited or restored from outside); and has
  ``verifier.verify`` check every in-use counter; :func:`verify_counters`
  only checks them.
- :func:`clean_released` deletes requests released longer ago than
  ``RELEASED_RETENTION``, with their permits; :func:`clean_idle_members`
  deletes family members idle past ``MEMBER_IDLE_LIMIT``;
  :func:`clean_history` deletes ``CapacityChange`` rows older than
  ``HISTORY_RETENTION``;
  :func:`clean_tickets` deletes waiters' tickets that expired.
- :func:`sweep_parked` is the backstop of parked tasks' wake-ups.

Every decision about time uses the database's clock (``DatabaseNow``), never
this machine's. Work goes in batches of ``CLEANUP_BATCH_SIZE`` rows, each its
own short transaction, so no row stays locked for long and acquires keep
flowing. Two sweepers running at once (two beat hosts by mistake, cron and
beat) split the work instead of repeating it: each batch locks its rows with
``SELECT ... FOR UPDATE SKIP LOCKED`` and the other sweeper passes over them
(SQLite serializes writers instead, and the second finds nothing left).

With semaphores sharded over several aliases (``SHARDS``), each sweep visits
every alias in turn, its time budget applying to each; the reports add up.

The modules: ``orphans`` (the orphan sweep), ``repairs`` (what the engine did
not write), ``cleanups``, ``parked`` (parked
tasks), ``batches`` (how every sweep works through rows) and ``reports``
(what they return). Import the names from here.
"""

from __future__ import annotations

from django_semaphore.sweep.batches import DEFAULT_TIME_BUDGET
from django_semaphore.sweep.cleanups import (
    clean_history,
    clean_idle_members,
    clean_released,
    clean_tickets,
)
from django_semaphore.sweep.orphans import release_orphans, verify_counters
from django_semaphore.sweep.parked import ParkedReport, sweep_parked
from django_semaphore.sweep.repairs import REPAIRS, inconsistencies
from django_semaphore.sweep.reports import CleanupReport, OrphanReport

__all__ = [
    "DEFAULT_TIME_BUDGET",
    "REPAIRS",
    "CleanupReport",
    "OrphanReport",
    "ParkedReport",
    "clean_history",
    "clean_idle_members",
    "clean_released",
    "clean_tickets",
    "inconsistencies",
    "release_orphans",
    "sweep_parked",
    "verify_counters",
]
