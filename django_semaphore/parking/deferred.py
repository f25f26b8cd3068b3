"""Django tasks deferred in their backend while they are parked: the result
row of django-tasks-db's ``DatabaseBackend`` goes back to ``READY`` with a
``run_after`` no worker reaches, and a wake-up brings that ``run_after``
to now. The only backend that can defer today; the others' runs wait in
their worker (``integrations.django_tasks``).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from importlib.util import find_spec
from typing import Any

from django.db import router, transaction
from django.db.models import Q
from django.utils import timezone

from django_semaphore import routing
from django_semaphore.exceptions import TaskDeferred
from django_semaphore.models import ParkedTask

# How a worker records the end of a run that was deferred.
DEFERRED = f"{TaskDeferred.__module__}.{TaskDeferred.__qualname__}"

# A run_after no worker reaches while the task is parked. Not the maximum
# date: django-tasks-db reads that as "no run_after", ready at once.
PARKED_UNTIL = datetime(9000, 1, 1, tzinfo=UTC)


def can_defer(backend: type) -> bool:
    """Whether runs of this task backend (class) can be deferred while parked."""
    if find_spec("django_tasks_db") is None:
        return False
    from django_tasks_db import DatabaseBackend

    return issubclass(backend, DatabaseBackend)


def hold(result_id: str, until: datetime | None = None) -> None:
    """The run of ``result_id`` ended deferred (its worker recorded it as
    failed): ``READY`` again, to run at ``until`` -- or, parked, once a
    wake-up says so (at once if one already did). If this fails, the
    wake-up's ``resume`` finds the row as its worker left it."""
    alias = routing.current_alias()
    with transaction.atomic(using=alias):
        if until is None:
            parked = ParkedTask.objects.using(alias).select_for_update()
            # Locked: a wake-up marking it woken meanwhile comes before or
            # after this, never between the read and the write.
            woken_at = parked.filter(task_id=result_id).values_list("woken_at", flat=True).first()
            until = PARKED_UNTIL if woken_at is None else timezone.now()
        _waiting(result_id).update(run_after=until, **_READY)


def park(result_id: str, debounce: timedelta | None = None) -> None:
    """A result just enqueued waits parked (in the transaction that parked
    it): no worker takes it until a wake-up resumes it -- or, debounced,
    until ``debounce`` has passed (its run then claims its permit as any
    run does)."""
    until = PARKED_UNTIL if debounce is None else timezone.now() + debounce
    _waiting(result_id).update(run_after=until)


def drop(result_ids: list[str], reason: type[Exception]) -> None:
    """These parked results never run: recorded as failed with ``reason``."""
    path = f"{reason.__module__}.{reason.__qualname__}"
    _waiting(result_ids).update(
        status="FAILED", finished_at=timezone.now(), exception_class_path=path, traceback=""
    )


def alias() -> str:
    """The database django-tasks-db writes its results to."""
    from django_tasks_db.models import DBTaskResult

    return router.db_for_write(DBTaskResult)


def resume(result_id: str) -> bool:
    """Run the parked ``result_id`` now; whether its row was waiting (one
    whose run has not ended yet is resumed by ``hold``)."""
    return bool(_waiting(result_id).update(run_after=timezone.now(), **_READY))


# A result ready to run again, with nothing of the deferred run's end left.
_READY = {
    "status": "READY",
    "finished_at": None,
    "exception_class_path": "",
    "traceback": "",
    "return_value": None,
}


def _waiting(result_ids: str | list[str]) -> Any:
    """The rows of these results that wait: ready, or ended deferred."""
    from django_tasks_db.models import DBTaskResult

    deferred_end = Q(status="FAILED", exception_class_path=DEFERRED)
    ids = [result_ids] if isinstance(result_ids, str) else result_ids
    return DBTaskResult.objects.filter(Q(status="READY") | deferred_end, id__in=ids)
