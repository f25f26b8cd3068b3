"""Managers: queries only. The operations are the package's functions
(``django_semaphore.acquire`` and the rest, in ``api.py``); nothing here
calls them, so the models sit below everything that does."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any, Self, TypeVar, cast

from django.db import models
from django.db.models import (
    BigIntegerField,
    Case,
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    Max,
    Min,
    OuterRef,
    Q,
    Subquery,
    Sum,
    When,
)
from django.db.models.functions import Cast, Coalesce, Greatest

from django_semaphore.backends import DatabaseNow
from django_semaphore.guards import GuardedQuerySet
from django_semaphore.states import State
from django_semaphore.validation import validate_flag, validate_name

M = TypeVar("M", bound=models.Model)


def _related_model(model: type[models.Model], name: str) -> type[models.Model]:
    """The model related to ``model`` by ``name``: by the relation, not by
    import, as the models import this module."""
    return cast(type[models.Model], model._meta.get_field(name).related_model)


def _validate_fair(fair: Any) -> bool:
    return validate_flag(fair, "fair")


def _validate_looked_up_name(lookups: dict[str, Any]) -> None:
    name = lookups.get("name")
    if name is not None and not hasattr(name, "resolve_expression"):
        validate_name(name)


class SemaphoreQuerySet(GuardedQuerySet[M]):
    """``Semaphore.objects``' queries: semaphores locked, and with what waits on them."""

    def locked(self) -> Self:
        """These rows, locked in name order, for the caller's transaction.

        The one lock order of the app: every path that locks semaphore rows
        (grant, release, family creation, capacity, the verifier, repairs,
        parked wake-ups, delete guards) runs this query, so no two of them
        can deadlock by taking the same rows in different orders. The grant
        compiles it once per connection (``engine.statements``).
        """
        return self.select_for_update().order_by("name")

    def rate_limits(self) -> Self:
        """Those with a window (``limits.Limit.is_rate``)."""
        return self.filter(window__isnull=False)

    def bulk_create(self, objs: Any, *args: Any, **kwargs: Any) -> list[M]:
        """Create the semaphores and their release counters (``ReleaseCounter``).

        Raises:
            InvalidRequest: a name, capacity or window ``set_capacity`` or
                ``set_window`` would refuse; nothing is written.
        """
        objs = list(objs)
        for semaphore in objs:
            semaphore.validate_limits()
        # Semaphores, whose fields this generic queryset cannot name.
        created: list[Any] = super().bulk_create(objs, *args, **kwargs)
        counter = _related_model(self.model, "release_counter")
        missing = (
            self.model._base_manager.using(self.db)
            .filter(name__in=[s.name for s in created], release_counter__isnull=True)
            .values_list("pk", flat=True)
        )
        counter._default_manager.using(self.db).bulk_create(
            [counter(semaphore_id=pk) for pk in missing], ignore_conflicts=True
        )
        for semaphore in created:
            semaphore.in_use = semaphore.in_use_counter
        return created

    def update(self, **kwargs: Any) -> int:
        """As Django's, refusing a ``name`` or ``fair`` no semaphore may have
        with ``InvalidRequest`` before the driver sees it (the capacity and
        window are refused whatever their value: see guards.py)."""
        for field, validate in (("name", validate_name), ("fair", _validate_fair)):
            if field in kwargs and not hasattr(kwargs[field], "resolve_expression"):
                validate(kwargs[field])
        return super().update(**kwargs)

    def get_or_create(
        self, defaults: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> tuple[M, bool]:
        """As Django's; a ``name`` no semaphore may have is refused before
        the look-up (whose driver may fail on it first)."""
        _validate_looked_up_name(kwargs)
        return super().get_or_create(defaults, **kwargs)

    def update_or_create(
        self,
        defaults: Mapping[str, Any] | None = None,
        create_defaults: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> tuple[M, bool]:
        """As ``get_or_create``."""
        _validate_looked_up_name(kwargs)
        return super().update_or_create(defaults, create_defaults, **kwargs)

    def with_usage(self) -> Self:
        """Annotate what holds and waits on each semaphore (what is held is
        the ``in_use`` column itself): ``holders``, the requests holding
        permits; ``waiters``, the live tickets of waiters (queued in
        their processes; parked tasks are ``parking.with_parked``'s);
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
            _related_model(self.model, "permits")
            ._default_manager.filter(semaphore=OuterRef("pk"), state=State.ACQUIRED)
            .order_by()
            .values("semaphore")
        )
        live = (
            _related_model(self.model, "tickets")
            ._default_manager.filter(semaphore=OuterRef("pk"), expires_at__gt=DatabaseNow())
            .filter(parked__id__isnull=True)  # parked tasks are counted apart (parking)
            .order_by()
            .values("semaphore")
        )
        return self.annotate(
            holders=_counted(held, Count("request_id", distinct=True)),
            waiters=_counted(live, Count("pk")),
            waiting_since=Subquery(live.annotate(since=Min("created_at")).values("since")),
        ).annotate(
            longest_wait=ExpressionWrapper(
                DatabaseNow() - F("waiting_since"), output_field=DurationField()
            ),
        )


def _counted(rows: models.QuerySet[Any], count: Count) -> Coalesce:
    """``count`` of the rows of a correlated subquery, 0 when there are none."""
    number = Subquery(rows.annotate(n=count).values("n"))
    return Coalesce(number, 0, output_field=BigIntegerField())


_SemaphoreManager = models.Manager.from_queryset(SemaphoreQuerySet)


class SemaphoreManager(_SemaphoreManager[M]):
    """Every query annotates ``in_use``, what counts against the capacity:
    the permits held, or on a rate limit the grants of its window (see
    ``in_use``).

    The type checker knows only the model's fields: the code names the
    annotation through ``F("in_use")`` or ``Q(in_use=...)``.
    """

    def get_queryset(self) -> SemaphoreQuerySet[M]:
        queryset = super().get_queryset()
        counter = _related_model(queryset.model, "release_counter")
        permit = _related_model(queryset.model, "permits")
        # Splatted: the type checker takes the model's declared ``in_use`` as it.
        annotated = queryset.annotate(**{"in_use": in_use(counter, permit)})
        return cast(SemaphoreQuerySet[M], annotated)


def in_use(counter: type[models.Model], permit: type[models.Model]) -> Case:
    """What counts against a semaphore's capacity: the permits held
    (``held``), or on a windowed semaphore (a rate limit) the permits
    granted in the current window, released or not (``in_window``)."""
    return Case(When(window__isnull=True, then=held(counter)), default=in_window(permit))


def held(counter: type[models.Model]) -> Greatest:
    """The permits held on a semaphore, as the grant counts them
    (``rows.held``): its ``in_use_counter`` less the releases counted on its
    ``ReleaseCounter`` since the last fold, never below zero.
    """
    released = counter._default_manager.filter(semaphore=OuterRef("pk")).values("released")
    unfolded = Coalesce(_signed(Subquery(released)), 0) - _signed("released_folded")
    return _not_below_zero(_signed("in_use_counter") - _not_below_zero(unfolded))


def in_window(permit: type[models.Model]) -> Greatest:
    """The permits a windowed semaphore granted in the current window: its
    ``slots_open`` less the slots that ended since a grant last closed them,
    by a range of the permits' (semaphore, slot_ends) index: about a
    window's grants at most (the grant closes them once a window), never
    the slots of past windows."""
    ended = Coalesce(not_closed(permit, slot_ends__lte=DatabaseNow()), 0)
    return _not_below_zero(_signed("slots_open") - ended)


def _signed(value: Any) -> Cast:
    """``value`` as a signed BIGINT: MySQL refuses an unsigned difference below zero."""
    return Cast(value, BigIntegerField())


def _not_below_zero(value: Any) -> Greatest:
    return Greatest(value, 0, output_field=BigIntegerField())


def not_closed(permit: type[models.Model], **slots: Any) -> Case:
    """The sum of a semaphore's slots (``slots`` filters them further) that
    end after ``slots_closed_until``, the last close of its slots: what its
    ``slots_open`` counts (the verifier's), or of those the slots that ended
    (``in_window``'s).

    Two ranges of the index chosen by a CASE, not one filter with an OR on
    the outer row's column: PostgreSQL makes no bound of that, and reads
    every slot the semaphore ever had. (NULL: nothing closed yet, before a
    first grant.)
    """
    total = (
        permit._default_manager.filter(semaphore=OuterRef("pk"), slot_ends__isnull=False, **slots)
        .order_by()
        .values("semaphore")
        .annotate(total=Sum("count"))
        .values("total")
    )
    return Case(
        When(slots_closed_until__isnull=True, then=Subquery(total)),
        default=Subquery(total.filter(slot_ends__gt=OuterRef("slots_closed_until"))),
    )


class ReleaseCounterQuerySet(GuardedQuerySet[M]):
    """``ReleaseCounter.objects``' queries."""

    def locked(self) -> Self:
        """These counters, locked in semaphore id order, for the caller's
        transaction: every release locks the counters of what it frees so
        (the release by key through permits inserted in that order), and
        only releases and the verifier lock them."""
        return self.select_for_update().order_by("semaphore_id")


ReleaseCounterManager = models.Manager.from_queryset(ReleaseCounterQuerySet)


class PermitRequestQuerySet(GuardedQuerySet[M]):
    """``PermitRequest.objects``' queries: the requests by where they stand."""

    def held(self) -> Self:
        """Requests still ACQUIRED, whether or not their TTL has run out (see
        ``expired``): what the holders think they hold."""
        return self.filter(state=State.ACQUIRED)

    def expired(self) -> Self:
        """Held past their expiry by the database's clock."""
        return self.held().filter(expires_at__lte=DatabaseNow())


PermitRequestManager = models.Manager.from_queryset(PermitRequestQuerySet)


class PermitQuerySet(GuardedQuerySet[M]):
    """Permits: every column is the engine's (see ``Permit.ORM_REFUSED``)."""

    def counting(self) -> Self:
        """Rate limits' slots that still count, by the database's clock,
        earliest end first: the first is when the next slot frees."""
        return self.filter(slot_ends__gt=DatabaseNow()).order_by("slot_ends")


PermitManager = models.Manager.from_queryset(PermitQuerySet)


class TicketQuerySet(models.QuerySet[M]):
    """``Ticket.objects``' queries: the semaphores' lines."""

    def live(self) -> Self:
        """Tickets whose waiters still wait: before their deadline."""
        return self.filter(expires_at__gt=DatabaseNow())

    def holding_back(self) -> Self:
        """Live tickets that lacked room: each keeps the room it asks for
        from younger waiters (``engine/fairness.py``)."""
        return self.filter(lacked=True, expires_at__gt=DatabaseNow())

    def in_line(self) -> Self:
        """In their places in line: ``ranked_at``, then ``id`` (``engine/line.py``)."""
        return self.order_by("ranked_at", "id")

    def ahead_of(self, ranked_at: datetime, id: int) -> Self:
        """The tickets ahead of the place ``(ranked_at, id)`` (``engine/line.py``)."""
        return self.filter(Q(ranked_at__lt=ranked_at) | Q(ranked_at=ranked_at, id__lt=id))

    def turns(
        self, semaphore_ids: Collection[int], share: str, now: datetime
    ) -> dict[int, tuple[datetime, datetime | None]]:
        """Semaphore id -> the earliest turn of the live tickets with a
        share key there, and ``share``'s latest (``engine/line.turn``);
        semaphores where none waits are left out."""
        turns = (
            self.filter(semaphore_id__in=semaphore_ids, turn_at__isnull=False, expires_at__gt=now)
            .order_by()
            .values("semaphore_id")
            .annotate(first=Min("turn_at"), last=Max("turn_at", filter=Q(share=share)))
        )
        return {row["semaphore_id"]: (row["first"], row["last"]) for row in turns}

    def per_share(self, *by: str) -> models.QuerySet[Any, tuple[Any, ...]]:
        """``(*by, share key, tickets)`` of these tickets that have a share
        key, most first: per key, and per the fields ``by`` names too."""
        shared = self.exclude(share="").order_by().values_list(*by, "share")
        counted = shared.annotate(n=Count("pk")).order_by("-n", *by, "share")
        return cast(models.QuerySet[Any, tuple[Any, ...]], counted)

    def of_parked(self) -> Self:
        """Live tickets of parked tasks not woken yet."""
        return self.filter(
            parked__id__isnull=False, parked__woken_at__isnull=True, expires_at__gt=DatabaseNow()
        )


TicketManager = models.Manager.from_queryset(TicketQuerySet)
