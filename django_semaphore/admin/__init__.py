"""The operator's console: who holds what, how full it is, who changed it and when.

- Semaphores: usage and waiters from one annotated query, a utilization bar,
  a 24-hour chart, current holders, the line of waiters and capacity
  history; capacity is edited through the same capacity API as code (row
  lock + ``CapacityChange`` with the user).
- Permit requests: read-only, with a force-release action guarded by its own
  permission and recorded in the admin's history (``LogEntry``) with the user.
- Capacity history: read-only.

Nothing here adds or deletes permits by hand, and every read goes to the
app's database alias (``DJANGO_SEMAPHORE["DATABASE"]``). With semaphores
sharded over several aliases (``SHARDS``) the admin shows one alias at a time:
``?_alias=<alias>`` on any list switches, and the choice is kept in the session.

One module a job: ``base`` (alias pinning, 403s, the read-only base),
``display`` (the usage bar, durations), ``usage`` (the semaphore list's
annotated query and its filter), ``sections`` (what a semaphore's page shows
below its form), ``semaphores``, ``requests``, ``parked`` and
``history`` (one ModelAdmin each, registered when imported here). This module
only imports them, so that Django's admin autodiscovery registers them, and
keeps the ModelAdmins importable from ``django_semaphore.admin`` (to subclass
or unregister); the helpers live in their own modules.
"""

from __future__ import annotations

from django_semaphore.admin.history import CapacityChangeAdmin
from django_semaphore.admin.parked import ParkedTaskAdmin
from django_semaphore.admin.requests import PermitRequestAdmin
from django_semaphore.admin.semaphores import SemaphoreAdmin

__all__ = ["CapacityChangeAdmin", "ParkedTaskAdmin", "PermitRequestAdmin", "SemaphoreAdmin"]
