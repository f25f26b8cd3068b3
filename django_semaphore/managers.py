"""Managers: the ORM entry points. The algorithm itself lives in ``core.py``."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import models
from django.db.models import (
    Count,
    DurationField,
    ExpressionWrapper,
    Min,
    OuterRef,
    Subquery,
    Sum,
)
from django.db.models.functions import Coalesce

from django_semaphore import core
from django_semaphore.backends import DatabaseNow
from django_semaphore.guards import GuardedQuerySet
from django_semaphore.outcomes import ReleaseOutcome

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser

    from django_semaphore.models import Permit, PermitRequest, Semaphore  # noqa: F401

ACQUIRED = "ACQUIRED"  # models.State.ACQUIRED, without importing models here


class SemaphoreQuerySet(GuardedQuerySet["Semaphore"]):
    def with_usage(self) -> SemaphoreQuerySet:
        """Annotate ``in_use``: the sum of counts of ACQUIRED permits;
        ``waiters``: the number of live tickets (fair waiters queued);
        ``longest_wait``: how long the oldest of them has waited (a
        ``timedelta``, ``None`` when nobody waits).

        Correlated subqueries on the covering (semaphore, state, count) index
        and the ticket table, not joins: a join would read every released
        permit still retained, and keeps the admin's changelist at one query.
        """
        from django_semaphore.models import Permit, Ticket

        held = (
            Permit.objects.filter(semaphore=OuterRef("pk"), state=ACQUIRED)
            .order_by()
            .values("semaphore")
            .annotate(total=Sum("count"))
            .values("total")
        )
        live = (
            Ticket.objects.filter(semaphore=OuterRef("pk"), expires_at__gt=DatabaseNow())
            .order_by()
            .values("semaphore")
        )
        return self.annotate(
            in_use=Coalesce(Subquery(held), 0),
            waiters=Coalesce(Subquery(live.annotate(n=Count("pk")).values("n")), 0),
            longest_wait=ExpressionWrapper(
                DatabaseNow() - Subquery(live.annotate(since=Min("created_at")).values("since")),
                output_field=DurationField(),
            ),
        )


class SemaphoreManager(models.Manager["Semaphore"]):
    """``Semaphore.objects``: also the home of acquire, release and renew."""

    def get_queryset(self) -> SemaphoreQuerySet:
        return SemaphoreQuerySet(self.model, using=self._db)

    def with_usage(self) -> SemaphoreQuerySet:
        return self.get_queryset().with_usage()

    def acquire(
        self,
        names: Any,
        *,
        external_id: str,
        owner: str = "",
        ttl: int | float | timedelta | None = None,
        timeout: int | float | timedelta = 0,
        fair: bool = False,
    ) -> PermitRequest:
        """See :func:`django_semaphore.acquire`."""
        return core.acquire(
            names, external_id=external_id, owner=owner, ttl=ttl, timeout=timeout, fair=fair
        )

    def release(self, external_id: str) -> ReleaseOutcome:
        """See :func:`django_semaphore.release`."""
        return core.release(external_id)

    def renew(self, external_id: str, ttl: int | float | timedelta | None = None) -> PermitRequest:
        """See :func:`django_semaphore.renew`."""
        return core.renew(external_id, ttl)

    def set_capacity(
        self,
        name: str,
        capacity: int,
        *,
        changed_by: AbstractBaseUser | None = None,
        reason: str = "",
    ) -> Semaphore:
        """Change capacity under the row lock, writing a ``CapacityChange``."""
        return core.set_capacity(name, capacity, changed_by=changed_by, reason=reason)


class PermitRequestQuerySet(GuardedQuerySet["PermitRequest"]):
    def held(self) -> PermitRequestQuerySet:
        return self.filter(state=ACQUIRED)

    def expired(self) -> PermitRequestQuerySet:
        """Held past their expiry by the database's clock."""
        return self.held().filter(expires_at__lte=DatabaseNow())


PermitRequestManager = models.Manager.from_queryset(PermitRequestQuerySet)


class PermitQuerySet(GuardedQuerySet["Permit"]):
    """Permits: every column is the engine's (see ``Permit.ORM_REFUSED``)."""


PermitManager = models.Manager.from_queryset(PermitQuerySet)
