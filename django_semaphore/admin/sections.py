"""The read-only sections below a semaphore's form: its 24-hour chart, the
current holders, the line of waiters (who has room there) and the capacity
history, as the change form's context."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from django.utils.translation import gettext

from django_semaphore import routing
from django_semaphore.admin.base import OperatorAdmin
from django_semaphore.admin.chart import describe, render_svg
from django_semaphore.admin.display import duration, expiry, limit_change
from django_semaphore.blockers import room_for
from django_semaphore.models import (
    CapacityChange,
    ParkedTask,
    Permit,
    PermitRequest,
    Semaphore,
    Ticket,
)
from django_semaphore.states import State
from django_semaphore.utilization import load_utilization

# The semaphore page lists at most this many holders and capacity changes;
# links lead to the full, filtered lists.
HOLDERS_SHOWN = 100
HISTORY_SHOWN = 20


def sections(page: OperatorAdmin, request: HttpRequest, obj: Semaphore) -> dict[str, Any]:
    """Context of the read-only sections below the form: chart, holders,
    queue, history."""
    using = routing.current_alias()
    utilization = load_utilization(obj)
    now = utilization.end  # the database's clock, as on the chart
    held = Permit.objects.using(using).filter(semaphore=obj, state=State.ACQUIRED)
    holders = list(
        held.select_related("request").order_by("request__created_at", "pk")[:HOLDERS_SHOWN]
    )
    history = CapacityChange.objects.using(using).filter(semaphore=obj)
    queue = Ticket.objects.using(using).filter(semaphore=obj, expires_at__gt=now)
    waiting = list(queue.select_related("parked").in_line()[:HOLDERS_SHOWN])
    can_view_requests = page.can_view(request, PermitRequest)
    return {
        "utilization_summary": describe(utilization),
        "utilization_chart": render_svg(
            utilization,
            title=gettext("Utilization of %(name)s, last 24 hours") % {"name": obj.name},
        ),
        "holders": [
            {
                "owner": permit.request.owner,
                "key": permit.request.external_id,
                "url": (
                    page.admin_url(PermitRequest, "change", permit.request_id)
                    if can_view_requests
                    else ""
                ),
                "count": permit.count,
                "age": duration(permit.request.created_at, now),
                "expires": expiry(permit.request.expires_at, now),
                "expired": (
                    permit.request.expires_at is not None and permit.request.expires_at <= now
                ),
                "fencing_token": permit.fencing_token,
            }
            for permit in holders
        ],
        "holders_total": held.count() if len(holders) == HOLDERS_SHOWN else len(holders),
        "holders_url": holders_url(page, obj) if can_view_requests else "",
        "queue": _queue(page, request, obj, waiting, now),
        "queue_total": queue.count() if len(waiting) == HOLDERS_SHOWN else len(waiting),
        "queue_by_share": list(queue.per_share()[:HOLDERS_SHOWN]),
        "history": [
            {
                "changed_at": change.changed_at,
                "change": limit_change(change),
                "changed_by": change.changed_by,
                "reason": change.reason,
            }
            for change in history.select_related("changed_by")[:HISTORY_SHOWN]
        ],
        "history_total": history.count(),
        "history_url": (
            page.admin_url(CapacityChange, "changelist", semaphore__id__exact=obj.pk)
            if page.can_view(request, CapacityChange)
            else ""
        ),
    }


def holders_url(page: OperatorAdmin, obj: Semaphore) -> str:
    """The list of the requests that hold permits of ``obj``."""
    return page.admin_url(
        PermitRequest,
        "changelist",
        permits__semaphore__id__exact=obj.pk,
        state__exact=State.ACQUIRED,
    )


def _queue(
    page: OperatorAdmin, request: HttpRequest, obj: Semaphore, waiting: list[Ticket], now: datetime
) -> list[dict[str, Any]]:
    """The waiters in line, each with the room left for it here: what is
    not in use nor kept by the older waiters that lacked room (the
    grant's rule); a parked task links to its page, which says why it
    waits on every semaphore of its demand."""
    can_view_parked = page.can_view(request, ParkedTask)
    queue, kept = [], 0
    for ticket in waiting:
        free = room_for(obj.in_use, obj.capacity, kept)
        queue.append(
            {
                "owner": ticket.waiter,
                "key": ticket.external_id,
                "url": (
                    page.admin_url(ParkedTask, "change", ticket.parked.pk)
                    if ticket.parked is not None and can_view_parked
                    else ""
                ),
                "count": ticket.count,
                "priority": ticket.priority,
                "share": ticket.share,
                "free": free,
                "lacks": ticket.count > free,
                "waiting": duration(ticket.created_at, now),
                "since": ticket.created_at,
                "expires": expiry(ticket.expires_at, now),
            }
        )
        kept += ticket.count if ticket.lacked else 0
    return queue
