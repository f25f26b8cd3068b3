"""Managers: queries only. The operations are the package's functions
(``django_semaphore.acquire`` and the rest, in ``api.py``); nothing here
calls them, so the models sit below everything that does."""

from __future__ import annotations

from typing import TYPE_CHECKING

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

from django_semaphore.backends import DatabaseNow
from django_semaphore.guards import GuardedQuerySet
from django_semaphore.states import State

if TYPE_CHECKING:
    from django_semaphore.models import Permit, PermitRequest, Semaphore  # noqa: F401


class SemaphoreQuerySet(GuardedQuerySet["Semaphore"]):
    """``Semaphore.objects``' queries: semaphores locked, and with what waits on them."""

    def locked(self) -> SemaphoreQuerySet:
        """These rows, locked in name order, for the caller's transaction.

        The one lock order of the app: every path that locks semaphore rows
        (grant, release, family creation, capacity, the verifier, repairs,
        parked wake-ups, delete guards) runs this query, so no two of them
        can deadlock by taking the same rows in different orders. The grant
        compiles it once per connection (``engine.statements``).
        """
        return self.select_for_update().order_by("name")

    def with_usage(self) -> SemaphoreQuerySet:
        """Annotate ``waiters``: the number of live tickets (fair waiters
        queued); ``longest_wait``: how long the oldest of them has waited (a
        ``timedelta``, ``None`` when nobody waits). What is held is the
        ``in_use`` column itself.

        Correlated subqueries on the ticket table, not joins: that keeps the
        admin's changelist at one query.
        """
        # The model by its relation, not by import: models import this module.
        tickets = self.model._meta.get_field("tickets").related_model._default_manager
        live = (
            tickets.filter(semaphore=OuterRef("pk"), expires_at__gt=DatabaseNow())
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


SemaphoreManager = models.Manager.from_queryset(SemaphoreQuerySet)


class PermitRequestQuerySet(GuardedQuerySet["PermitRequest"]):
    """``PermitRequest.objects``' queries: the requests by where they stand."""

    def held(self) -> PermitRequestQuerySet:
        """Requests still ACQUIRED, whether or not their TTL has run out (see
        ``expired``): what the holders think they hold."""
        return self.filter(state=State.ACQUIRED)

    def expired(self) -> PermitRequestQuerySet:
        """Held past their expiry by the database's clock."""
        return self.held().filter(expires_at__lte=DatabaseNow())


PermitRequestManager = models.Manager.from_queryset(PermitRequestQuerySet)


class PermitQuerySet(GuardedQuerySet["Permit"]):
    """Permits: every column is the engine's (see ``Permit.ORM_REFUSED``)."""


PermitManager = models.Manager.from_queryset(PermitQuerySet)
