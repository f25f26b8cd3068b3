"""``@holds_permit``: one decorator for Django views, Celery tasks and plain
functions. The decorated body never runs without its permit: when none can be
had, a view answers 429/503, a task retries later, a function raises.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, TypeVar, cast

from asgiref.sync import sync_to_async
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse

from django_semaphore.conf import app_settings
from django_semaphore.context import Heartbeat, permit
from django_semaphore.exceptions import (
    InvalidRequest,
    LiveDuplicate,
    PermitLost,
    SemaphoreError,
    SemaphoreExhausted,
    TaskAlreadyRan,
)
from django_semaphore.validation import (
    MAX_COUNT,
    MAX_LENGTH,
    MAX_TTL,
    is_int,
    validate_demand,
    validate_flag,
    validate_timeout,
    validate_ttl,
)

logger = logging.getLogger("django_semaphore")

F = TypeVar("F", bound=Callable[..., Any])

# Attribute of the Celery task request that carries the key a run holds, for
# the task_postrun receiver (tasks.py can't see the decorator's locals).
TASK_KEY_ATTRIBUTE = "django_semaphore_key"


def holds_permit(
    names: Any,
    *,
    count: int = 1,
    ttl: int | float | timedelta | None = None,
    timeout: int | float | timedelta = 0,
    retry_after: int = 1,
    fair: bool = False,
    park: bool | None = None,
) -> Callable[[F], F]:
    """Hold permits while a view, Celery task or function runs.

    - **Views** (function views, ``dispatch`` of class-based views, sync and
      async): the permit is held until the response has been sent, for a
      streaming response until streaming ends or the client goes away. When
      exhausted the view is not called: the answer is
      ``DJANGO_SEMAPHORE["VIEW_STATUS_CODE"]`` (429) with ``Retry-After``;
      when the database fails, 503.
    - **Celery tasks** (placed under ``@shared_task``/``@app.task``, bound or
      not): the key is the task id, so a redelivered or retried run re-attaches
      to its permit instead of taking a second one; the permit is kept across
      the task's own retries and released when the task finishes for good.
      When exhausted the task retries itself later (jittered countdown) and
      after its retries are spent fails with ``SemaphoreExhausted``; or, with
      ``park``, it is parked in the database and published again when a
      release makes room for it (``docs/parked.md``).
    - **Anything else**: held for the call with a fresh key; errors propagate.

    Args:
        names: a name or list of names (each ``count`` permits), or a mapping
            name -> count; or a callable returning one of those, computed
            for each call: a view's gets the request
            (``lambda request: f"export:customer:{request.user.pk}"``), a
            task's the task's arguments (``lambda customer_id, **_: ...``),
            a function's its arguments. With a family declared in settings
            the computed semaphore is created on first use.
        count: permits per name when ``names`` is not a mapping.
        ttl: lease renewed in the background while the body runs.
        timeout: seconds to wait for room before giving up (views, functions).
        retry_after: seconds a refused client is told to wait.
        fair: wait in first-come, first-served order (see ``acquire``); a
            task, which never waits, is refused while older waiters queue.
        park: Celery tasks only: park a task that finds no room instead of
            retrying it (``None``: ``DJANGO_SEMAPHORE["PARK_TASKS"]``, off
            by default).

    Raises:
        InvalidRequest: when decorating, for any malformed argument (computed
            names are checked on each call, as ``acquire`` checks them).
    """
    # Every argument is checked now, so a typo fails at import rather than
    # on the first request (where a view would answer it with a 503).
    names_of: Callable[..., Any] | None = None
    if not is_int(count, 1, MAX_COUNT):
        raise InvalidRequest(f"count must be an int from 1 to {MAX_COUNT}, not {count!r}.")
    if callable(names) and not isinstance(names, str | Mapping):
        names_of, demand = names, {}
    else:
        demand = _demand(names, count)
    ttl_seconds = validate_ttl(ttl)
    validate_timeout(timeout)
    if not is_int(retry_after, 0, MAX_TTL):
        # The Retry-After header takes whole seconds.
        raise InvalidRequest(
            f"retry_after must be an int of seconds from 0 to {MAX_TTL}, not {retry_after!r}."
        )
    validate_flag(fair, "fair")
    if park is not None:
        validate_flag(park, "park")

    def decorate(func: F) -> F:
        options = _Options(
            demand, ttl_seconds, timeout, retry_after, _label(func), fair, park, count, names_of
        )
        if inspect.iscoroutinefunction(func):
            return cast(F, _async_wrapper(func, options))
        return cast(F, _sync_wrapper(func, options))

    return decorate


@dataclass(frozen=True)
class _Options:
    demand: dict[str, int]
    ttl: int | None
    timeout: int | float | timedelta
    retry_after: int
    label: str  # module.qualname of the decorated function, for owners and logs
    fair: bool
    park: bool | None  # None: the PARK_TASKS setting decides, when the task runs

    @property
    def parks(self) -> bool:
        return app_settings.PARK_TASKS if self.park is None else self.park

    count: int
    names_of: Callable[..., Any] | None  # names computed from each call's arguments


def _demand(names: Any, count: int) -> dict[str, int]:
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, Mapping):
        names = dict.fromkeys(validate_demand(names).names, count)
    return validate_demand(names).counts


def _for_call(options: _Options, *args: Any, **kwargs: Any) -> _Options:
    """The options of one call: its demand computed from its arguments, when
    the decorator was given a callable."""
    if options.names_of is None:
        return options
    return replace(options, demand=_demand(options.names_of(*args, **kwargs), options.count))


def _label(func: Callable[..., Any]) -> str:
    return f"{func.__module__}.{func.__qualname__}"


def _find_request(args: tuple[Any, ...]) -> HttpRequest | None:
    """A view's request: first argument, or second for a method (``dispatch``)."""
    for arg in args[:2]:
        if isinstance(arg, HttpRequest):
            return arg
    return None


