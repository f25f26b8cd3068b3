"""Admin: utilization at a glance; capacity changes go through the capacity API."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from django_semaphore.models import CapacityChange, PermitRequest, Semaphore


@admin.register(Semaphore)
class SemaphoreAdmin(admin.ModelAdmin):
    list_display = ["name", "capacity", "in_use", "fencing_counter", "updated_at"]
    search_fields = ["name"]
    fields = ["name", "capacity", "fencing_counter", "created_at", "updated_at"]
    readonly_fields = ["fencing_counter", "created_at", "updated_at"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Semaphore]:
        return Semaphore.objects.with_usage()

    def get_readonly_fields(self, request: HttpRequest, obj: Semaphore | None = None) -> Any:
        # Renaming would orphan every caller that uses the old name.
        return [*self.readonly_fields, "name"] if obj else self.readonly_fields

    @admin.display(description=_("in use"), ordering="in_use")
    def in_use(self, obj: Semaphore) -> int:
        return obj.in_use  # type: ignore[attr-defined,no-any-return]

    def save_model(
        self, request: HttpRequest, obj: Semaphore, form: ModelForm[Semaphore], change: bool
    ) -> None:
        if change:
            # Under the row lock, with a CapacityChange naming the user.
            Semaphore.objects.set_capacity(
                obj.name,
                obj.capacity,
                changed_by=request.user,  # type: ignore[arg-type]
            )
        else:
            super().save_model(request, obj, form, change)


@admin.register(PermitRequest)
class PermitRequestAdmin(admin.ModelAdmin):
    list_display = ["external_id", "owner", "state", "created_at", "expires_at", "release_reason"]
    list_filter = ["state", "release_reason"]
    search_fields = ["external_id", "owner"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(CapacityChange)
class CapacityChangeAdmin(admin.ModelAdmin):
    list_display = [
        "semaphore",
        "old_capacity",
        "new_capacity",
        "changed_by",
        "changed_at",
        "reason",
    ]
    list_filter = ["semaphore"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
