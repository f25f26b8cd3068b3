"""Semaphores: the list with usage and waiters, and the change page, where
capacity and a rate limit's window are edited through the same API as code
(row lock + ``CapacityChange`` with the user); below the form, the 24-hour
chart, current holders, the line of waiters and capacity history."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, cast

from django import forms
from django.contrib import admin
from django.contrib.auth.base_user import AbstractBaseUser
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import capfirst
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from django_semaphore import conf, parking, routing
from django_semaphore.admin.base import OperatorAdmin
from django_semaphore.admin.display import counted_link, duration, elapsed, usage_bar
from django_semaphore.admin.sections import holders_url, sections
from django_semaphore.admin.usage import UsageFilter, annotated, with_changelist_columns
from django_semaphore.api import set_capacity, set_window
from django_semaphore.backends import DatabaseNow
from django_semaphore.managers import SemaphoreQuerySet
from django_semaphore.models import (
    CapacityChange,
    ParkedTask,
    Permit,
    PermitRequest,
    Semaphore,
    Ticket,
)
from django_semaphore.states import State
from django_semaphore.validation import MAX_COUNT, MAX_LENGTH

# The read-only sections of a semaphore's page: "Usage now" (``next_slot``
# on a rate limit only) and "Bookkeeping".
USAGE_NOW = [
    "in_use",
    "next_slot",
    "available",
    "utilization",
    "holders",
    "waiters",
    "longest_wait",
    "parked",
    "oldest_parked",
]
BOOKKEEPING = ("fencing_counter", "created_at", "updated_at")


class FamilyFilter(admin.SimpleListFilter):
    """A family's default row and its members; shown only where families are
    declared (the choices are read per request, never at import)."""

    title = _("family")
    parameter_name = "family"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [(family.pattern, family.pattern) for family in conf.families()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() is None:
            return queryset
        return queryset.filter(Q(family=self.value()) | Q(name=self.value()))


class SemaphoreForm(forms.ModelForm):
    capacity = forms.IntegerField(
        label=_("Capacity"),
        min_value=0,
        max_value=MAX_COUNT,
        help_text=_(
            "Lowering it below what is in use is allowed: holders keep their permits "
            "and nothing new is granted until usage falls below it."
        ),
    )
    reason = forms.CharField(
        label=_("Reason for the change"),
        max_length=MAX_LENGTH,
        required=False,
        help_text=_("Optional; kept in the capacity history with your name."),
    )

    class Meta:
        model = Semaphore
        fields = ["name", "capacity", "window"]

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if cleaned.get("reason") and not {"capacity", "window"} & set(self.changed_data):
            self.add_error(
                "reason",
                _("A reason is recorded with a change of capacity or window, but neither changed."),
            )
        return cleaned


@admin.register(Semaphore)
class SemaphoreAdmin(OperatorAdmin):
    form = SemaphoreForm
    list_display = [
        "name",
        "capacity",
        "rate",
        "in_use",
        "available",
        "utilization",
        "holders",
        "waiters",
        "longest_wait",
        "last_capacity_change",
        "parked",
        "oldest_parked",
    ]
    list_filter = [UsageFilter, FamilyFilter]
    search_fields = ["name"]
    readonly_fields = ["rate", "family_role", *USAGE_NOW, *BOOKKEEPING]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Semaphore]:
        queryset = cast(SemaphoreQuerySet, super().get_queryset(request))
        return parking.with_parked(with_changelist_columns(queryset))

    def get_fieldsets(self, request: HttpRequest, obj: Semaphore | None = None) -> Any:
        settings = ["name", "capacity", "window"]
        if obj is None:
            return [(None, {"fields": settings})]
        if self.has_change_permission(request, obj):
            settings.append("reason")
        if obj.family or conf.is_family_default(obj.name):
            settings.append("family_role")
        usage_now = [f for f in USAGE_NOW if f != "next_slot" or obj.limit.is_rate]
        return [
            (None, {"fields": settings}),
            (_("Usage now"), {"fields": usage_now}),
            (_("Bookkeeping"), {"fields": BOOKKEEPING, "classes": ["collapse"]}),
        ]

    def get_readonly_fields(
        self, request: HttpRequest, obj: Semaphore | None = None
    ) -> list[str] | tuple[str, ...]:
        # Renaming would strand every caller that acquires by the old name.
        return [*self.readonly_fields, "name"] if obj else self.readonly_fields

    @admin.display(description=_("family"))
    def family_role(self, obj: Semaphore) -> SafeString | str:
        """What a capacity change here does: to a family's default, or to one member."""
        if conf.is_family_default(obj.name):
            return format_html(
                '{} <a href="{}">{}</a>',
                gettext(
                    "The default of this family: a change is made to every member that "
                    "follows it, and to members created from then on."
                ),
                self.admin_url(Semaphore, "changelist", family=obj.name),
                gettext("Its members"),
            )
        if not obj.family:
            return self.get_empty_value_display()
        if obj.own_capacity:
            return gettext(
                "Member of %(family)s, with a capacity of its own (kept by the clean-up)."
            ) % {"family": obj.family}
        return gettext(
            "Member of %(family)s, following its default; deleted by the clean-up when idle."
        ) % {"family": obj.family}

    @admin.display(description=_("rate"), ordering="window")
    def rate(self, obj: Semaphore) -> str:
        """A rate limit's capacity per window ("5/min"); nothing for a concurrency limit."""
        return str(obj.limit) if obj.limit.is_rate else self.get_empty_value_display()

    @admin.display(description=_("in use"), ordering="in_use")
    def in_use(self, obj: Semaphore) -> SafeString | int:
        """The permits held, or on a rate limit the grants in its current window."""
        count = annotated(obj, "in_use")
        if not obj.limit.is_rate:
            return count
        return format_html(
            '<span class="in-window" title="{}" style="white-space: nowrap">{}</span>',
            gettext("granted in the last %(seconds)d seconds, released or not")
            % {"seconds": obj.window},
            gettext("%(count)d in window") % {"count": count},
        )

    @admin.display(description=_("next slot"))
    def next_slot(self, obj: Semaphore) -> str:
        """When a rate limit has room for one more grant, by the database's
        clock: now, or when enough of its slots have ended (the earliest one,
        unless the capacity was lowered below what the window holds)."""
        needed = annotated(obj, "in_use") + 1 - obj.capacity
        if needed <= 0:
            return gettext("now")
        if obj.capacity == 0:
            return gettext("never (capacity 0)")
        slots = (
            Permit.objects.using(routing.current_alias())
            .counting()
            .filter(semaphore=obj)
            .annotate(now=DatabaseNow())
            .values_list("slot_ends", "count", "now")
        )
        for ends, count, now in slots[:needed]:
            needed -= count
            if needed <= 0:
                # Rounded up: "in 0 seconds" would promise room that is not there yet.
                seconds = math.ceil((cast(datetime, ends) - now).total_seconds())
                return gettext("in %(time)s") % {"time": elapsed(timedelta(seconds=seconds))}
        # The window ended between reading usage and its slots.
        return gettext("now")

    @admin.display(description=_("available"), ordering="available")
    def available(self, obj: Semaphore) -> int:
        # Over capacity nothing is available; the bar shows by how much it is over.
        return max(obj.capacity - annotated(obj, "in_use"), 0)

    @admin.display(description=_("utilization"), ordering="utilization")
    def utilization(self, obj: Semaphore) -> SafeString:
        return usage_bar(annotated(obj, "in_use"), obj.capacity)

    @admin.display(description=_("holders"), ordering="holders")
    def holders(self, obj: Semaphore) -> SafeString | int:
        return counted_link(annotated(obj, "holders"), holders_url(self, obj))

    @admin.display(description=_("waiters"), ordering="waiters")
    def waiters(self, obj: Semaphore) -> int:
        return annotated(obj, "waiters")

    @admin.display(description=_("longest wait"), ordering="waiting_since")
    def longest_wait(self, obj: Semaphore) -> str:
        since: datetime | None = getattr(obj, "waiting_since", None)
        if since is None:
            return self.get_empty_value_display()
        return duration(since, timezone.now())

    @admin.display(description=_("parked tasks"), ordering="parked")
    def parked(self, obj: Semaphore) -> SafeString | int:
        url = self.admin_url(ParkedTask, "changelist", tickets__semaphore__id__exact=obj.pk)
        return counted_link(annotated(obj, "parked"), url)

    @admin.display(description=_("oldest parked"), ordering="parked_since")
    def oldest_parked(self, obj: Semaphore) -> str:
        """How long the first parked task in line has waited, by the database's clock."""
        waited: timedelta | None = getattr(obj, "oldest_parked", None)
        if waited is None:
            return self.get_empty_value_display()
        return elapsed(waited)

    @admin.display(description=_("last capacity change"), ordering="last_capacity_change")
    def last_capacity_change(self, obj: Semaphore) -> SafeString | str:
        changed_at: datetime | None = getattr(obj, "last_capacity_change", None)
        if changed_at is None:
            return self.get_empty_value_display()
        return format_html(
            '<a href="{}" title="{}">{}</a>',
            self.admin_url(CapacityChange, "changelist", semaphore__id__exact=obj.pk),
            changed_at.isoformat(timespec="seconds"),
            gettext("%(time)s ago") % {"time": duration(changed_at, timezone.now())},
        )

    def save_model(
        self, request: HttpRequest, obj: Semaphore, form: forms.ModelForm, change: bool
    ) -> None:
        if not change:
            obj.save(using=routing.current_alias())
            return
        # The same path as code: under the row lock, recorded with the user;
        # what the form did not change is not written back (someone else's
        # change since the form was opened stays), and both changed are one
        # change, one record.
        who = cast(AbstractBaseUser, request.user)
        reason = form.cleaned_data.get("reason", "")
        limits = {f: form.cleaned_data[f] for f in ("capacity", "window") if f in form.changed_data}
        if "capacity" in limits:
            saved = set_capacity(obj.name, **limits, changed_by=who, reason=reason)
        elif limits:
            saved = set_window(obj.name, limits["window"], changed_by=who, reason=reason)
        else:
            return
        obj.capacity, obj.window, obj.updated_at = saved.capacity, saved.window, saved.updated_at

    def get_deleted_objects(
        self, objs: Sequence[Any] | QuerySet[Any], request: HttpRequest
    ) -> tuple[list[Any], dict[Any, Any], set[Any], list[Any]]:
        to_delete, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        # A semaphore's capacity history goes with it; it has no delete
        # permission of its own, being read-only everywhere else.
        perms_needed.discard(CapacityChange._meta.verbose_name)
        # Deleting a held semaphore would end its holders' permits behind
        # their backs, and one waited on would leave its parked tasks and
        # waiters waiting for nothing: they are shown as protected, and
        # block it (the model's delete refuses it too).
        alias = routing.current_alias()
        semaphores = list(objs)
        held = (
            PermitRequest.objects.using(alias)
            .filter(state=State.ACQUIRED, permits__semaphore__in=semaphores)
            .distinct()
        )
        waiting = Ticket.objects.using(alias).live().filter(semaphore__in=semaphores)
        parked = ParkedTask.objects.using(alias).filter(key__in=waiting.values("external_id"))
        for model, found in ((PermitRequest, held), (ParkedTask, parked)):
            protected.extend(
                format_html(
                    '{}: <a href="{}">{}</a>',
                    capfirst(model._meta.verbose_name),
                    self.admin_url(model, "change", each.pk),
                    each,
                )
                for each in found
            )
        protected.extend(
            format_html("{}: {} ({})", gettext("Waiter"), ticket.external_id, ticket.owner)
            for ticket in waiting.filter(parked__id__isnull=True)
        )
        return to_delete, counts, perms_needed, protected

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Semaphore | None = None,
    ) -> HttpResponse:
        if obj is not None and obj.pk is not None:
            context.update(sections(self, request, obj))
        return super().render_change_form(request, context, add, change, form_url, obj)
