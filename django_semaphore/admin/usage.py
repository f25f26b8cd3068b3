"""What the semaphore list reads: its columns, annotated in the one query that
lists the rows, and the usage filter over them."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import (
    BigIntegerField,
    Case,
    Exists,
    FloatField,
    Model,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Value,
    When,
)
from django.db.models.functions import Cast
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from django_semaphore.managers import SemaphoreQuerySet
from django_semaphore.models import CapacityChange, Permit
from django_semaphore.states import State

# Sorts a closed semaphore (capacity 0) that still has holders above any ratio.
INFINITE_UTILIZATION = 1e18


def annotated(obj: Model, name: str) -> int:
    """A count annotated by ``with_usage()``; MySQL returns sums as ``Decimal``."""
    return int(getattr(obj, name))


def with_changelist_columns(queryset: SemaphoreQuerySet) -> SemaphoreQuerySet:
    """The changelist's columns, all in the one query that lists rows: the
    manager's ``with_usage()``, the last capacity change, and two aliases
    computed only to sort by them (``available``, ``utilization``)."""
    last_change = CapacityChange.objects.filter(semaphore=OuterRef("pk")).order_by(
        "-changed_at", "-id"
    )
    return (
        queryset.with_usage()
        .annotate(last_capacity_change=Subquery(last_change.values("changed_at")[:1]))
        .alias(
            # Signed: both are UNSIGNED on MySQL, where a negative difference
            # (over capacity) would be an error rather than a number.
            available=Cast("capacity", BigIntegerField()) - Cast("in_use", BigIntegerField()),
            utilization=Case(
                When(capacity=0, in_use=0, then=Value(0.0)),
                When(capacity=0, then=Value(INFINITE_UTILIZATION)),
                default=Cast("in_use", FloatField()) / Cast("capacity", FloatField()),
                output_field=FloatField(),
            ),
        )
    )


class UsageFilter(admin.SimpleListFilter):
    title = _("usage")
    parameter_name = "usage"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [
            ("idle", _("idle")),
            ("room", _("in use, with room")),
            ("full", _("full (no room left)")),
            ("over", _("over capacity")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        # The annotations come from SemaphoreAdmin.get_queryset().
        match self.value():
            case "idle":
                # A rate limit is idle when its window holds no grant, released or not.
                held = Permit.objects.filter(semaphore=OuterRef("pk"), state=State.ACQUIRED)
                return queryset.filter(
                    Q(window__isnull=True) & ~Exists(held) | Q(window__isnull=False, in_use=0)
                )
            case "room":
                return queryset.filter(in_use__gt=0, available__gt=0)
            case "full":
                return queryset.filter(available__lte=0)
            case "over":
                return queryset.filter(available__lt=0)
        return queryset
