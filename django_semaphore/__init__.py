"""django-semaphore: a durable, distributed counting semaphore in your database.

The public API: one function per operation. Import-safe: ``import
django_semaphore`` works before Django is set up (an installed app's package
is imported while the app registry loads); each name is imported from its
module on first use, by which time the models can be.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django_semaphore.api import acquire as acquire
    from django_semaphore.api import force_release as force_release
    from django_semaphore.api import release as release
    from django_semaphore.api import renew as renew
    from django_semaphore.api import set_capacity as set_capacity
    from django_semaphore.api import set_window as set_window
    from django_semaphore.integrations.context import permit as permit
    from django_semaphore.integrations.decorators import holds_permit as holds_permit
    from django_semaphore.integrations.permit_task import PermitTask as PermitTask
    from django_semaphore.integrations.task_class import permit_task_class as permit_task_class
    from django_semaphore.states import ReleaseOutcome as ReleaseOutcome

# Name -> the module that defines it.
_HOMES = {
    **dict.fromkeys(
        ("acquire", "force_release", "release", "renew", "set_capacity", "set_window"),
        "django_semaphore.api",
    ),
    "PermitTask": "django_semaphore.integrations.permit_task",
    "ReleaseOutcome": "django_semaphore.states",
    "holds_permit": "django_semaphore.integrations.decorators",
    "permit": "django_semaphore.integrations.context",
    "permit_task_class": "django_semaphore.integrations.task_class",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # looked up once
    return value
