"""Owner liveness checkers: is the process named in a request's ``owner`` alive?

A checker answers ``ALIVE``, ``DEAD`` or ``UNKNOWN`` for each owner string it
is asked about. Checkers are listed by dotted path in
``DJANGO_SEMAPHORE["LIVENESS_CHECKERS"]``; each path names a
[`LivenessChecker`][django_semaphore.liveness.LivenessChecker] subclass or a
plain function ``owner -> Liveness``. The
[`ProcessTableChecker`][django_semaphore.liveness.ProcessTableChecker] is
always asked first.
Only ``DEAD`` ever releases a permit, and only when no checker says ``ALIVE``:
a checker that is unsure, fails or times out has said nothing.
"""

from __future__ import annotations

import enum
import importlib
import logging
from collections.abc import Callable, Collection, Mapping
from importlib.util import find_spec
from typing import Any

from django.utils.module_loading import import_string

from django_semaphore.conf import app_settings
from django_semaphore.owners import NO_PROCESS, TaskOwner, gone_from_this_machine

logger = logging.getLogger("django_semaphore")

# The task is finished for good: its ``holds_permit`` run will not come back.
# (celery.states.READY_STATES, without importing Celery here.)
CELERY_READY_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED"})


class Liveness(enum.Enum):
    """A checker's answer about an owner. Only ``DEAD`` releases its permits:
    a checker that cannot tell says ``UNKNOWN``, and the permit stays."""

    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"


class LivenessChecker:
    """Base class: override
    [`check_owner`][django_semaphore.liveness.LivenessChecker.check_owner], or
    [`check`][django_semaphore.liveness.LivenessChecker.check] to answer a
    whole batch at once (one network round trip instead of one per owner)."""

    def check(self, owners: Collection[str]) -> Mapping[str, Liveness]:
        """Judge a batch of owners; the sweep calls this once per batch.

        Args:
            owners: owner strings as stored in ``PermitRequest.owner``.

        Returns:
            An answer for every owner; only ``DEAD`` releases a permit.
        """
        return {owner: self.check_owner(owner) for owner in owners}

    def check_owner(self, owner: str) -> Liveness:
        """Judge one owner; the default knows nothing (``UNKNOWN``).

        Args:
            owner: an owner string as stored in ``PermitRequest.owner``.
        """
        return Liveness.UNKNOWN


class ProcessTableChecker(LivenessChecker):
    """DEAD for an owner whose process ran on this machine and is gone from
    its process table (``owners.gone_from_this_machine``: the owner ends
    with ``<host> pid <pid> started <ticks>``, as every owner this package
    writes does); UNKNOWN for any other. Never ALIVE: a worker process
    outlives the task runs whose permits it held. Always asked, whatever
    ``LIVENESS_CHECKERS`` lists."""

    def check_owner(self, owner: str) -> Liveness:
        return Liveness.DEAD if gone_from_this_machine(owner) else Liveness.UNKNOWN


class _FunctionChecker(LivenessChecker):
    def __init__(self, function: Callable[[str], Liveness]) -> None:
        self.function = function

    def check_owner(self, owner: str) -> Liveness:
        return self.function(owner)


def load_checkers(paths: Collection[str] | None = None) -> list[LivenessChecker]:
    """Instantiate the configured checkers (a class is instantiated with no
    arguments, a function is wrapped)."""
    checkers: list[LivenessChecker] = []
    for path in app_settings.LIVENESS_CHECKERS if paths is None else paths:
        target = import_string(path)
        if isinstance(target, type):
            checkers.append(target())
        elif isinstance(target, LivenessChecker):
            checkers.append(target)
        else:
            checkers.append(_FunctionChecker(target))
    return checkers


def dead_owners(
    owners: Collection[str], checkers: Collection[LivenessChecker] | None = None
) -> set[str]:
    """The owners that some checker (the ``ProcessTableChecker`` or one of
    ``checkers``, default ``LIVENESS_CHECKERS``) says are dead and none says
    are alive.

    A checker that raises is logged and counts as ``UNKNOWN`` for all of them.
    """
    candidates = {owner for owner in owners if owner}
    if not candidates:
        return set()
    verdicts: dict[str, set[Liveness]] = {owner: set() for owner in candidates}
    for checker in [ProcessTableChecker(), *(load_checkers() if checkers is None else checkers)]:
        try:
            answers = checker.check(sorted(candidates))
        except Exception:
            logger.exception("Liveness checker %r failed; its owners count as unknown", checker)
            continue
        for owner, answer in answers.items():
            if owner in verdicts and isinstance(answer, Liveness):
                verdicts[owner].add(answer)
    return {
        owner
        for owner, answers in verdicts.items()
        if Liveness.DEAD in answers and Liveness.ALIVE not in answers
    }


def is_dead(owner: str) -> bool:
    """Whether the configured checkers agree that ``owner`` is dead."""
    return owner in dead_owners([owner])


# --- Celery ------------------------------------------------------------------


# Task id -> [(node name, state, worker pid)] for every worker that knows it.
_Known = dict[str, list[tuple[str, str, int | None]]]


