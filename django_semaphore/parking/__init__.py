"""Parked tasks: a Celery task that finds no room waits in the database, not
in the broker, and is published again when releases make room for it; a
Django task deferred in its backend (``defer``, ``deferred``) waits the
same way, and is resumed there.

**Park.** A ``@holds_permit`` task (by default: ``PARK_TASKS``;
``park=False`` retries instead) whose run is refused writes a ``ParkedTask``
row -- its message as the task's serializer encodes it, the same one
``Task.retry`` would publish, minus the countdown -- and takes its place in
line: a ``Ticket`` per semaphore, keyed by its task id, as a waiter's
(``engine/wakeups``), then ends in the ``PARKED`` state
(``celery.exceptions.Ignore``: no failure, no retry counted). Once that is
committed it looks for room once more (``wake``): a release that committed
between its refusal and its row would otherwise have woken nobody.

**Wake.** The doors that free permits -- ``release()``, a task finishing,
the sweeps, a force release, a capacity or window change -- call
``room_made`` with the semaphores they freed permits on; once that is
committed, and if this process wakes parked tasks (``enable``), ``wake``
runs one short transaction that locks the semaphore rows in name order (as
the grant does) and wakes the oldest parked tasks that fit beside the older
tickets that lacked room -- the one rule every grant obeys: a task that
does not fit holds back younger ones only on the semaphores where it lacks
(or once lacked) room, so tenant A's tasks waiting for A's own cap never
keep tenant B's from a shared semaphore with room. A woken task's tickets
keep its room until its run takes it. Their messages are published after
that commits. What no door sees -- a grant's inline reclaim of expired
permits, ``Semaphore.save()`` of a raised capacity, releases in processes
that do not wake -- the beat sweep (``sweep.sweep_parked``) finds within
its interval.

**Stand by first.** Parking costs a broker round trip per hand-off
(release, wake-up, publish, delivery, grant), longer than a short task: a
capacity of 20 ms tasks would spend more time handing permits over than
holding them. So a refused task first *stands by* in its worker
(``standby.stand_by``) -- unless this process saw its semaphores held for
``SHORT_HOLD`` or longer (a family's members count as one), or, for a task
not woken, parked tasks are held back on them (tasks that lacked room there
came first). It waits as ``acquire(timeout=STANDBY_WAIT)`` waits --
``waiting``'s poller, paced by the holds this process saw
(``standby.learn_hold``) -- and then parks (a woken task keeps its place).
One task a process stands by on a semaphore (a thread or gevent pool's
others park). The standbys are the worker's
processes left over: while they wait, the broker's backlog stays in the
broker, not in rows. A first standby that no release reaches marks its
semaphores (a member: its family) as held long in this process, so long
holds pay ``STANDBY_WAIT`` once per worker process, however many members
a family has.

**Nothing lost, nothing run twice.** A woken row stays until its run holds its
permit (``started``), so a publish that failed, or a message lost before a
worker ran it, is published again by the beat sweep (``sweep.sweep_parked``) once
``PARKED_REPUBLISH_AFTER`` has passed; a task whose publish raised is first
in line for the next wake-up. The run's key is its task id: a second copy meeting a live
first one is deferred as any live duplicate is, and a copy arriving after the
task finished is dropped (``TaskAlreadyRan``). A revoked or expired task is
dropped when Celery discards its message (``task_revoked``); a row past its
``expires`` is never published, and the sweep drops it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping
from contextlib import suppress
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import (
    BigIntegerField,
    Count,
    F,
    OuterRef,
    QuerySet,
    Subquery,
)
from django.db.models.functions import Coalesce

from django_semaphore import backends, routing
from django_semaphore.conf import app_settings
from django_semaphore.engine import wakeups
from django_semaphore.exceptions import LineFull
from django_semaphore.models import ParkedTask, PermitRequest, Semaphore, Ticket
from django_semaphore.parking import wake
from django_semaphore.parking.rows import Row, drop_parked, raw_delete, write
from django_semaphore.retry import run_with_retries
from django_semaphore.states import ReleaseReason
from django_semaphore.validation import validate_keys

logger = logging.getLogger("django_semaphore")

PARKED = "PARKED"
"""The Celery state of a parked task (a custom state, as ``PROGRESS`` would be):
not failed, not pending on the broker; ``info`` says what it waits for."""

# --- park ------------------------------------------------------------------------


def park(
    task: Any,
    demand: Mapping[str, int],
    key: str,
    max_waiting: int | None = None,
    priority: int = 0,
    share: str = "",
) -> None:
    """Write the running task's message to a ``ParkedTask`` row (once per
    task id: a woken task parked again keeps its place), its tickets under
    ``key``, the key its next run claims its permit with, ranked by
    ``priority`` and ``share`` key; then look for room.

    Raises:
        LineFull: ``max_waiting`` tasks already wait parked on one of its
            semaphores: nothing was written.
        SemaphoreError: the row could not be written (the caller retries
            the task as without parking, so it is not lost).
    """
    request = task.request
    signature = task.signature_from_request(request, request.args, request.kwargs)
    row = Row.of_celery(task, signature, key, priority=priority, share=share)
    alias, lined = _park(row, demand, max_waiting)
    set_state(task, demand)
    wake.wake(alias, lined.ids.values())
    if lined.rate_limits:
        # No release frees a slot: a wake-up for when the next one ends.
        wake.schedule_slots(alias, lined.rate_limits)


def defer(
    result_id: str,
    key: str,
    task_name: str,
    backend: str,
    demand: Mapping[str, int],
    max_waiting: int | None = None,
    priority: int = 0,
    share: str = "",
) -> None:
    """Park the running Django task of this result, deferred in its task
    ``backend`` (``deferred.hold``, once its run has ended), then look for
    room: a wake-up resumes it there, and its run claims its permit under
    ``key``.

    Raises:
        LineFull: as for ``park``.
        SemaphoreError: the row could not be written.
    """
    row = Row(result_id, key, task_name, backend=backend, priority=priority, share=share)
    alias, lined = _park(row, demand, max_waiting)
    wake.wake(alias, lined.ids.values())


def _park(
    row: Row, demand: Mapping[str, int], max_waiting: int | None
) -> tuple[str, wakeups.Lined]:
    """The task's row and its tickets; its semaphores' alias, and where its
    tickets were taken."""
    alias = routing.alias_for_names(list(demand))
    connection = connections[alias]
    insert = functools.partial(_insert, connection, row, dict(demand), max_waiting)
    return alias, run_with_retries(connection, insert)


def _insert(
    connection: BaseDatabaseWrapper, row: Row, demand: dict[str, int], max_waiting: int | None
) -> wakeups.Lined:
    """The row and its tickets in one transaction (a task parked again keeps
    both, and so its place in line, unless its key changed); a new one only
    while fewer than ``max_waiting`` wait parked on each of its semaphores,
    counted under their row locks (``line_up``'s), so never more."""
    alias = connection.alias
    with backends.bounded_transaction(connection, app_settings.LOCK_WAIT_TIMEOUT):
        lined = wakeups.line_up(
            connection, row.key, demand, row.expires_at, priority=row.priority, share=row.share
        )
        parked_before = ParkedTask.objects.using(alias).filter(task_id=row.task_id)
        before = parked_before.values_list("key", flat=True).first()
        if before is None and max_waiting is not None:
            refuse_a_full_line(alias, row, lined, max_waiting)
        if before is not None:
            if before != row.key:
                # A permit under its old key was released meanwhile: the
                # tickets under that key would hold back its own run.
                raw_delete(Ticket.objects.using(alias).filter(external_id=before))
            parked_before.update(woken_at=None, key=row.key)
            return lined
        with suppress(IntegrityError):  # unless another copy of this task parked it first
            write(alias, row)
    return lined


def refuse_a_full_line(alias: str, row: Row, lined: wakeups.Lined, max_waiting: int) -> None:
    """Raise ``LineFull`` (rolling back the tickets just taken) when
    ``max_waiting`` parked tasks other than ``row``'s -- of its share key,
    where it has one -- wait on a semaphore. A task sent or woken
    (published, its room kept) that has not started yet waits no more: it
    does not count."""
    waiting = (
        Ticket.objects.using(alias)
        .filter(semaphore__in=lined.ids.values(), parked__id__isnull=False)
        .filter(parked__woken_at__isnull=True, expires_at__gt=backends.DatabaseNow())
        .filter(**({"share": row.share} if row.share else {}))
        .exclude(external_id=row.key)
        .values_list("semaphore__name")
        .annotate(n=Count("pk"))
        .filter(n__gte=max_waiting)
    )
    if full := sorted(waiting):
        of = f" of share {row.share!r}" if row.share else ""
        told = "; ".join(f"{n} tasks{of} already wait parked on {name}" for name, n in full)
        raise LineFull([name for name, _ in full], f"{told}.")


def set_state(task: Any, demand: Mapping[str, int], task_id: str | None = None) -> None:
    """Record ``PARKED`` for the running task (or ``task_id``) in the result
    backend, if the task keeps results."""
    if task.ignore_result or (task_id is None and task.request.ignore_result):
        return
    task_id = task_id or task.request.id
    try:
        task.update_state(task_id=task_id, state=PARKED, meta={"semaphores": dict(demand)})
    except Exception:  # a disabled or unreachable backend must not lose the task
        logger.warning("Could not record the PARKED state of %s", task_id, exc_info=True)


def started(task_id: str, demand: Mapping[str, int]) -> None:
    """The task holds its permit now: its parked row and its tickets, if any,
    have done their job."""
    alias = routing.alias_for_names(list(demand))
    # By key and without Django's collector (which reads the rows first): a
    # run that was not parked pays one indexed read.
    parked = ParkedTask.objects.using(alias).filter(task_id=task_id)
    keys = list(parked.values_list("key", flat=True))
    if keys:
        # Its tickets too, unless its grant deleted them (where the line was live).
        drop_parked(alias, keys)
        rate_limits = set(
            Semaphore.objects.using(alias)
            .rate_limits()
            .filter(name__in=list(demand))
            .values_list("id", flat=True)
        )
        if rate_limits:
            # It took a slot there: the tasks parked behind it are woken
            # when that slot, or an earlier one, ends.
            wake.schedule_slots(alias, rate_limits)


def finished_before(task_id: str) -> bool:
    """Whether a run of this task id already ended for good (its permit was
    released by its holder): a copy arriving now is a duplicate."""
    return (
        PermitRequest.objects.using(routing.alias_for_key(task_id))
        .filter(external_id=task_id, release_reason=ReleaseReason.RELEASED)
        .exists()
    )


def on_task_revoked(request: Any = None, **kwargs: Any) -> None:
    """``task_revoked`` receiver (connected in every process, as the worker's
    main process discards revoked and expired messages): a parked task
    revoked or expired while woken is dropped and gives its room back. One
    indexed read per revoked task that was not parked."""
    task_id = getattr(request, "id", None)
    if task_id is not None:
        cancel([task_id])


def cancel(task_ids: Iterable[str]) -> int:
    """Drop these parked tasks (never published again); returns how many.

    The room their tickets kept (woken, or lacking it) is offered to the
    next in line.

    Raises:
        InvalidRequest: ``task_ids`` given as one str, or holding an id no
            task could have; nothing is dropped.
    """
    keys = validate_keys(task_ids, "task id")
    dropped = 0
    for alias in routing.aliases():
        parked = ParkedTask.objects.using(alias).filter(task_id__in=keys)
        found = list(parked.values_list("key", flat=True))
        lacking = Ticket.objects.using(alias).filter(external_id__in=found, lacked=True)
        semaphore_ids = set(lacking.values_list("semaphore_id", flat=True))
        dropped += drop_parked(alias, found)
        wake.wake(alias, semaphore_ids)
    return dropped


# --- switched on -------------------------------------------------------------------


_enabled = False


def enable() -> None:
    """Make this process's releases wake the parked tasks they make room for.

    Called by the first parking task a worker process runs and, with
    ``PARK_TASKS`` (the default), when the app is ready in every process;
    with ``PARK_TASKS`` off, call it from ``AppConfig.ready()`` of the web
    processes whose ``release()`` should wake tasks parked with
    ``park=True`` at once (otherwise the beat sweep does, within its
    interval). From then on each of this process's releases reads, after
    its commit, where parked tasks wait for the room it freed, and wakes
    them there (see ``docs/decisions.md``).
    """
    global _enabled
    _enabled = True


def disable() -> None:
    """Undo ``enable``: this process's releases wake nobody (the tests')."""
    global _enabled
    _enabled = False


def enabled() -> bool:
    """Whether this process's releases wake parked tasks (``enable``)."""
    return _enabled


def room_made(alias: str, semaphore_ids: Iterable[int]) -> None:
    """Wake the parked tasks that fit in the room a door's release, force
    release, sweep or raise made on these semaphores, once the caller's
    transaction commits (at once outside one) -- if this process wakes
    parked tasks (``enable``); the beat sweep is the backstop."""
    ids = set(semaphore_ids)
    if _enabled and ids:
        transaction.on_commit(functools.partial(wake.wake, alias, ids), using=alias)


def with_parked(queryset: QuerySet[Semaphore]) -> QuerySet[Semaphore]:
    """Annotate ``parked``, the Celery tasks parked on each semaphore (woken
    ones included); ``parked_since``, when the first of them in line parked,
    and ``oldest_parked``, how long ago that was by the database's clock (a
    ``timedelta``; both ``None`` when nothing is parked). For the admin,
    ``semaphore_status`` and the metrics, in the same query.

    Correlated subqueries on the line's index: the first in line is the
    parked task whose ticket there is first in line, then its
    ``parked_at`` by its unique key.
    """
    tickets = Ticket.objects.filter(parked__id__isnull=False).order_by()
    line = tickets.filter(semaphore=OuterRef("pk")).values("semaphore")
    first_in_line = (
        tickets.filter(semaphore=OuterRef(OuterRef("pk"))).in_line().values("external_id")[:1]
    )
    return queryset.annotate(
        parked=Coalesce(
            Subquery(line.annotate(number=Count("id")).values("number")),
            0,
            output_field=BigIntegerField(),
        ),
        parked_since=Subquery(
            ParkedTask.objects.filter(key=Subquery(first_in_line)).values("parked_at")
        ),
    ).annotate(oldest_parked=backends.DatabaseNow() - F("parked_since"))
