"""What the doors of ``@holds_permit`` share: a decorator's options, and
the demand of each call.

It sits below ``decorators``, ``views`` and ``celery_tasks``, so that the two
doors need not import each other.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from django_semaphore import api, routing
from django_semaphore.conf import app_settings
from django_semaphore.exceptions import InvalidRequest
from django_semaphore.integrations.leases import HEARTBEAT, DefaultLease, Lease, lease_seconds
from django_semaphore.parking.admission import Policy
from django_semaphore.validation import validate_demand, validate_priority, validate_share

if TYPE_CHECKING:
    from django_semaphore.models import PermitRequest

# Attribute of a decorated function that carries its options (a task's body:
# what PermitTask reads when the task is sent).
OPTIONS_ATTRIBUTE = "django_semaphore_options"

# The names given as strings to ``holds_permit`` (``@task(semaphores=...)``
# too), known at import, and the largest count given for each:
# ``checks.check_named_semaphores`` compares them with the declared ones.
GIVEN_DEMANDS: dict[str, int] = {}


@dataclass(frozen=True)
class Options:
    demand: dict[str, int]
    ttl: int | DefaultLease | None  # LEASE: the setting, read at each call
    timeout: int | float | timedelta
    retry_after: int
    label: str  # module.qualname of the decorated function, for owners and logs
    park: bool | None  # None: the PARK_TASKS setting decides, when the task runs

    @property
    def lease(self) -> int | None:
        """The ttl of a permit taken now, in seconds; ``None``: no expiry."""
        return lease_seconds(self.ttl)

    @property
    def parks(self) -> bool:
        if self.park is None:
            return app_settings.PARK_TASKS or self.needs_a_deciding_class
        return self.park

    count: int
    names_of: Callable[..., Any] | None  # names computed from each call's arguments
    max_waiting: int | None = None  # parked tasks each semaphore may have waiting
    on_conflict: str | None = None  # "discard" or "replace": decided when sent (PermitTask)
    debounce: float | None = None  # seconds a send waits for the ones that follow it
    # Where a call stands in line: an int, one computed from each call's
    # arguments, or None: a Django task's own priority (0 elsewhere).
    priority: int | Callable[..., Any] | None = None
    # Its share key while it waits ("": none), or one computed from each
    # call's arguments.
    share: str | Callable[..., Any] = ""

    @property
    def policy(self) -> Policy:
        """What a send decides (``parking.admission``)."""
        return Policy(self.on_conflict, self.max_waiting, self.debounce)

    @property
    def needs_a_deciding_class(self) -> bool:
        """Whether these options mean something only where a task class
        decides when the task is sent (``on_conflict``, ``debounce``): a run
        of any other class fails, rather than run without them."""
        return self.on_conflict is not None or self.debounce is not None

    def refuse_undecided(self, task: Any, name: str, fix: str) -> None:
        """Raise ``InvalidRequest`` when these options need a deciding class
        (``needs_a_deciding_class``) and ``task`` (named ``name``) is not of
        one; ``fix`` says which class to use."""
        if self.needs_a_deciding_class and not getattr(task, "decides_when_sent", False):
            raise InvalidRequest(
                f"Task {name} sets on_conflict or debounce, decided when it is sent: {fix}."
            )

    @property
    def has_send_policy(self) -> bool:
        """Whether a deciding class (``PermitTask``, ``permit_task_class``)
        decides, when the task is sent, whether it is sent, waits or is
        discarded (``parking.admission``)."""
        return self.needs_a_deciding_class or self.max_waiting is not None

    def hold_lease(self, key: str) -> Lease | None:
        """Have the process heartbeat renew the run's permit under ``key``
        while the run lasts; ``None`` for a permit without a lease."""
        ttl = self.lease
        if ttl is None:
            return None
        return HEARTBEAT.hold(key, ttl, routing.alias_for_names(self.demand))

    def acquire(self, key: str, owner: str, timeout: float | timedelta) -> PermitRequest:
        """``api.acquire`` of the call's demand (``for_call``'s) under ``key``,
        with its lease, priority and share key."""
        return api.acquire(
            self.demand,
            external_id=key,
            owner=owner,
            ttl=self.lease,
            timeout=timeout,
            priority=self.priority_or(0),
            share=self.share_key,
        )

    def for_call(self, *args: Any, **kwargs: Any) -> Options:
        """The options of one call: its demand, priority and share key
        computed from its arguments, where the decorator was given callables."""
        call = self
        if self.names_of is not None:
            names = _called(self.names_of, "names semaphores", args, kwargs)
            call = replace(call, demand=demand_of(names, self.count))
        if callable(self.priority):
            priority = _called(self.priority, "gives the priority", args, kwargs)
            call = replace(call, priority=validate_priority(priority))
        if callable(self.share):
            share = _called(self.share, "gives the share key", args, kwargs)
            call = replace(call, share=validate_share(share))
        return call

    @property
    def share_key(self) -> str:
        """The call's share key (``for_call``'s); "" where none was given."""
        return cast(str, self.share)

    def priority_or(self, default: int) -> int:
        """The call's priority (``for_call``'s), or ``default`` where none was given."""
        return default if self.priority is None else cast(int, self.priority)


def _called(func: Callable[..., Any], does: str, args: Any, kwargs: Any) -> Any:
    """``func`` called with a call's arguments; one that cannot take them
    is the decorator's mistake, said as such."""
    try:
        return func(*args, **kwargs)
    except TypeError as exc:
        try:
            inspect.signature(func).bind(*args, **kwargs)
        except (TypeError, ValueError):  # they do not fit (or it has no signature)
            raise InvalidRequest(
                f"The callable {func!r} that {does} cannot take the arguments of the "
                f"call ({exc}): give it the same parameters."
            ) from exc
        raise  # raised inside it: its own error


def demand_of(names: Any, count: int) -> dict[str, int]:
    """Name -> permits, from what ``holds_permit`` takes as ``names``."""
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, Mapping):
        names = dict.fromkeys(validate_demand(names).names, count)
    return validate_demand(names).counts
