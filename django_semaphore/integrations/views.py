"""How a Django view holds permits (``@holds_permit`` on a view).

The permit is granted and committed before the view runs, then the view runs
in the transactions ``ATOMIC_REQUESTS`` asks for, and the permit is held until
the response has been sent (for a streaming response, until streaming ends or
the client goes away). When no permit can be had the view is not called:
``DJANGO_SEMAPHORE["REFUSED_VIEW"]`` answers, given a ``PermitRefused`` — 429
for no room, 503 when the database cannot be reached or stays locked. Every
other error (an unknown name, a bad demand, a nested transaction) is a bug of
the caller's and raises.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from typing import Any, cast

from asgiref.sync import sync_to_async
from django.db import connections, transaction
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse

from django_semaphore import api
from django_semaphore.conf import app_settings
from django_semaphore.exceptions import (
    DatabaseUnavailable,
    LockContention,
    PermitRefused,
    SemaphoreExhausted,
)
from django_semaphore.integrations.leases import Lease
from django_semaphore.integrations.options import Options
from django_semaphore.models import PermitRequest
from django_semaphore.owners import process_owner

logger = logging.getLogger("django_semaphore")


def run_view(
    func: Callable[..., Any],
    options: Options,
    request: HttpRequest,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Call the view holding a permit taken for this request, or answer
    429/503 without calling it; the permit ends once the response is sent."""
    held = _acquire_for_view(options, request)
    if isinstance(held, HttpResponseBase):
        return held
    lease = options.hold_lease(held.external_id)
    try:
        with _requested_transactions(func):
            response = func(*args, **kwargs)
    except BaseException:
        _finish(held.external_id, lease)
        raise
    return _release_when_sent(response, held.external_id, lease)


async def run_async_view(
    func: Callable[..., Any],
    options: Options,
    request: HttpRequest,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``run_view`` for an async view: the database calls run in a thread."""
    if _atomic_aliases(func):
        # What Django's handler says of an async view it would wrap itself.
        raise RuntimeError("You cannot use ATOMIC_REQUESTS with async views.")
    held = await sync_to_async(_acquire_for_view)(options, request)
    if isinstance(held, HttpResponseBase):
        return held
    lease = options.hold_lease(held.external_id)
    try:
        response = await func(*args, **kwargs)
    except BaseException:
        await sync_to_async(_finish)(held.external_id, lease)
        raise
    return _release_when_sent(response, held.external_id, lease)


def _atomic_aliases(view: Callable[..., Any]) -> list[str]:
    """The aliases whose ``ATOMIC_REQUESTS`` Django's handler would have
    applied to the view: every one but those the view itself opts out of
    (``@transaction.non_atomic_requests`` under ``@holds_permit``)."""
    opted_out: set[str] = getattr(view, "_non_atomic_requests", set())
    return [
        alias
        for alias, database in connections.settings.items()
        if database["ATOMIC_REQUESTS"] and alias not in opted_out
    ]


def _requested_transactions(view: Callable[..., Any]) -> ExitStack:
    """The transactions ``ATOMIC_REQUESTS`` asks for around the view, opened
    once the permit has committed (inside them it would stay uncommitted and
    its row locked until the view returned)."""
    stack = ExitStack()
    for alias in _atomic_aliases(view):
        stack.enter_context(transaction.atomic(using=alias))
    return stack


def _view_owner(options: Options, request: HttpRequest) -> str:
    user = getattr(request, "user", None)
    who = user.get_username() if user is not None and user.is_authenticated else "anonymous"
    remote = request.META.get("REMOTE_ADDR", "?")
    # Trimmed by its label, never its process: the sweep reads that back.
    return process_owner(f"view {options.label} for {who} from {remote}")


def _acquire_for_view(options: Options, request: HttpRequest) -> PermitRequest | HttpResponseBase:
    """Acquire for a view, under a fresh key: the request held, or the
    refusal to send instead."""
    try:
        return options.acquire(uuid.uuid4().hex, _view_owner(options, request), options.timeout)
    except SemaphoreExhausted as exc:
        logger.info("%s refused: %s", options.label, exc)
        # A rate limit knows when its next slot frees; a concurrency limit
        # frees room when its holders release, which the option guesses.
        wait = options.retry_after if exc.retry_after is None else math.ceil(exc.retry_after)
        refusal = PermitRefused(app_settings.VIEW_STATUS_CODE, wait, exc.names)
        return _render(request, refusal, exc)
    except (LockContention, DatabaseUnavailable) as exc:
        logger.error("%s refused, the semaphore could not be reached: %s", options.label, exc)
        return _render(request, PermitRefused(503, options.retry_after), exc)


def _render(request: HttpRequest, refusal: PermitRefused, cause: Exception) -> HttpResponseBase:
    refusal.__cause__ = cause
    return cast(HttpResponseBase, app_settings.REFUSED_VIEW(request, refusal))


def _finish(key: str, lease: Lease | None) -> None:
    if lease is not None:
        lease.drop()
    api.release(key)


def _release_when_sent(response: Any, key: str, lease: Lease | None) -> Any:
    """Keep the permit until the server has sent the response.

    Servers call ``close()`` on a response once it is sent, or once the client
    went away mid-stream; that is when the work the permit guards is done.
    """
    if not isinstance(response, HttpResponseBase):
        _finish(key, lease)
        return response
    closed = False

    def release_once() -> None:
        nonlocal closed
        if not closed:
            closed = True
            _finish(key, lease)

    # Django's own responses (FileResponse) register closers the same way.
    response._resource_closers.append(release_once)  # type: ignore[attr-defined]
    if isinstance(response, StreamingHttpResponse):
        response.streaming_content = _closing(response, release_once)
    return response


def _closing(response: StreamingHttpResponse, release: Callable[[], None]) -> Any:
    """Also release when iteration ends, for servers that never call close()."""
    content = response.streaming_content  # read before it is replaced
    if response.is_async:
        return _aclosing(cast(AsyncIterator[bytes], content), release)
    return _sync_closing(cast(Iterator[bytes], content), release)


def _sync_closing(content: Iterator[bytes], release: Callable[[], None]) -> Iterator[bytes]:
    try:
        yield from content
    finally:
        release()


async def _aclosing(
    content: AsyncIterator[bytes], release: Callable[[], None]
) -> AsyncIterator[bytes]:
    try:
        async for chunk in content:
            yield chunk
    finally:
        await sync_to_async(release)()


def permit_refused(request: HttpRequest, exception: PermitRefused) -> HttpResponse:
    """The default answer to a refused request (``DJANGO_SEMAPHORE["REFUSED_VIEW"]``):
    empty, with the refusal's status and ``Retry-After``.

    A project renders its own page by naming another view, with the same
    arguments, in ``DJANGO_SEMAPHORE["REFUSED_VIEW"]``.
    """
    return HttpResponse(
        status=exception.status, headers={"Retry-After": str(exception.retry_after)}
    )
