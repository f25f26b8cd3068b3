"""A parked task's row: what it is written with, a Celery task's message
as its serializer encodes it, and the plain writes of the rows."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from django_semaphore import backends
from django_semaphore.models import ParkedTask, Ticket


@dataclass(frozen=True)
class Row:
    """What a parked task's row is written with (``ParkedTask``'s fields)."""

    task_id: str
    key: str
    task_name: str
    # A Celery task's message; none for a Django task, whose result waits
    # in its ``backend``.
    body: bytes = b""
    content_type: str = ""
    encoding: str = ""
    expires_at: datetime | None = None
    backend: str = ""
    priority: int = 0  # where its tickets rank in line (not a column of the row)
    share: str = ""  # its share key in line (neither)

    @classmethod
    def of_celery(
        cls,
        task: Any,
        signature: Any,
        key: str | None = None,
        *,
        priority: int = 0,
        share: str = "",
    ) -> Row:
        """A Celery task's row: its ``signature`` (with its ``task_id`` and
        ``expires``) as its serializer encodes it; ``key``: the task id's."""
        task_id = signature.options["task_id"]
        expires = _expiry(signature.options.get("expires"))
        encoded = _encode(task, signature)
        return cls(task_id, key or task_id, task.name, *encoded, expires, "", priority, share)


def _encode(task: Any, signature: Any) -> tuple[bytes, str, str]:
    """A task's message as its serializer encodes it: body, content type
    and encoding (``kombu.serialization``)."""
    from kombu import serialization

    content_type, encoding, body = serialization.dumps(  # type: ignore[no-untyped-call]
        dict(signature), serializer=task.serializer
    )
    if isinstance(body, str):
        body = body.encode(encoding)
    return bytes(body), content_type, encoding


def _expiry(expires: Any) -> datetime | None:
    """A task's ``expires`` (a datetime, or ISO text as a worker's request
    has it; naive is UTC, as Celery sends it) as an aware datetime."""
    from celery.utils.time import maybe_iso8601

    if expires is None:
        return None
    moment = expires if isinstance(expires, datetime) else maybe_iso8601(expires)
    return moment if timezone.is_aware(moment) else timezone.make_aware(moment, UTC)


def write(alias: str, row: Row, **state: Any) -> ParkedTask:
    """Write ``row`` (with ``state``: ``woken_at``, ``not_before``) in a
    savepoint of the caller's transaction.

    Raises:
        IntegrityError: its task id or key is parked already (nothing written).
    """
    with transaction.atomic(using=alias):
        return ParkedTask.objects.using(alias).create(
            task_id=row.task_id,
            key=row.key,
            task_name=row.task_name,
            backend=row.backend,
            body=row.body,
            content_type=row.content_type,
            content_encoding=row.encoding,
            # The database's clock, as the age the console shows is read
            # from it (parking.with_parked).
            parked_at=backends.StatementNow(),
            expires_at=row.expires_at,
            **state,
        )


def raw_delete(queryset: QuerySet[Any]) -> int:
    """Delete these rows by one statement, without Django's collector
    (which reads them first); how many."""
    return int(queryset._raw_delete(queryset.db))


def drop_parked(alias: str, keys: Collection[str]) -> int:
    """Delete the parked tasks of these keys and their tickets, by key (a
    delete through a subquery would lock, and wait for, the rows it reads);
    how many tasks."""
    if not keys:
        return 0
    raw_delete(Ticket.objects.using(alias).filter(external_id__in=list(keys)))
    return raw_delete(ParkedTask.objects.using(alias).filter(key__in=list(keys)))
