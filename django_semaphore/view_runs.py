"""How a Django view holds permits (``@holds_permit`` on a view).

The permit is held until the response has been sent, for a streaming response
until streaming ends or the client goes away. When no permit can be had the
view is not called: the answer is ``DJANGO_SEMAPHORE["VIEW_STATUS_CODE"]``
(429) with ``Retry-After``; when the database fails, 503.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, cast

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse

from django_semaphore import api
from django_semaphore.conf import app_settings
from django_semaphore.exceptions import SemaphoreError, SemaphoreExhausted
from django_semaphore.leases import Lease, hold
from django_semaphore.models import PermitRequest
from django_semaphore.owners import process_owner
from django_semaphore.runs import Options
from django_semaphore.validation import MAX_LENGTH

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
    if isinstance(held, HttpResponse):
        return held
    lease = _hold_lease(held)
    try:
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
    held = await sync_to_async(_acquire_for_view)(options, request)
    if isinstance(held, HttpResponse):
        return held
    lease = _hold_lease(held)
    try:
        response = await func(*args, **kwargs)
    except BaseException:
        await sync_to_async(_finish)(held.external_id, lease)
        raise
    return _release_when_sent(response, held.external_id, lease)


def _hold_lease(held: PermitRequest) -> Lease | None:
    """The process heartbeat renews the permit until the response is sent."""
    if held.ttl is None:
        return None
    return hold(held)


def _view_owner(options: Options, request: HttpRequest) -> str:
    user = getattr(request, "user", None)
    who = user.get_username() if user is not None and user.is_authenticated else "anonymous"
    remote = request.META.get("REMOTE_ADDR", "?")
    return f"view {options.label} for {who} from {remote} on {process_owner('')}"[
        :MAX_LENGTH
    ].strip()


def _acquire_for_view(options: Options, request: HttpRequest) -> PermitRequest | HttpResponse:
    """Acquire for a view, under a fresh key: the request held, or the
    refusal to send instead."""
    try:
        return api.acquire(
            options.demand,
            external_id=uuid.uuid4().hex,
            owner=_view_owner(options, request),
            ttl=options.lease,
            timeout=options.timeout,
            fair=options.fair,
        )
    except SemaphoreExhausted as exc:
        logger.info("%s refused: %s", options.label, exc)
        # A rate limit knows when its next slot frees; a concurrency limit
        # frees room when its holders release, which the option guesses.
        wait = options.retry_after if exc.retry_after is None else math.ceil(exc.retry_after)
        return _refusal(app_settings.VIEW_STATUS_CODE, wait)
    except SemaphoreError as exc:
        logger.error("%s refused, the semaphore could not be reached: %s", options.label, exc)
        return _refusal(503, options.retry_after)


def _refusal(status: int, retry_after: int) -> HttpResponse:
    response = HttpResponse(status=status)
    response["Retry-After"] = str(retry_after)
    return response


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
