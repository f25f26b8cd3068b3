"""Capacity history: read-only, written by every change of capacity or window
with its user and reason."""

from __future__ import annotations

from django.contrib import admin
from django.utils.translation import gettext_lazy as _

from django_semaphore.admin.base import ReadOnlyAdmin
from django_semaphore.admin.display import limit_change
from django_semaphore.models import CapacityChange


@admin.register(CapacityChange)
class CapacityChangeAdmin(ReadOnlyAdmin):
    list_display = ["changed_at", "semaphore", "change", "changed_by", "reason"]
    list_filter = ["semaphore", ("changed_by", admin.RelatedOnlyFieldListFilter)]
    list_select_related = ["semaphore", "changed_by"]
    search_fields = ["semaphore__name", "reason"]
    fields = [
        "semaphore",
        "old_capacity",
        "new_capacity",
        "old_window",
        "new_window",
        "changed_by",
        "changed_at",
        "reason",
    ]

    @admin.display(description=_("change"))
    def change(self, obj: CapacityChange) -> str:
        """Old → new limit: a capacity, or a rate ("5/min") while there is a window."""
        return limit_change(obj)
