"""``@holds_permit``: one decorator for Django views, Celery tasks and plain
functions. The decorated body never runs without its permit: when none can be
had, a view answers 429/503, a task waits (parked), a function raises.

This module picks the door: a view's permit is held by ``views``, a task
run's by ``celery_tasks``, a plain function's by ``permit()`` here. Whether a
function is a view is decided once, when it is decorated.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar, cast

from django.db import connections

from django_semaphore.exceptions import InvalidRequest
from django_semaphore.integrations import django_tasks
from django_semaphore.integrations.celery_tasks import run_task
from django_semaphore.integrations.context import HeldPermit, permit
from django_semaphore.integrations.leases import LEASE, DefaultLease
from django_semaphore.integrations.options import (
    GIVEN_DEMANDS,
    OPTIONS_ATTRIBUTE,
    Options,
    demand_of,
)
from django_semaphore.integrations.views import run_async_view, run_view
from django_semaphore.owners import process_owner
from django_semaphore.parking.admission import ON_CONFLICT
from django_semaphore.validation import (
    MAX_COUNT,
    MAX_TTL,
    validate_debounce,
    validate_flag,
    validate_int,
    validate_priority,
    validate_share,
    validate_timeout,
    validate_ttl,
    warn_fair,
)

F = TypeVar("F", bound=Callable[..., Any])


def holds_permit(
    names: Any,
    *,
    count: int = 1,
    ttl: int | float | timedelta | DefaultLease | None = LEASE,
    timeout: int | float | timedelta = 0,
    retry_after: int = 1,
    priority: int | Callable[..., int] | None = None,
    share: str | int | Callable[..., str | int | None] | None = None,
    fair: bool | None = None,
    park: bool | None = None,
    max_waiting: int | None = None,
    on_conflict: str | None = None,
    debounce: int | float | timedelta | None = None,
    view: bool | None = None,
) -> Callable[[F], F]:
    """Hold permits while a view, a task (Celery's or Django's) or a function runs.

    - **Views** (function views, ``dispatch`` or a handler of class-based
      views, sync and async): the permit is taken and committed before the
      view runs, and held until the response has been sent, for a streaming
      response until streaming ends or the client goes away. With
      ``ATOMIC_REQUESTS`` the view body still runs in the transaction the
      project asked for, opened after the permit committed. When there is no
      room the view is not called: ``DJANGO_SEMAPHORE["REFUSED_VIEW"]``
      answers (by default ``VIEW_STATUS_CODE``, 429, with ``Retry-After``);
      when the database cannot be reached or stays locked, it answers 503.
      Any other error (an unknown name, a bad demand) raises, as any bug does.
    - **Celery tasks** (placed under ``@shared_task``/``@app.task``, bound or
      not): the key is the task id, so a redelivered or retried run re-attaches
      to its permit instead of taking a second one; the permit is kept across
      the task's own retries and released when the task finishes for good.
      When exhausted the task waits without spending its retries or failing:
      it stands by briefly in its worker, then is parked in the database and
      published again when a release makes room for it (``docs/parked.md``).
      With ``park=False`` it retries itself later (jittered countdown) and,
      once its retries are spent, fails with ``SemaphoreExhausted``.
    - **Django's own tasks** (placed under ``@task``, on any backend): the
      key is the task result's id. A run that finds no room is deferred
      where its backend can take it back (django-tasks-db's), else waits
      in its worker; it never fails for want of room
      (``docs/django-tasks.md``).
    - **Anything else**: held for the call with a fresh key; errors propagate.

    Args:
        names: a name or list of names (each ``count`` permits), or a mapping
            name -> count; or a callable returning one of those, computed
            for each call: a view's gets the request
            (``lambda request: f"export:customer:{request.user.pk}"``), a
            task's the task's arguments (``lambda customer_id, **_: ...``),
            a function's its arguments. With a family declared in settings
            the computed semaphore is created on first use. A name given
            as such that ``SEMAPHORES`` neither declares nor matches by a
            pattern is reported by ``manage.py check`` (``W013``).
        count: permits per name when ``names`` is not a mapping.
        ttl: the lease, renewed by the process's heartbeat while the body
            runs (a task's permit kept across its own retry is kept for the
            countdown plus one lease): ``LEASE`` (the setting, 60 s by
            default), seconds or a ``timedelta``; ``None`` never expires.
        timeout: seconds to wait for room before giving up (views, functions).
        retry_after: seconds a refused client is told to wait.
        priority: where a call stands in line while it waits: -100 to 100,
            higher first, or a callable of the call's arguments that returns
            it (as ``names``). ``None``: a Django task's own priority, 0 for
            anything else (a Celery message's priority is its broker's, in
            its broker's order: not read).
        share: the call's share key while it waits (a customer's id, a
            tenant), or a callable of the call's arguments that returns it
            (as ``names``): the keys waiting on a semaphore are served in
            turn, by their ``SHARE_WEIGHTS`` (docs/shares.md). With
            ``max_waiting``, each share key may have that many tasks
            waiting. ``None``: none.
        fair: deprecated, ignored: every call that waits waits in line.
        park: tasks only: whether a task that finds no room is parked
            (``True``) or retried (``False``; a Django task waits in its
            worker); ``None``: ``DJANGO_SEMAPHORE["PARK_TASKS"]``, on by default.
        max_waiting: tasks only: at most this many tasks wait parked on each
            semaphore of the demand; a task that would park beyond that fails
            with ``LineFull`` instead (counted under the semaphores' row
            locks, so never more). ``None``: no limit. With a task class
            that decides when the task is sent, sending raises ``LineFull``.
        on_conflict: tasks whose class decides it when they are sent only
            (Celery's ``base=PermitTask``, a Django task's
            ``permit_task_class``): what sending the task does when its
            demand has no room (held, or kept for tasks already sent):
            ``"discard"`` sends nothing and returns the existing task's
            result (one holding or waiting there); ``"replace"`` drops the
            tasks of the same name still waiting on the same semaphores,
            and waits in their stead. ``None``: it waits
            (``docs/policies.md``).
        debounce: as ``on_conflict``, sent by such a class only: seconds
            (or a ``timedelta``) the first send of a burst waits, parked,
            before it may run; the sends of the same task while it still
            waits collapse into it (and are given its result). Not with
            ``on_conflict``.
        view: whether the function is a Django view. ``None``: it is when its
            first parameter (after ``self``) is named ``request``; pass
            ``False`` for a helper that takes a request but must raise, not
            answer, when refused.

    Raises:
        InvalidRequest: when decorating, for any malformed argument (computed
            names are checked on each call, as ``acquire`` checks them), or
            when placed above a task decorator instead of under it.
    """
    # Every argument is checked now, so a typo fails at import rather than
    # on the first request.
    names_of: Callable[..., Any] | None = None
    validate_int(count, "count", 1, MAX_COUNT)
    if callable(names) and not isinstance(names, str | Mapping):
        names_of, demand = names, {}
    else:
        demand = demand_of(names, count)
        for name, given in demand.items():
            GIVEN_DEMANDS[name] = max(given, GIVEN_DEMANDS.get(name, 0))
    # The LEASE setting is read at each call (override_settings works).
    lease = ttl if ttl is LEASE else validate_ttl(ttl)
    validate_timeout(timeout)
    # The Retry-After header takes whole seconds.
    validate_int(retry_after, "retry_after (seconds)", 0, MAX_TTL)
    if not callable(priority) and priority is not None:
        validate_priority(priority)
    if not callable(share):
        share = validate_share(share)
    warn_fair(fair)
    if max_waiting is not None:
        validate_int(max_waiting, "max_waiting", 1, MAX_COUNT)
    for flag, name in ((park, "park"), (view, "view")):
        if flag is not None:
            validate_flag(flag, name)
    if on_conflict is not None and on_conflict not in ON_CONFLICT:
        raise InvalidRequest(
            f"on_conflict must be None, 'discard' or 'replace', not {on_conflict!r}."
        )
    debounce_seconds = validate_debounce(debounce)
    if on_conflict is not None and debounce is not None:
        raise InvalidRequest("debounce collapses duplicates itself: it takes no on_conflict.")
    if (on_conflict is not None or debounce is not None) and park is False:
        raise InvalidRequest(
            "on_conflict and debounce park the task as it is sent: park=False contradicts them."
        )

    def decorate(func: F) -> F:
        _refuse_task_object(func)
        options = Options(
            demand, lease, timeout, retry_after, _label(func), park, count, names_of,
            max_waiting, on_conflict, debounce_seconds, priority, share,
        )  # fmt: skip
        request_at = _request_position(func, view)
        if inspect.iscoroutinefunction(func):
            wrapper = _async_wrapper(func, options, request_at)
        else:
            wrapper = _sync_wrapper(func, options, request_at)
            if view is not False:
                # Django's handler must not open ATOMIC_REQUESTS' transaction
                # around the wrapper: the permit is committed first, then
                # views opens the same transaction around the view itself.
                # Set even when this function looks like no view: method_decorator
                # copies the attribute from a decorated (*args, **kwargs) dummy.
                wrapper._non_atomic_requests = set(connections)  # type: ignore[attr-defined]
        setattr(wrapper, OPTIONS_ATTRIBUTE, options)  # read when a task is sent
        return cast(F, wrapper)

    return decorate


def _label(func: Callable[..., Any]) -> str:
    # method_decorator hands over the bound method as a partial named after
    # the class that defines it (View.dispatch): name the view's own class.
    view = getattr(getattr(func, "func", None), "__self__", None)
    if view is not None:
        return f"{type(view).__module__}.{type(view).__qualname__}.{func.__name__}"
    return f"{func.__module__}.{func.__qualname__}"


def _request_position(func: Callable[..., Any], view: bool | None) -> int | None:
    """Where a view's request is among its arguments (after ``self`` for a
    method); ``None`` for a function that is not a view."""
    # method_decorator's partial of a bound method is wrapped as the
    # unbound method: its own signature, without self, is the true one.
    follow = not isinstance(func, functools.partial)
    try:
        parameters = list(inspect.signature(func, follow_wrapped=follow).parameters)
    except (TypeError, ValueError):  # a callable Python cannot read
        parameters = []
    skip = 1 if parameters[:1] == ["self"] else 0
    if view is None:
        view = parameters[skip : skip + 1] == ["request"]
    return skip if view else None


def _refuse_task_object(func: Any) -> None:
    """Above ``@shared_task`` the decorator would wrap the task object, and
    ``.delay`` would no longer exist; under it, it wraps the task's body."""
    kinds = _task_classes()
    # type(), not isinstance(): shared_task's proxy would build the task to answer.
    if kinds and issubclass(type(func), kinds):
        raise InvalidRequest(
            "@holds_permit is placed above a task decorator: place it under "
            "@shared_task / @app.task / @task, right above the function."
        )


