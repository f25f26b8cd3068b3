"""Managers: queries only. The operations are the package's functions
(``django_semaphore.acquire`` and the rest, in ``api.py``); nothing here
calls them, so the models sit below everything that does."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from django.db import models
from django.db.models import (
    BigIntegerField,
    Count,
    DurationField,
    ExpressionWrapper,
    F,
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
        """Annotate what holds and waits on each semaphore (what is held is
        the ``in_use`` column itself): ``holders``, the requests holding
        permits; ``waiters``, the live tickets (fair waiters queued);
        ``waiting_since``, when the oldest of them queued, and
        ``longest_wait``, how long ago that was (a ``timedelta``; both
        ``None`` when nobody waits).

        Correlated subqueries, not joins, so that a list of semaphores stays
        one query: the holders' subquery has ``state = 'ACQUIRED'`` in its
        WHERE clause, so it reads the (semaphore, state, count) index of held
        permits only, where a join would read every released permit kept for
        retention.
        """
        held = (
            self._related("permits")
            .filter(semaphore=OuterRef("pk"), state=State.ACQUIRED)
            .order_by()
            .values("semaphore")
        )
        live = (
            self._related("tickets")
            .filter(semaphore=OuterRef("pk"), expires_at__gt=DatabaseNow())
            .order_by()
            .values("semaphore")
        )
        return self.annotate(
            holders=Coalesce(
                Subquery(held.annotate(n=Count("request_id", distinct=True)).values("n")),
                0,
                output_field=BigIntegerField(),
            ),
            waiters=Coalesce(
                Subquery(live.annotate(n=Count("pk")).values("n")),
                0,
                output_field=BigIntegerField(),
            ),
            waiting_since=Subquery(live.annotate(since=Min("created_at")).values("since")),
        ).annotate(
            longest_wait=ExpressionWrapper(
                DatabaseNow() - F("waiting_since"), output_field=DurationField()
            ),
        )

    def _related(self, name: str) -> models.QuerySet[Any]:
        """The rows of a model related by ``name``: by the relation, not by
        import, as the models import this module."""
        model = cast(type[models.Model], self.model._meta.get_field(name).related_model)
        return model._default_manager.all()


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