def _running_task_of(body: Callable[..., Any]) -> Any:
    """The Celery task whose body ``body`` is, if a worker is running it now.

    Only the task's own body gets task semantics (key = task id); a decorated
    helper the task calls holds its permit like any function.
    """
    try:
        from celery import current_task
    except ImportError:
        return None
    if not current_task or current_task.request.id is None or current_task.request.called_directly:
        return None
    # autoretry_for wraps the body and keeps the original as _orig_run.
    for run in (getattr(current_task, "_orig_run", None), current_task.run):
        if getattr(run, "__func__", run) is body:
            return current_task
    return None


def _sync_wrapper(func: F, options: _Options) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        request = _find_request(args)
        if request is not None:
            return _run_view(func, _for_call(options, request), request, args, kwargs)
        task = _running_task_of(wrapper)
        if task is not None:
            # A bound task's body gets the task first; the names do not.
            bound = getattr(task, "_get_current_object", lambda: task)()  # current_task's proxy
            own = args[1:] if args and args[0] is bound else args
            return _run_task(func, _for_call(options, *own, **kwargs), task, args, kwargs)
        call = _for_call(options, *args, **kwargs)
        with permit(
            call.demand,
            owner=_process_owner(call.label),
            ttl=call.ttl,
            timeout=call.timeout,
            fair=call.fair,
        ):
            return func(*args, **kwargs)

    return wrapper


def _async_wrapper(func: F, options: _Options) -> Callable[..., Any]:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        request = _find_request(args)
        if request is None:
            call = _for_call(options, *args, **kwargs)
            async with permit(
                call.demand,
                owner=_process_owner(call.label),
                ttl=call.ttl,
                timeout=call.timeout,
                fair=call.fair,
            ):
                return await func(*args, **kwargs)
        key = uuid.uuid4().hex
        call = _for_call(options, request)
        refusal = await sync_to_async(_acquire_for_view)(call, request, key)
        if refusal is not None:
            return refusal
        heartbeat = _start_heartbeat(key, call.ttl)
        try:
            response = await func(*args, **kwargs)
        except BaseException:
            await sync_to_async(_finish)(key, heartbeat)
            raise
        return _release_when_sent(response, key, heartbeat)

    return wrapper


# --- views ---------------------------------------------------------------------


def _view_owner(options: _Options, request: HttpRequest) -> str:
    user = getattr(request, "user", None)
    who = user.get_username() if user is not None and user.is_authenticated else "anonymous"
    remote = request.META.get("REMOTE_ADDR", "?")
    return f"view {options.label} for {who} from {remote} on {_process_owner('')}"[
        :MAX_LENGTH
    ].strip()


def _acquire_for_view(options: _Options, request: HttpRequest, key: str) -> HttpResponse | None:
    """Acquire for a view; returns the refusal to send instead, if any."""
    from django_semaphore.api import acquire

    try:
        acquire(
            options.demand,
            external_id=key,
            owner=_view_owner(options, request),
            ttl=options.ttl,
            timeout=options.timeout,
            fair=options.fair,
        )
    except SemaphoreExhausted as exc:
        logger.info("%s refused: %s", options.label, exc)
        return _refusal(app_settings.VIEW_STATUS_CODE, options.retry_after)
    except SemaphoreError as exc:
        logger.error("%s refused, the semaphore could not be reached: %s", options.label, exc)
        return _refusal(503, options.retry_after)
    return None


def _refusal(status: int, retry_after: int) -> HttpResponse:
    response = HttpResponse(status=status)
    response["Retry-After"] = str(retry_after)
    return response


