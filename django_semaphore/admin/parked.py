"""Parked tasks (Celery's, and Django's own deferred ones): listed in the
order they are woken, each page saying why it waits (``blockers``), dropped
through ``parking.cancel`` so the room a woken task was keeping goes to the
next."""

from __future__ import annotations

from typing import Any, cast

from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.base_user import AbstractBaseUser
from django.db.models import Prefetch, QuerySet
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_semaphore import parking, routing
from django_semaphore.admin.base import OperatorAdmin, Unchanged
from django_semaphore.admin.display import demand
from django_semaphore.blockers import why_waiting
from django_semaphore.models import ParkedTask, Ticket


@admin.register(ParkedTask)
class ParkedTaskAdmin(Unchanged, OperatorAdmin):
    """Parked tasks, oldest first: the order they are woken in."""

    list_display = [
        "task_name", "task_id", "semaphores", "parked_at", "not_before", "woken_at", "expires_at",
    ]  # fmt: skip
    list_filter = ["tickets__semaphore", "task_name"]
    search_fields = ["task_id", "task_name"]
    actions = ["drop"]
    fields = (
        "task_name", "task_id", "semaphores", "parked_at", "not_before", "woken_at", "expires_at",
        "why",
    )  # fmt: skip
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[ParkedTask]:
        tickets = Ticket.objects.using(routing.current_alias()).select_related("semaphore")
        by_name = Prefetch("tickets", queryset=tickets.order_by("semaphore__name"))
        return super().get_queryset(request).prefetch_related(by_name)

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        # Django's bulk delete would skip parking.cancel, which offers the
        # room a woken task was keeping to the next in line.
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def delete_model(self, request: HttpRequest, obj: ParkedTask) -> None:
        parking.cancel([obj.task_id])

    @admin.display(description=_("semaphores"))
    def semaphores(self, obj: ParkedTask) -> str:
        return demand(obj.tickets.all())

    @admin.display(description=_("why it waits"))
    def why(self, obj: ParkedTask) -> str:
        """Each semaphore of its demand: whether it lacks room, the older
        waiters that keep some, the holders, a rate limit's next slot."""
        waiting = why_waiting(obj.key)
        if waiting is None:
            return gettext("It no longer waits in line: its run has started, or it expired.")
        note = ""
        if waiting.sending:
            note = gettext("Being sent: its sender's transaction has not committed yet.")
        elif waiting.woken:
            note = gettext("Woken: room is kept for it until its run takes it.")
        elif waiting.not_before is not None:
            note = gettext("Debounced: not woken before %(moment)s.") % {
                "moment": waiting.not_before.isoformat(timespec="seconds")
            }
        return render_to_string(
            "admin/django_semaphore/parkedtask/why.html",
            {"note": note, "blockers": [blocker.explained() for blocker in waiting.blockers]},
        )

    @admin.action(permissions=["delete"], description=_("Drop selected parked tasks"))
    def drop(self, request: HttpRequest, queryset: QuerySet[ParkedTask]) -> None:
        """Drop the selected tasks: never published again, their room offered
        to the next in line. Their Celery state stays ``PARKED``. Each gets a
        ``LogEntry`` naming the user, as the admin's own delete writes."""
        selected = list(queryset)
        dropped = parking.cancel(task.task_id for task in selected)
        LogEntry.objects.log_actions(
            user_id=cast(AbstractBaseUser, request.user).pk,
            queryset=selected,
            action_flag=DELETION,
            change_message=gettext("Dropped (never published again)."),
        )
        self.message_user(
            request,
            ngettext(
                "%(count)d parked task was dropped.",
                "%(count)d parked tasks were dropped.",
                dropped,
            )
            % {"count": dropped},
            messages.SUCCESS,
        )
