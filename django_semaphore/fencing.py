"""Fencing for downstream resources (Kleppmann): reject a stale holder's write.

A TTL can expire while its holder is paused; a newer holder then gets a higher
token. A resource that calls [`advance`][django_semaphore.fencing.advance]
with the token before each write refuses the old holder when it wakes up.
Call it in the same transaction as the write it guards so that the check and
the write commit together.
"""

from __future__ import annotations

from contextlib import suppress

from django.conf import settings
from django.db import IntegrityError, connections, transaction

from django_semaphore import routing
from django_semaphore.exceptions import InvalidRequest, StaleFencingToken
from django_semaphore.models import FencingMark
from django_semaphore.retry import run_with_retries
from django_semaphore.validation import validate_text, validate_token


def advance(resource: str, token: int, *, using: str | None = None) -> None:
    """Record ``token`` as the highest seen for ``resource``, or refuse it.

    Equal tokens pass (one holder writing twice). Atomic under concurrency:
    the check and the update are one conditional statement.

    Args:
        resource: names what is guarded, e.g. ``"s3://bucket/report.csv"``.
        token: the fencing token of the permit held for the write.
        using: database alias of the fencing table; defaults to the app's.

    Raises:
        StaleFencingToken: a higher token was already seen for ``resource``.
        InvalidRequest: an empty or over-long resource, a token that is not an
            int from 0 to ``2**63 - 1`` (what the column holds on every
            database), or ``using`` that is not a ``DATABASES`` alias; nothing
            is written.
    """
    if resource == "":
        raise InvalidRequest("The fencing resource must be a non-empty str.")
    validate_text(resource, "fencing resource", blank=True)  # "  " is a resource
    validate_token(token)
    if using is not None and not (isinstance(using, str) and using in settings.DATABASES):
        raise InvalidRequest(f"using must be a DATABASES alias, not {using!r}.")
    connection = connections[using or routing.current_alias()]
    run_with_retries(connection, lambda: _advance(connection.alias, resource, token))


def _advance(alias: str, resource: str, token: int) -> None:
    marks = FencingMark.objects.using(alias)
    if marks.filter(resource=resource, token__lte=token).update(token=token):
        return
    # Savepoint: a duplicate insert must not spoil the caller's transaction;
    # one means another writer recorded the resource first: compare with it.
    with suppress(IntegrityError), transaction.atomic(using=alias):
        marks.create(resource=resource, token=token)
        return
    if marks.filter(resource=resource, token__lte=token).update(token=token):
        return
    highest = marks.values_list("token", flat=True).get(resource=resource)
    raise StaleFencingToken(resource, token, highest)
