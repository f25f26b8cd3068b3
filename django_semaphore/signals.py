"""Signals, sent only after the transaction that made them true commits.

permit_acquired
    sender: ``PermitRequest``; ``request``: the new ACQUIRED request (not sent
    for an idempotent repeat that granted nothing); ``using``: the alias.

permit_released
    sender: ``PermitRequest``; ``request_ids``: the requests that were held
    and are now RELEASED; ``reason``: a ``ReleaseReason`` value (``released``,
    ``expired``, ``owner_dead``, ``stale``, ``admin``); ``using``: the alias.
    One signal per release call or sweep batch.
"""

from __future__ import annotations

from django.dispatch import Signal

permit_acquired = Signal()
permit_released = Signal()
