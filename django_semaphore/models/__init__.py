"""What is stored: semaphores, the requests holding them, and their audit trails.

One module a kind of row: ``semaphore``, ``requests`` (requests and their
permits), ``records`` (tickets, capacity history, fencing marks), ``parked``
(parked Celery tasks). Import the models from here.
"""

from __future__ import annotations

from django_semaphore.models.parked import ParkedTask
from django_semaphore.models.records import CapacityChange, FencingMark, Ticket
from django_semaphore.models.requests import Permit, PermitRequest
from django_semaphore.models.semaphore import ReleaseCounter, Semaphore

__all__ = [
    "CapacityChange",
    "FencingMark",
    "ParkedTask",
    "Permit",
    "PermitRequest",
    "ReleaseCounter",
    "Semaphore",
    "Ticket",
]
