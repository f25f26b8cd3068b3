"""What Django's ORM may write to the app's rows, and what it is refused.

The engine (``grant.py``, ``releasing.py``, ``fairness.py``, the sweeps) writes permits, request
states and the semaphore's engine-owned columns with its own statements, in
the transactions that keep them consistent. Ordinary ORM calls made on the
models by a project (a shell, a data migration, a script) go through here:

- ``QuerySet.update()``, ``bulk_update()`` and ``bulk_create(update_conflicts=True)``
  of a column only the engine may write raise :class:`UnsafeWrite`, naming the
  call to use instead (``set_capacity``, ``release``, ``force_release``).
- ``bulk_create()`` of requests or permits raises :class:`UnsafeWrite`:
  only ``acquire()`` creates them.
- ``delete()`` of a held semaphore, request or permit raises
  :class:`PermitHeld` (a ``pre_delete`` receiver, so it covers instances,
  querysets, cascades and the admin alike).
- ``save()`` is guarded in ``models.py`` (``GuardedModel``, ``Semaphore``).

What no Python hook sees (raw SQL, ``QuerySet._raw_delete()``, ``TRUNCATE``,
``flush``, a restore from backup) is repaired by the orphan sweep and reported
by ``check --database``; docs/concepts.md lists the calls to use instead.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import models

from django_semaphore.exceptions import PermitHeld, UnsafeWrite

if TYPE_CHECKING:
    from django_semaphore.models import Permit, PermitRequest, Semaphore

M = TypeVar("M", bound=models.Model)

ACQUIRED = "ACQUIRED"  # models.State.ACQUIRED, without importing models here

_engine_writing: ContextVar[bool] = ContextVar("django_semaphore_engine_writing", default=False)


@contextmanager
def engine_writes() -> Iterator[None]:
    """Mark the engine's own ORM writes (the capacity change under its row
    lock, fair mode's ``queued_until``): the guards let them through. Also
    for tools that reset the tables wholesale (the benchmarks' fixtures).

    A context variable, so it holds for this thread (or task) only: another
    thread's ``update()`` at the same moment is still refused.
    """
    token = _engine_writing.set(True)
    try:
        yield
    finally:
        _engine_writing.reset(token)


def engine_is_writing() -> bool:
    return _engine_writing.get()


class GuardedQuerySet(models.QuerySet[M]):
    """Refuses bulk writes of the fields the model lists in ``ORM_REFUSED``
    (field name -> what to call instead)."""

    def _refuse(self, names: Iterable[str], call: str) -> None:
        if engine_is_writing():
            return
        refused: dict[str, str] = getattr(self.model, "ORM_REFUSED", {})
        for name in names:
            # update(semaphore_id=...) names the column by its attname.
            field = self.model._meta.get_field(name.removesuffix("_id"))
            instead = refused.get(field.name)
            if instead is not None:
                raise UnsafeWrite(
                    f"{self.model.__name__}.objects.{call}() may not write {field.name!r}: "
                    f"{instead}"
                )

    def update(self, **kwargs: Any) -> int:
        self._refuse(kwargs, "update")
        return super().update(**kwargs)

    def bulk_update(
        self, objs: Iterable[M], fields: Iterable[str], batch_size: int | None = None
    ) -> int:
        fields = list(fields)
        self._refuse(fields, "bulk_update")
        return super().bulk_update(objs, fields, batch_size=batch_size)

    def bulk_create(
        self,
        objs: Iterable[M],
        batch_size: int | None = None,
        ignore_conflicts: bool = False,
        update_conflicts: bool = False,
        update_fields: Collection[str] | None = None,
        unique_fields: Collection[str] | None = None,
    ) -> list[M]:
        created_by = getattr(self.model, "CREATED_BY", "")
        if created_by and not engine_is_writing():
            raise UnsafeWrite(f"{self.model.__name__} rows are created only by {created_by}.")
        # New rows may carry any value, as objects.create() may: nothing refers
        # to them yet. Rows updated on conflict are existing rows.
        if update_conflicts and update_fields:
            self._refuse(update_fields, "bulk_create(update_conflicts=True)")
        return super().bulk_create(
            objs,
            batch_size=batch_size,
            ignore_conflicts=ignore_conflicts,
            update_conflicts=update_conflicts,
            update_fields=update_fields,
            unique_fields=unique_fields,
        )


# --- deletes (pre_delete receivers, connected in apps.py) ---------------------------

RELEASE_FIRST = (
    "release it first: release(key) by its holder, or force-release it "
    "(the admin's action, manage.py semaphore_release KEY, sweep.force_release)."
)


def refuse_deleting_held_semaphore(
    sender: type[Semaphore], instance: Semaphore, using: str, **kwargs: Any
) -> None:
    """Deleting a held semaphore would end its holders' permits silently."""
    from django_semaphore.models import Permit, Semaphore

    if engine_is_writing():
        return
    # Under the row lock (the delete's own transaction): a grant committed
    # after Django collected the permits to delete is seen here, and no new
    # one starts until the delete commits.
    Semaphore.objects.using(using).select_for_update().filter(pk=instance.pk).exists()
    holders = (
        Permit.objects.using(using)
        .filter(semaphore_id=instance.pk, state=ACQUIRED)
        .values("request_id")
        .distinct()
        .count()
    )
    if holders:
        raise PermitHeld(
            f"Semaphore {instance.name!r} is held by {holders} request(s) and cannot be "
            f"deleted: {RELEASE_FIRST}"
        )


def refuse_deleting_held_request(
    sender: type[PermitRequest], instance: PermitRequest, using: str, **kwargs: Any
) -> None:
    # ACQUIRED -> RELEASED is one-way: an instance loaded RELEASED is still
    # released; one loaded ACQUIRED may have been released since (refused
    # all the same: reload it).
    if instance.state == ACQUIRED and not engine_is_writing():
        raise PermitHeld(
            f"Permit request {instance.external_id!r} is held and cannot be deleted: "
            f"{RELEASE_FIRST}"
        )


def refuse_deleting_held_permit(
    sender: type[Permit], instance: Permit, using: str, **kwargs: Any
) -> None:
    if instance.state == ACQUIRED and not engine_is_writing():
        raise PermitHeld(
            f"Permit {instance} is held and cannot be deleted: release its request first "
            f"(or, if its request is already released, run manage.py semaphore_sweep "
            f"--orphans, which frees it)."
        )
