"""Views decorated with @holds_permit, for the tests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.utils import timezone
from django.utils.decorators import method_decorator
from django.views import View

from django_semaphore import holds_permit
from django_semaphore.exceptions import PermitRefused
from django_semaphore.models import PermitRequest, Semaphore
from tests.testapp.models import RunLog

VIEWS = "views"  # the semaphore every view here uses; each test creates it


class Inside:
    """How many requests are inside a view right now, and the most ever."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0
        self.calls = 0

    def __enter__(self) -> None:
        with self.lock:
            self.now += 1
            self.calls += 1
            self.peak = max(self.peak, self.now)

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.now -= 1


inside = Inside()


def in_use() -> int:
    return int(Semaphore.objects.with_usage().get(name=VIEWS).in_use)


@holds_permit(VIEWS)
def plain(request: HttpRequest) -> HttpResponse:
    with inside:
        return HttpResponse(str(in_use()))


RATED = "views-rated"  # a rate limit, taken with VIEWS by ``rated``


@holds_permit({VIEWS: 1, RATED: 1}, retry_after=7)
def rated(request: HttpRequest) -> HttpResponse:
    return HttpResponse("done")


@holds_permit(VIEWS, retry_after=7)
def slow(request: HttpRequest) -> HttpResponse:
    with inside:
        time.sleep(0.3)
        return HttpResponse("done")


@holds_permit(VIEWS)
def failing(request: HttpRequest) -> HttpResponse:
    raise RuntimeError("the view failed")


@holds_permit(VIEWS)
def streaming(request: HttpRequest) -> StreamingHttpResponse:
    def rows() -> Iterator[bytes]:
        for _ in range(3):
            yield f"{in_use()}\n".encode()

    return StreamingHttpResponse(rows(), content_type="text/csv")


@holds_permit(VIEWS)
async def async_view(request: HttpRequest) -> HttpResponse:
    from asgiref.sync import sync_to_async

    return HttpResponse(str(await sync_to_async(in_use)()))


@holds_permit(VIEWS)
async def async_streaming(request: HttpRequest) -> StreamingHttpResponse:
    async def rows() -> AsyncIterator[bytes]:
        for _ in range(3):
            await asyncio.sleep(0)
            yield b"row\n"

    return StreamingHttpResponse(rows(), content_type="text/csv")


@method_decorator(holds_permit(VIEWS), name="dispatch")
class DecoratedClass(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(str(in_use()))


class DecoratedDispatch(View):
    @holds_permit(VIEWS)
    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return super().dispatch(request, *args, **kwargs)

    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(str(in_use()))


@holds_permit(VIEWS)
def writes(request: HttpRequest) -> HttpResponse:
    """Writes a row, then fails when asked: with ATOMIC_REQUESTS the row must
    go with the view's transaction, the permit must not."""
    RunLog.objects.create(label="writes", pid=0, started_at=timezone.now())
    if "fail" in request.GET:
        raise RuntimeError("the view failed after writing")
    # Seen from another connection: committed before the view ran.
    held = committed_elsewhere(lambda: PermitRequest.objects.filter(state="ACQUIRED").count())
    return HttpResponse(f"{connection.in_atomic_block} {held}")


@holds_permit(VIEWS)
@transaction.non_atomic_requests
def opted_out(request: HttpRequest) -> HttpResponse:
    return HttpResponse(str(connection.in_atomic_block))


def committed_elsewhere(read: Any) -> Any:
    """``read()`` on another thread, hence another connection: what is committed."""
    answer: list[Any] = []

    def run() -> None:
        try:
            answer.append(read())
        finally:
            connection.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    return answer[0]


@holds_permit("no-such-semaphore")
def unknown_name(request: HttpRequest) -> HttpResponse:
    return HttpResponse("never")


@holds_permit({"declared-in-settings": 5})  # settings declare 4
def too_many(request: HttpRequest) -> HttpResponse:
    return HttpResponse("never")


@holds_permit(lambda request: f"family-nobody-declared:{request.GET['key']}")
def undeclared_family(request: HttpRequest) -> HttpResponse:
    return HttpResponse("never")


def busy_page(request: HttpRequest, exception: PermitRefused) -> HttpResponse:
    """A project's own refusal page (REFUSED_VIEW)."""
    return HttpResponse(
        f"busy: {', '.join(exception.names) or 'unreachable'}",
        status=exception.status,
        headers={"Retry-After": str(exception.retry_after)},
    )
