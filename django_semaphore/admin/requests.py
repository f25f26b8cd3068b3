"""Permit requests: read-only, with a force-release action guarded by its own
permission and recorded in the admin's history (``LogEntry``) with the user."""

from __future__ import annotations

from typing import Any, cast

from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth import get_permission_codename
from django.contrib.auth.base_user import AbstractBaseUser
from django.db.models import Prefetch, QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_semaphore import api, routing
from django_semaphore.admin.base import ReadOnly, ReadOnlyAdmin
from django_semaphore.admin.display import demand, expiry
from django_semaphore.backends import DatabaseNow
from django_semaphore.models import Permit, PermitRequest
from django_semaphore.states import ReleaseOutcome, State


class ExpiredFilter(admin.SimpleListFilter):
    title = _("expired")
    parameter_name = "expired"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("yes", _("yes, still held")), ("no", _("no"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        # By the database's clock, the one acquire and the sweep decide by.
        expired = {"state": State.ACQUIRED, "expires_at__lte": DatabaseNow()}
        if self.value() == "yes":
            return queryset.filter(**expired)
        if self.value() == "no":
            return queryset.exclude(**expired)
        return queryset


class PermitInline(ReadOnly, admin.TabularInline):
    """The request's share of each semaphore: read-only, 1..n rows."""

    model = Permit
    # No extra forms, no delete boxes: ReadOnly, and the request's own page
    # is read-only too (Django then offers neither).
    fields = ("semaphore", "count", "state", "fencing_token")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Permit]:
        permits = super().get_queryset(request).using(routing.current_alias())
        return permits.select_related("semaphore").order_by("semaphore__name")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Permits have no admin of their own: seeing the request is seeing them.
        return self.admin_site.get_model_admin(PermitRequest).has_view_permission(request, obj)


@admin.register(PermitRequest)
class PermitRequestAdmin(ReadOnlyAdmin):
    list_display = [
        "external_id",
        "owner",
        "state",
        "semaphores",
        "created_at",
        "expires",
        "released_at",
        "release_reason",
    ]
    list_filter = ["state", "permits__semaphore", "release_reason", ExpiredFilter]
    search_fields = ["external_id", "owner"]
    ordering = ["-created_at", "-id"]
    actions = ["force_release"]
    inlines = [PermitInline]
    fieldsets = [
        (None, {"fields": ["external_id", "owner", "state", "release_reason"]}),
        (_("Timing"), {"fields": ["ttl", "created_at", "expires_at", "released_at", "updated_at"]}),
    ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[PermitRequest]:
        # One more query per page for the semaphore names, however many rows.
        permits = Permit.objects.using(routing.current_alias()).select_related("semaphore")
        by_name = Prefetch("permits", queryset=permits.order_by("semaphore__name"))
        return super().get_queryset(request).prefetch_related(by_name)

    @admin.display(description=_("semaphores"))
    def semaphores(self, obj: PermitRequest) -> str:
        return demand(obj.permits.all())

    @admin.display(description=_("expires"), ordering="expires_at")
    def expires(self, obj: PermitRequest) -> str:
        if obj.state != State.ACQUIRED:
            return self.get_empty_value_display()
        return expiry(obj.expires_at, timezone.now())

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        codename = get_permission_codename("force_release", self.opts)
        return request.user.has_perm(f"{self.opts.app_label}.{codename}")

    @admin.action(
        permissions=["force_release"], description=_("Force-release selected permit requests")
    )
    def force_release(self, request: HttpRequest, queryset: QuerySet[PermitRequest]) -> None:
        """End the selected held requests now (``release_reason="admin"``).

        Their holders find out at their next renew or release. Each request
        this ends gets a ``LogEntry`` naming the user, shown in its history.
        """
        selected = list(queryset.values_list("external_id", "state"))
        held = [key for key, state in selected if state == State.ACQUIRED]
        outcomes = api.force_release(held) if held else {}
        ended = [key for key, outcome in outcomes.items() if outcome is ReleaseOutcome.RELEASED]
        if ended:
            LogEntry.objects.log_actions(
                user_id=cast(AbstractBaseUser, request.user).pk,
                queryset=queryset.model.objects.using(routing.current_alias()).filter(
                    external_id__in=ended
                ),
                action_flag=CHANGE,
                change_message=gettext("Force-released (release reason: admin)."),
            )
            self.message_user(
                request,
                ngettext(
                    "%(count)d permit request was force-released.",
                    "%(count)d permit requests were force-released.",
                    len(ended),
                )
                % {"count": len(ended)},
                messages.SUCCESS,
            )
        skipped = len(selected) - len(ended)
        if skipped:
            self.message_user(
                request,
                ngettext(
                    "%(count)d selected permit request was not held and was left as it was.",
                    "%(count)d selected permit requests were not held and were left as they were.",
                    skipped,
                )
                % {"count": skipped},
                messages.WARNING,
            )
