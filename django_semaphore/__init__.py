"""django-semaphore: a durable, distributed counting semaphore in your database.

The public API. Import-safe: nothing imported here touches models or settings
until called, so ``import django_semaphore`` works before Django is set up.
The same operations are manager methods: ``Semaphore.objects.acquire(...)``.
"""

from __future__ import annotations

from django_semaphore.api import acquire, release, renew
from django_semaphore.context import permit
from django_semaphore.decorators import holds_permit
from django_semaphore.outcomes import ReleaseOutcome

__all__ = ["ReleaseOutcome", "acquire", "holds_permit", "permit", "release", "renew"]
