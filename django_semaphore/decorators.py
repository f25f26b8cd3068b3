"""``@holds_permit``: one decorator for Django views, Celery tasks and plain
functions. The decorated body never runs without its permit: when none can be
had, a view answers 429/503, a task waits (parked), a function raises.

This module picks the door: a view's permit is held by ``view_runs``, a task
run's by ``task_runs``, a plain function's by ``permit()`` here.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any, TypeVar, cast

from django.http import HttpRequest

from django_semaphore.context import permit
from django_semaphore.exceptions import InvalidRequest
from django_semaphore.leases import LEASE, DefaultLease
from django_semaphore.owners import process_owner
from django_semaphore.runs import Options
from django_semaphore.task_runs import run_task
from django_semaphore.validation import (
    MAX_COUNT,
    MAX_TTL,
    is_int,
    validate_demand,
    validate_flag,
    validate_timeout,
    validate_ttl,
)
from django_semaphore.view_runs import run_async_view, run_view

F = TypeVar("F", bound=Callable[..., Any])


def holds_permit(
    names: Any,
    *,
    count: int = 1,
    ttl: int | float | timedelta | DefaultLease | None = LEASE,
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
      When exhausted the task waits without spending its retries or failing:
      it stands by briefly in its worker, then is parked in the database and
      published again when a release makes room for it (``docs/parked.md``).
      With ``park=False`` it retries itself later (jittered countdown) and,
      once its retries are spent, fails with ``SemaphoreExhausted``.
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
        ttl: the lease, renewed by the process's heartbeat while the body
            runs (a task's permit kept across its own retry is kept for the
            countdown plus one lease): ``LEASE`` (the setting, 60 s by
            default), seconds or a ``timedelta``; ``None`` never expires.
        timeout: seconds to wait for room before giving up (views, functions).
        retry_after: seconds a refused client is told to wait.
        fair: wait in first-come, first-served order (see ``acquire``); a
            task, which never waits, is refused while older waiters queue.
        park: Celery tasks only: whether a task that finds no room is parked
            (``True``) or retried (``False``, as 0.1 did by default);
            ``None``: ``DJANGO_SEMAPHORE["PARK_TASKS"]``, on by default.

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
    # The LEASE setting is read at each call (override_settings works).
    lease = ttl if ttl is LEASE else validate_ttl(ttl)
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
        options = Options(
            demand, lease, timeout, retry_after, _label(func), fair, park, count, names_of
        )
        if inspect.iscoroutinefunction(func):
            return cast(F, _async_wrapper(func, options))
        return cast(F, _sync_wrapper(func, options))

    return decorate


def _demand(names: Any, count: int) -> dict[str, int]:
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, Mapping):
        names = dict.fromkeys(validate_demand(names).names, count)
    return validate_demand(names).counts


def _for_call(options: Options, *args: Any, **kwargs: Any) -> Options:
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


def _sync_wrapper(func: F, options: Options) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        request = _find_request(args)
        if request is not None:
            return run_view(func, _for_call(options, request), request, args, kwargs)
        task = _running_task_of(wrapper)
        if task is not None:
            # A bound task's body gets the task first; the names do not.
            bound = getattr(task, "_get_current_object", lambda: task)()  # current_task's proxy
            own = args[1:] if args and args[0] is bound else args
            return run_task(func, _for_call(options, *own, **kwargs), task, args, kwargs)
        call = _for_call(options, *args, **kwargs)
        with permit(
            call.demand,
            owner=process_owner(call.label),
            ttl=call.lease,
            timeout=call.timeout,
            fair=call.fair,
        ):
            return func(*args, **kwargs)

    return wrapper


def _async_wrapper(func: F, options: Options) -> Callable[..., Any]:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        request = _find_request(args)
        if request is None:
            call = _for_call(options, *args, **kwargs)
            async with permit(
                call.demand,
                owner=process_owner(call.label),
                ttl=call.lease,
                timeout=call.timeout,
                fair=call.fair,
            ):
                return await func(*args, **kwargs)
        return await run_async_view(func, _for_call(options, request), request, args, kwargs)

    return wrapper
