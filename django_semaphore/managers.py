"""Managers: the ORM entry points. The operations themselves live in ``api.py``."""

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
)
from django.db.models.functions import Coalesce

from django_semaphore import api
from django_semaphore.backends import DatabaseNow
from django_semaphore.guards import GuardedQuerySet
from django_semaphore.outcomes import ReleaseOutcome

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser

    from django_semaphore.models import Permit, PermitRequest, Semaphore  # noqa: F401

ACQUIRED = "ACQUIRED"  # models.State.ACQUIRED, without importing models here


class SemaphoreQuerySet(GuardedQuerySet["Semaphore"]):
    """``Semaphore.objects``' queries: semaphores with what waits on them."""

    def with_usage(self) -> SemaphoreQuerySet:
        """Annotate ``waiters``: the number of live tickets (fair waiters
        queued); ``longest_wait``: how long the oldest of them has waited (a
        ``timedelta``, ``None`` when nobody waits). What is held is the
        ``in_use`` column itself.

        Correlated subqueries on the ticket table, not joins: that keeps the
        admin's changelist at one query.
        """
        from django_semaphore.models import Ticket

        live = (
            Ticket.objects.filter(semaphore=OuterRef("pk"), expires_at__gt=DatabaseNow())
            .order_by()
            .values("semaphore")
        )
        return self.annotate(
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
        """Every semaphore with its fair waiters annotated (see
        [SemaphoreQuerySet.with_usage][django_semaphore.managers.SemaphoreQuerySet.with_usage])."""
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
        """See [acquire][django_semaphore.acquire]."""
        return api.acquire(
            names, external_id=external_id, owner=owner, ttl=ttl, timeout=timeout, fair=fair
        )

    def release(self, external_id: str) -> ReleaseOutcome:
        """See [release][django_semaphore.release]."""
        return api.release(external_id)

    def renew(self, external_id: str, ttl: int | float | timedelta | None = None) -> PermitRequest:
        """See [renew][django_semaphore.renew]."""
        return api.renew(external_id, ttl)

    def set_capacity(
        self,
        name: str,
        capacity: int,
        *,
        changed_by: AbstractBaseUser | None = None,
        reason: str = "",
    ) -> Semaphore:
        """Change capacity under the row lock, writing a ``CapacityChange``."""
        return api.set_capacity(name, capacity, changed_by=changed_by, reason=reason)


class PermitRequestQuerySet(GuardedQuerySet["PermitRequest"]):
    """``PermitRequest.objects``' queries: the requests by where they stand."""

    def held(self) -> PermitRequestQuerySet:
        """Requests still ACQUIRED, whether or not their TTL has run out (see
        ``expired``): what the holders think they hold."""
        return self.filter(state=ACQUIRED)

    def expired(self) -> PermitRequestQuerySet:
        """Held past their expiry by the database's clock."""
        return self.held().filter(expires_at__lte=DatabaseNow())


PermitRequestManager = models.Manager.from_queryset(PermitRequestQuerySet)


class PermitQuerySet(GuardedQuerySet["Permit"]):
    """Permits: every column is the engine's (see ``Permit.ORM_REFUSED``)."""


PermitManager = models.Manager.from_queryset(PermitQuerySet)