def _run_view(
    func: Callable[..., Any],
    options: _Options,
    request: HttpRequest,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    key = uuid.uuid4().hex
    refusal = _acquire_for_view(options, request, key)
    if refusal is not None:
        return refusal
    heartbeat = _start_heartbeat(key, options.ttl)
    try:
        response = func(*args, **kwargs)
    except BaseException:
        _finish(key, heartbeat)
        raise
    return _release_when_sent(response, key, heartbeat)


def _start_heartbeat(key: str, ttl: int | None) -> Heartbeat | None:
    if ttl is None:
        return None
    heartbeat = Heartbeat(key, ttl)
    heartbeat.start()
    return heartbeat


def _finish(key: str, heartbeat: Heartbeat | None) -> None:
    from django_semaphore.api import release

    if heartbeat is not None:
        heartbeat.stop()
    release(key)


def _release_when_sent(response: Any, key: str, heartbeat: Heartbeat | None) -> Any:
    """Keep the permit until the server has sent the response.

    Servers call ``close()`` on a response once it is sent, or once the client
    went away mid-stream; that is when the work the permit guards is done.
    """
    if not isinstance(response, HttpResponseBase):
        _finish(key, heartbeat)
        return response
    closed = False

    def release_once() -> None:
        nonlocal closed
        if not closed:
            closed = True
            _finish(key, heartbeat)

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


# --- Celery tasks ----------------------------------------------------------------


def _process_owner(label: str) -> str:
    where = f"{socket.gethostname()} pid {os.getpid()}"
    return f"{label} on {where}" if label else where


def _run_task(
    func: Callable[..., Any],
    options: _Options,
    task: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    parks = options.parks
    if parks:
        from django_semaphore import parking

        # From this process's first parking task on, its releases (this
        # task's own, when it finishes) wake the parked tasks they make room for.
        parking.enable()
    try:
        key = _claim(task, options)
    except TaskAlreadyRan as exc:
        logger.info("Task %s[%s] dropped: %s", task.name, task.request.id, exc)
        _forget_parked(task, options)
        raise _ignore() from None
    except SemaphoreExhausted as exc:
        if parks and not isinstance(exc, LiveDuplicate):
            _park(task, options)
        raise _retry(task, exc) from None
    setattr(task.request, TASK_KEY_ATTRIBUTE, key)  # settled by task_runs.on_task_postrun
    if parks:
        _forget_parked(task, options)
    heartbeat = _start_heartbeat(key, options.ttl)
    started = time.monotonic()
    try:
        result = func(*args, **kwargs)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if parks:
            parking.held(options.demand, time.monotonic() - started)
    if heartbeat is not None and heartbeat.lost:
        raise PermitLost(f"Task {task.request.id} lost its permit while it ran.")
    return result


def _retry(task: Any, exc: SemaphoreExhausted) -> Exception:
    """Retry the task with a jittered countdown (``retry()`` raises; past
    ``max_retries`` it raises ``exc``: the task fails with it)."""
    retries = task.request.retries
    countdown = min(60.0, 2.0**retries) * random.uniform(0.5, 1.5)
    logger.info(
        "Task %s[%s] deferred %.1fs (retry %d): %s",
        task.name,
        task.request.id,
        countdown,
        retries + 1,
        exc,
    )
    return cast(Exception, task.retry(exc=exc, countdown=math.ceil(countdown)))


def _claim(task: Any, options: _Options) -> str:
    """The run's permit key: claimed at once or, when a parking task finds
    no room, standing by in this worker for a release (``parking.stand_by``).
    Raises as ``task_runs.claim``."""
    from django_semaphore import task_runs

    claim = functools.partial(
        task_runs.claim, task, options.demand, options.ttl, rerun_finished=not options.parks
    )
    try:
        return claim()
    except SemaphoreExhausted as exc:
        if not options.parks or isinstance(exc, LiveDuplicate):
            raise
        from django_semaphore import parking

        key = parking.stand_by(task.request.id, options.demand, claim)
        if key is None:
            raise
        return key


def _ignore() -> Exception:
    from celery.exceptions import Ignore

    return cast(Exception, Ignore())


def _park(task: Any, options: _Options) -> None:
    """Park the task and end this run (``Ignore``); returns only when the
    row could not be written, and the caller then retries as without parking."""
    from django_semaphore import parking

    try:
        parking.park(task, options.demand)
    except SemaphoreError:
        logger.exception("Task %s[%s] could not be parked", task.name, task.request.id)
        return
    logger.info("Task %s[%s] parked for want of room", task.name, task.request.id)
    raise _ignore()


def _forget_parked(task: Any, options: _Options) -> None:
    from django_semaphore import parking

    try:
        parking.started(task.request.id, options.demand)
    except DatabaseError:
        # The row stays; the sweep may publish it again, and that copy is
        # dropped (TaskAlreadyRan) or deferred as a live duplicate.
        logger.exception("Could not delete the parked row of task %s", task.request.id)