@functools.cache
def _task_classes() -> tuple[type, ...]:
    try:
        from celery import Task
        from celery.local import Proxy
    except ImportError:
        return tuple(django_tasks.task_classes())
    return (Task, Proxy, *django_tasks.task_classes())


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


def _permit(call: Options) -> HeldPermit:
    """A plain function's permit, held for the call with a fresh key."""
    return permit(
        call.demand,
        owner=process_owner(call.label),
        ttl=call.lease,
        timeout=call.timeout,
        priority=call.priority_or(0),
        share=call.share_key,
    )


def _sync_wrapper(func: F, options: Options, request_at: int | None) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if request_at is not None:
            request = args[request_at]
            return run_view(func, options.for_call(request), request, args, kwargs)
        task = _running_task_of(wrapper)
        if task is not None:
            # A bound task's body gets the task first; the names do not.
            bound = getattr(task, "_get_current_object", lambda: task)()  # current_task's proxy
            own = args[1:] if args and args[0] is bound else args
            return run_task(func, options.for_call(*own, **kwargs), task, args, kwargs)
        result = django_tasks.running_result_of(wrapper)
        if result is not None:
            return django_tasks.run(func, options, result, args, kwargs)
        with _permit(options.for_call(*args, **kwargs)):
            return func(*args, **kwargs)

    return wrapper


def _async_wrapper(func: F, options: Options, request_at: int | None) -> Callable[..., Any]:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = django_tasks.running_result_of(wrapper)
        if result is not None:
            return await django_tasks.run_async(func, options, result, args, kwargs)
        if request_at is None:
            async with _permit(options.for_call(*args, **kwargs)):
                return await func(*args, **kwargs)
        request = args[request_at]
        return await run_async_view(func, options.for_call(request), request, args, kwargs)

    return wrapper
