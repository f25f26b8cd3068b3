"""What Django's ORM may write to the app's rows, and what it is refused.

The engine (``engine/``: grants, releases, the line, repairs) writes
permits, request states and the semaphore's engine-owned columns with its
own statements, in the transactions that keep them consistent. Ordinary ORM calls made on the
models by a project (a shell, a data migration, a script) go through here:

- ``QuerySet.update()``, ``bulk_update()`` and ``bulk_create(update_conflicts=True)``
  of a column only the engine may write raise :class:`UnsafeWrite`, naming the
  call to use instead (``set_capacity``, ``release``, ``force_release``).
- ``bulk_create()`` of requests or permits raises :class:`UnsafeWrite`:
  only ``acquire()`` creates them.
- ``delete()`` of a held semaphore, request or permit raises
  :class:`PermitHeld`, and of a semaphore waiters or parked tasks wait
  on :class:`WaitersInLine` (``pre_delete`` receivers beside each model, so
  it covers instances, querysets, cascades and the admin alike).
- ``save()`` is guarded by ``GuardedModel`` (and ``Semaphore.save()``).

What no Python hook sees (raw SQL, ``QuerySet._raw_delete()``, ``TRUNCATE``,
``flush``, a restore from backup) is repaired by the orphan sweep and reported
by ``check --database``; docs/concepts.md lists the calls to use instead.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ClassVar, Self, TypeVar

from django.db import models

from django_semaphore.exceptions import UnsafeWrite

M = TypeVar("M", bound=models.Model)

_engine_writing: ContextVar[bool] = ContextVar("django_semaphore_engine_writing", default=False)


@contextmanager
def engine_writes() -> Iterator[None]:
    """Mark the engine's own ORM writes (the capacity change under its row
    lock, the line's ``queued_until``): the guards let them through. Also
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


# --- save() ---------------------------------------------------------------------

# A sentinel: an instance built by hand, whose values nobody loaded.
_NOT_LOADED = object()


class GuardedModel(models.Model):
    """A model whose rows the engine writes, wholly or in part.

    ``save()`` of an existing row never writes back an engine-owned column
    the instance did not change (the instance's copy is stale the moment the
    engine writes the row), and refuses one it did change if ``ORM_REFUSED``
    names it; ``CREATED_BY``, when set, refuses creating rows outside the
    engine. Bulk calls are guarded by ``guards.GuardedQuerySet``.
    """

    # The columns written only by the engine's own statements.
    ENGINE_OWNED_FIELDS: ClassVar[tuple[str, ...]] = ()
    # Field name -> what to call instead; an ORM write of it is refused.
    ORM_REFUSED: ClassVar[dict[str, str]] = {}
    # What creates the rows, when only the engine may.
    CREATED_BY: ClassVar[str] = ""

    class Meta:
        abstract = True

    def save(
        self,
        *,
        force_insert: bool | tuple[models.base.ModelBase, ...] = False,
        force_update: bool = False,
        using: str | None = None,
        update_fields: Iterable[str] | None = None,
    ) -> None:
        """Create the row (where the ORM may), or write back what may be
        written of it.

        Raises:
            UnsafeWrite: a refused column was changed on the instance, or the
                row may only be created by the engine.
        """
        creating = self.pk is None or force_insert or self._state.adding
        if engine_is_writing() or (creating and not self.CREATED_BY):
            update = update_fields
        elif creating:
            raise UnsafeWrite(f"{type(self).__name__} rows are created only by {self.CREATED_BY}.")
        else:
            update = self._writable_fields(update_fields)
        super().save(
            force_insert=force_insert, force_update=force_update, using=using, update_fields=update
        )
        self._remember_loaded()

    @classmethod
    def from_db(
        cls, db: str | None, field_names: Collection[str], values: Collection[Any], **kwargs: Any
    ) -> Self:
        instance = super().from_db(db, field_names, values, **kwargs)
        instance._remember_loaded()
        return instance

    def refresh_from_db(
        self,
        using: str | None = None,
        fields: Iterable[str] | None = None,
        from_queryset: models.QuerySet[Any] | None = None,
    ) -> None:
        fields = None if fields is None else list(fields)
        super().refresh_from_db(using=using, fields=fields, from_queryset=from_queryset)
        self._remember_loaded(fields)

    def _remember_loaded(self, fields: Iterable[str] | None = None) -> None:
        """Keep the values save() compares with: what the database said."""
        # Also run when the grant builds its request, under the row locks:
        # only the few tracked fields are visited.
        loaded = self.__dict__.setdefault("_loaded", {})
        values = self.__dict__
        for name, attname in self._tracked_fields():
            # refresh_from_db() may name a field by its attname ("request_id").
            if (fields is None or name in fields or attname in fields) and attname in values:
                loaded[name] = values[attname]

    @classmethod
    @functools.cache
    def _tracked_fields(cls) -> tuple[tuple[str, str], ...]:
        """(name, attname) of the fields save() compares with their loaded value."""
        tracked = {*cls.ENGINE_OWNED_FIELDS, *cls.ORM_REFUSED}
        return tuple((f.name, f.attname) for f in cls._meta.concrete_fields if f.name in tracked)

    def _changed(self, name: str) -> bool:
        """Whether the instance's value differs from the one loaded (an
        instance built by hand has none: it counts as changed)."""
        attname = dict(self._tracked_fields())[name]
        current = self.__dict__.get(attname, _NOT_LOADED)
        return bool(self.__dict__.get("_loaded", {}).get(name, _NOT_LOADED) != current)

    def _writable_fields(self, update_fields: Iterable[str] | None) -> set[str]:
        """The fields save() writes on an existing row: an engine-owned one
        only if the instance changed it and the ORM may (a refused change is
        a mistake to report; unchanged ones are dropped, also when named:
        ``update_or_create()`` names every date field)."""
        if update_fields is None:
            deferred = self.get_deferred_fields()
            fields = self._meta.concrete_fields
            update_fields = [
                f.name for f in fields if not f.primary_key and f.attname not in deferred
            ]
        names = set(update_fields)
        loaded = self.__dict__.get("_loaded", {})
        for name in sorted(names & set(self.ENGINE_OWNED_FIELDS)):
            if name not in loaded or not self._changed(name):
                names.discard(name)
            elif name in self.ORM_REFUSED:
                raise UnsafeWrite(
                    f"{type(self).__name__}.save() may not write {name!r}: {self.ORM_REFUSED[name]}"
                )
        return names