class CeleryTaskChecker(LivenessChecker):
    """Judges owners written by ``holds_permit`` on Celery tasks (``TaskOwner``:
    ``task:<id> <name> on <worker node> pid <pid>``); any other owner is UNKNOWN.

    DEAD only when sure, after asking every worker with one ``query_task``
    broadcast (which reports tasks running, waiting for a pool slot, or held
    for an ETA/countdown) and the result backend:

    - no worker that answered knows the task (a task that is received but not
      started yet, or waiting for its retry's countdown, is known: not dead), and
    - the result backend says the task is in a ready state (SUCCESS, FAILURE,
      REVOKED): it finished for good, or
    - the owner names a running process (pid > 0) and *its own worker
      answered*: that worker would list the task if that process still ran it.
      The worker named in the owner is the only one that can run that process,
      so "every worker that could know it answered" holds. A silent worker
      (down, partitioned, or a solo pool busy with a long task) leaves the
      owner UNKNOWN.

    A parked owner (pid 0: kept between the task's own retries, the task will
    run again) is DEAD only when the result backend says the task is ready: its
    retry message may be sitting in the broker, where no worker knows it yet.

    The sweep re-reads each owner under a row lock *after* this answer and
    releases only if it is unchanged, so a run that adopted the permit
    meanwhile (a retry, a redelivery) is never released by an old verdict.

    Subclass to point it at another app (``app``) or to wait longer for
    worker replies (``timeout``, seconds).
    """

    app: Any = None  # default: celery.current_app
    timeout: float = 1.0

    def get_app(self) -> Any:
        """The Celery app to ask: ``app`` if set, else Celery's current app
        (imported late, so this module loads without Celery installed)."""
        if self.app is not None:
            return self.app
        from celery import current_app

        return current_app

    def check(self, owners: Collection[str]) -> Mapping[str, Liveness]:
        tasks = {owner: task for owner in owners if (task := TaskOwner.parse(owner)) is not None}
        answers = dict.fromkeys(owners, Liveness.UNKNOWN)
        if tasks:
            answered, known = self._inspect(sorted({task.task_id for task in tasks.values()}))
            for owner, task in tasks.items():
                answers[owner] = self._judge(task, answered, known)
        return answers

    def _judge(self, task: TaskOwner, answered: set[str], known_by_id: _Known) -> Liveness:
        known = known_by_id.get(task.task_id, [])
        if any(
            node == task.hostname and state == "active" and pid in (task.pid, None)
            for node, state, pid in known
        ):
            return Liveness.ALIVE
        if known:
            # Another run, or the next one, is on its way: it settles the permit.
            return Liveness.UNKNOWN
        if self._is_ready(task.task_id) or (task.pid != NO_PROCESS and task.hostname in answered):
            return Liveness.DEAD
        return Liveness.UNKNOWN

    def _inspect(self, task_ids: list[str]) -> tuple[set[str], _Known]:
        """The worker nodes that answered, and what they know of these tasks."""
        replies = self.get_app().control.inspect(timeout=self.timeout).query_task(*task_ids) or {}
        known: _Known = {}
        for node, tasks in replies.items():
            for task_id, (state, info) in (tasks or {}).items():
                pid = info.get("worker_pid") if isinstance(info, Mapping) else None
                known.setdefault(task_id, []).append((node, state, pid))
        return set(replies), known

    def _is_ready(self, task_id: str) -> bool:
        try:
            state = self.get_app().AsyncResult(task_id).state
        except Exception:
            # No result backend configured, or it is unreachable: cannot tell.
            logger.debug("No task state for %s", task_id, exc_info=True)
            return False
        return state in CELERY_READY_STATES


# --- Django's own tasks ------------------------------------------------------


class DjangoTaskChecker(LivenessChecker):
    """Judges owners written by ``holds_permit`` on Django's own tasks
    (``TaskOwner``, whose task id is the task result's id) by asking each
    task backend that keeps results (``supports_get_result``: the database
    and RQ backends, not the immediate one). Any other owner, and a result
    no backend knows, is UNKNOWN.

    DEAD when a backend says the result finished (SUCCESSFUL or FAILED):
    its run released the permit before its backend recorded the end, so a
    permit still held is one whose release failed. Never ALIVE: a RUNNING
    result may be a killed worker's (django-tasks-db leaves it RUNNING),
    which the lease settles, or sooner the ``ProcessTableChecker`` on the
    worker's machine. A result run again meanwhile (a requeue) takes
    the permit over, and the sweep, re-reading the owner under the row lock,
    leaves it to the new run.
    """

    def check(self, owners: Collection[str]) -> Mapping[str, Liveness]:
        answers = dict.fromkeys(owners, Liveness.UNKNOWN)
        backends = _result_backends()
        for owner in owners:
            task = TaskOwner.parse(owner)
            if task is not None and any(_finished(backend, task.task_id) for backend in backends):
                answers[owner] = Liveness.DEAD
        return answers


def _result_backends() -> list[Any]:
    """The configured task backends that keep results: ``django.tasks`` from
    Django 6 (it loads the backport's backends too), else the backport."""
    framework = next((name for name in ("django.tasks", "django_tasks") if find_spec(name)), None)
    if framework is None:
        return []
    backends = importlib.import_module(framework).task_backends.all()
    return [backend for backend in backends if backend.supports_get_result]


def _finished(backend: Any, result_id: str) -> bool:
    try:
        return bool(backend.get_result(result_id).is_finished)
    except Exception:
        # Not this backend's result, or it is unreachable: cannot tell.
        logger.debug("No result %s in task backend %s", result_id, backend.alias, exc_info=True)
        return False
