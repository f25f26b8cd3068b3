"""The operator's console: who holds what, how full it is, who changed it and when.

- Semaphores: usage and waiters from one annotated query, a utilization bar,
  a 24-hour chart, current holders, the queue of fair waiters and capacity
  history; capacity is edited through the same capacity API as code (row
  lock + ``CapacityChange`` with the user), and fair mode switched on or off.
- Permit requests: read-only, with a force-release action guarded by its own
  permission and recorded in the admin's history (``LogEntry``) with the user.
- Capacity history: read-only.

Nothing here adds or deletes permits by hand, and every read goes to the
app's database alias (``DJANGO_SEMAPHORE["DATABASE"]``). With semaphores
sharded over several aliases (``SHARDS``) the admin shows one alias at a time:
``?_alias=<alias>`` on any list switches, and the choice is kept in the session.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, cast
from urllib.parse import urlencode

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth import get_permission_codename
from django.contrib.auth.base_user import AbstractBaseUser
from django.core.exceptions import PermissionDenied
from django.db.models import (
    BigIntegerField,
    Case,
    Count,
    Exists,
    FloatField,
    Min,
    Model,
    OuterRef,
    Prefetch,
    Q,
    QuerySet,
    Subquery,
    Value,
    When,
)
from django.db.models.functions import Cast, Coalesce
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import capfirst
from django.utils.timesince import timesince
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_semaphore import parking, routing, set_capacity
from django_semaphore.backends import DatabaseNow
from django_semaphore.engine import families
from django_semaphore.engine.releasing import release_requests
from django_semaphore.models import (
    MAX_NAME_LENGTH,
    CapacityChange,
    ParkedDemand,
    ParkedTask,
    Permit,
    PermitRequest,
    Semaphore,
    Ticket,
)
from django_semaphore.states import ReleaseReason, State
from django_semaphore.utilization import describe, load_utilization, render_svg
from django_semaphore.validation import MAX_COUNT

# The semaphore page lists at most this many holders and capacity changes;
# links lead to the full, filtered lists.
HOLDERS_SHOWN = 100
HISTORY_SHOWN = 20

# Bar colors, the admin's own palette: readable on its light and dark themes.
BAR_IN_USE = "#79aec8"
BAR_FULL = "#e09e00"
BAR_OVER = "#ba2121"
# Sorts a closed semaphore (capacity 0) that still has holders above any ratio.
INFINITE_UTILIZATION = 1e18


# Sharded semaphores: which alias the admin shows (see the module docstring).
ALIAS_PARAMETER = "_alias"
ALIAS_SESSION_KEY = "django_semaphore_alias"


# --- shared behaviour ---------------------------------------------------------


class OperatorAdmin(admin.ModelAdmin):
    """Reads through the app's alias; refuses forbidden POSTs with 403."""

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).using(routing.current_alias())

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # Django answers an action the user may not run by ignoring it ("No
        # action selected", or a plain re-render when none is allowed). An
        # operator console refuses it outright, as the change views do.
        if request.method == "POST":
            allowed = self.get_actions(request)
            if any(name and name not in allowed for name in request.POST.getlist("action")):
                raise PermissionDenied
        if ALIAS_PARAMETER in request.GET:
            return self._switch_alias(request)
        with routing.on_alias(self._shown_alias(request)):
            self._say_which_alias(request)
            return _rendered(super().changelist_view(request, extra_context))

    def changeform_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        with routing.on_alias(self._shown_alias(request)):
            return _rendered(super().changeform_view(request, *args, **kwargs))

    def delete_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        with routing.on_alias(self._shown_alias(request)):
            return _rendered(super().delete_view(request, *args, **kwargs))

    def history_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        with routing.on_alias(self._shown_alias(request)):
            return _rendered(super().history_view(request, *args, **kwargs))

    def _shown_alias(self, request: HttpRequest) -> str:
        chosen = request.session.get(ALIAS_SESSION_KEY)
        return chosen if chosen in routing.aliases() else routing.current_alias()

    def _switch_alias(self, request: HttpRequest) -> HttpResponse:
        alias = request.GET[ALIAS_PARAMETER]
        if alias in routing.aliases():
            request.session[ALIAS_SESSION_KEY] = alias
        else:
            messages.error(request, gettext("No semaphores are kept on %s.") % alias)
        query = request.GET.copy()
        del query[ALIAS_PARAMETER]
        return HttpResponseRedirect(
            f"{request.path}?{query.urlencode()}" if query else request.path
        )

    def _say_which_alias(self, request: HttpRequest) -> None:
        aliases = routing.aliases()
        if len(aliases) == 1:
            return
        shown = routing.current_alias()
        others = format_html(
            ", ".join(['<a href="?{}={}">{}</a>'] * (len(aliases) - 1)),
            *(part for a in aliases if a != shown for part in (ALIAS_PARAMETER, a, a)),
        )
        messages.info(request, format_html(gettext("Showing database {}; also: {}"), shown, others))

    def admin_url(self, model: type[Model], view: str, *args: Any, **query: Any) -> str:
        """This admin site's URL of ``view`` for ``model``, with a query string."""
        opts = model._meta
        url = reverse(
            f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_{view}", args=args
        )
        return f"{url}?{urlencode(query)}" if query else url

    def can_view(self, request: HttpRequest, model: type[Model]) -> bool:
        model_admin = self.admin_site.get_model_admin(model)
        return model_admin.has_view_or_change_permission(request)


def _rendered(response: HttpResponse) -> HttpResponse:
    # A TemplateResponse renders after the view returns: render it while the
    # shown alias is still pinned, so what the template reads comes from it.
    if isinstance(response, TemplateResponse):
        response.render()
    return response


class ReadOnlyAdmin(OperatorAdmin):
    """History and state written only by the app: viewable, never edited here."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def usage_bar(in_use: int, capacity: int) -> SafeString:
    """A 100-pixel SVG bar of ``in_use`` out of ``capacity``, with a label.

    Full is amber; over capacity (after capacity was lowered below what is
    held) is red, filled to the end and labelled with the excess.
    """
    over = in_use > capacity
    if capacity:
        percent = in_use * 100 / capacity
        label = f"{percent:.0f}%"
    else:
        percent = 100.0 if in_use else 0.0
        label = "" if in_use else gettext("closed")
    if over:
        color, state = BAR_OVER, "over-capacity"
        excess = gettext("over by %(count)d") % {"count": in_use - capacity}
        label = f"{label} · {excess}" if label else excess
    elif capacity and in_use == capacity:
        color, state = BAR_FULL, "full"
    else:
        color, state = BAR_IN_USE, "in-use" if in_use else "idle"
    title = gettext("%(in_use)d in use of %(capacity)d") % {
        "in_use": in_use,
        "capacity": capacity,
    }
    return format_html(
        '<span class="semaphore-bar {state}" title="{title}" style="white-space: nowrap">'
        '<svg width="100" height="10" role="img" aria-label="{title}" '
        'style="vertical-align: middle">'
        '<rect width="100" height="10" rx="2" fill="currentColor" fill-opacity=".12"/>'
        '<rect width="{width}" height="10" rx="2" fill="{color}"/></svg> {label}</span>',
        state=state,
        title=title,
        width=f"{min(percent, 100.0):.0f}",
        color=color,
        label=label,
    )


# --- semaphores -----------------------------------------------------------------


def annotated(obj: Model, name: str) -> int:
    """A count annotated by ``with_usage()``; MySQL returns sums as ``Decimal``."""
    return int(getattr(obj, name))


def held_permits() -> QuerySet[Permit]:
    """The held permits of the semaphore in the enclosing query."""
    return Permit.objects.filter(semaphore=OuterRef("pk"), state=State.ACQUIRED).order_by()


def live_tickets() -> QuerySet[Ticket]:
    """The live tickets (fair waiters) of the semaphore in the enclosing query."""
    return Ticket.objects.filter(semaphore=OuterRef("pk"), expires_at__gt=DatabaseNow()).order_by()


def with_usage(queryset: QuerySet[Semaphore]) -> QuerySet[Semaphore]:
    """Annotate the changelist's columns, all in the one query that lists rows.

    What is held is the ``in_use`` column. The holders are counted by a
    correlated subquery with ``state = 'ACQUIRED'`` in its WHERE clause,
    which reads the (semaphore, state, count) index of held permits only; a
    join would also read every released permit kept for the retention
    period. ``available`` and ``utilization`` are aliases, computed only to
    sort by them.
    """
    held = held_permits().values("semaphore")
    last_change = CapacityChange.objects.filter(semaphore=OuterRef("pk")).order_by(
        "-changed_at", "-id"
    )
    queued = live_tickets().values("semaphore")
    return queryset.annotate(
        holders=Coalesce(
            Subquery(held.annotate(number=Count("request_id", distinct=True)).values("number")),
            0,
            output_field=BigIntegerField(),
        ),
        last_capacity_change=Subquery(last_change.values("changed_at")[:1]),
        waiters=Coalesce(
            Subquery(queued.annotate(number=Count("pk")).values("number")),
            0,
            output_field=BigIntegerField(),
        ),
        waiting_since=Subquery(queued.annotate(since=Min("created_at")).values("since")),
    ).alias(
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
                return queryset.filter(~Exists(held_permits()))
            case "room":
                return queryset.filter(in_use__gt=0, available__gt=0)
            case "full":
                return queryset.filter(available__lte=0)
            case "over":
                return queryset.filter(available__lt=0)
        return queryset


class FamilyFilter(admin.SimpleListFilter):
    """A family's default row and its members; shown only where families are
    declared (the choices are read per request, never at import)."""

    title = _("family")
    parameter_name = "family"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [(family.pattern, family.pattern) for family in families.families()]

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
        max_length=MAX_NAME_LENGTH,
        required=False,
        help_text=_("Optional; kept in the capacity history with your name."),
    )

    class Meta:
        model = Semaphore
        fields = ["name", "capacity", "fair"]

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if cleaned.get("reason") and "capacity" not in self.changed_data:
            self.add_error(
                "reason",
                _("A reason is recorded with a capacity change, but the capacity is unchanged."),
            )
        return cleaned


@admin.register(Semaphore)
class SemaphoreAdmin(OperatorAdmin):
    form = SemaphoreForm
    list_display = [
        "name",
        "capacity",
        "in_use",
        "available",
        "utilization",
        "holders",
        "waiters",
        "longest_wait",
        "last_capacity_change",
        "parked",
    ]
    list_filter = [UsageFilter, "fair", FamilyFilter]
    search_fields = ["name"]
    ordering = ["name"]
    readonly_fields = [
        "in_use",
        "available",
        "utilization",
        "holders",
        "waiters",
        "longest_wait",
        "parked",
        "fencing_counter",
        "family_role",
        "created_at",
        "updated_at",
    ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Semaphore]:
        return parking.with_parked(with_usage(super().get_queryset(request)))

    def get_fieldsets(self, request: HttpRequest, obj: Semaphore | None = None) -> Any:
        if obj is None:
            return [(None, {"fields": ["name", "capacity", "fair"]})]
        settings = ["name", "capacity", "fair"]
        if self.has_change_permission(request, obj):
            settings.append("reason")
        if obj.family or families.is_family_default(obj.name):
            settings.append("family_role")
        return [
            (None, {"fields": settings}),
            (
                _("Usage now"),
                {
                    "fields": [
                        "in_use",
                        "available",
                        "utilization",
                        "holders",
                        "waiters",
                        "longest_wait",
                        "parked",
                    ]
                },
            ),
            (
                _("Bookkeeping"),
                {
                    "fields": ["fencing_counter", "created_at", "updated_at"],
                    "classes": ["collapse"],
                },
            ),
        ]

    def get_readonly_fields(
        self, request: HttpRequest, obj: Semaphore | None = None
    ) -> list[str] | tuple[str, ...]:
        # Renaming would strand every caller that acquires by the old name.
        return [*self.readonly_fields, "name"] if obj else self.readonly_fields

    @admin.display(description=_("family"))
    def family_role(self, obj: Semaphore) -> SafeString | str:
        """What a capacity change here does: to a family's default, or to one member."""
        if families.is_family_default(obj.name):
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

    @admin.display(description=_("in use"), ordering="in_use")
    def in_use(self, obj: Semaphore) -> int:
        return annotated(obj, "in_use")

    @admin.display(description=_("available"), ordering="available")
    def available(self, obj: Semaphore) -> int:
        # Over capacity nothing is available; the bar shows by how much it is over.
        return max(obj.capacity - annotated(obj, "in_use"), 0)

    @admin.display(description=_("utilization"), ordering="utilization")
    def utilization(self, obj: Semaphore) -> SafeString:
        return usage_bar(annotated(obj, "in_use"), obj.capacity)

    @admin.display(description=_("holders"), ordering="holders")
    def holders(self, obj: Semaphore) -> SafeString | int:
        count = annotated(obj, "holders")
        if not count:
            return 0
        return format_html(
            '<a href="{}">{}</a>',
            self.admin_url(
                PermitRequest,
                "changelist",
                permits__semaphore__id__exact=obj.pk,
                state__exact=State.ACQUIRED,
            ),
            count,
        )

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
        count = annotated(obj, "parked")
        if not count:
            return 0
        return format_html(
            '<a href="{}">{}</a>',
            self.admin_url(ParkedTask, "changelist", demands__semaphore__id__exact=obj.pk),
            count,
        )

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
        if "fair" in form.changed_data:
            # Read by every grant's locking read: no lock needed to switch it.
            Semaphore.objects.using(routing.current_alias()).filter(pk=obj.pk).update(
                fair=obj.fair, updated_at=timezone.now()
            )
        if "capacity" not in form.changed_data:
            return
        # The same path as code: under the row lock, recorded with the user.
        saved = set_capacity(
            obj.name,
            form.cleaned_data["capacity"],
            changed_by=cast(AbstractBaseUser, request.user),
            reason=form.cleaned_data.get("reason", ""),
        )
        obj.capacity, obj.updated_at = saved.capacity, saved.updated_at

    def get_deleted_objects(
        self, objs: Sequence[Any] | QuerySet[Any], request: HttpRequest
    ) -> tuple[list[Any], dict[Any, Any], set[Any], list[Any]]:
        to_delete, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        # A semaphore's capacity history goes with it; it has no delete
        # permission of its own, being read-only everywhere else.
        perms_needed.discard(CapacityChange._meta.verbose_name)
        # Deleting a held semaphore would end its holders' permits silently
        # behind their backs: they are shown as protected, and block it.
        held = (
            PermitRequest.objects.using(routing.current_alias())
            .filter(state=State.ACQUIRED, permits__semaphore__in=list(objs))
            .distinct()
        )
        protected.extend(
            format_html(
                '{}: <a href="{}">{}</a>',
                capfirst(PermitRequest._meta.verbose_name),
                self.admin_url(PermitRequest, "change", request_.pk),
                request_,
            )
            for request_ in held
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
            context.update(self.sections(request, obj))
        return super().render_change_form(request, context, add, change, form_url, obj)

    def sections(self, request: HttpRequest, obj: Semaphore) -> dict[str, Any]:
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
        waiting = list(queue.order_by("id")[:HOLDERS_SHOWN])
        can_view_requests = self.can_view(request, PermitRequest)
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
                        self.admin_url(PermitRequest, "change", permit.request_id)
                        if can_view_requests
                        else ""
                    ),
                    "count": permit.count,
                    "age": duration(permit.request.created_at, now),
                    "expires": _expires(permit.request.expires_at, now),
                    "expired": (
                        permit.request.expires_at is not None and permit.request.expires_at <= now
                    ),
                    "fencing_token": permit.fencing_token,
                }
                for permit in holders
            ],
            "holders_total": held.count() if len(holders) == HOLDERS_SHOWN else len(holders),
            "holders_url": (
                self.admin_url(
                    PermitRequest,
                    "changelist",
                    permits__semaphore__id__exact=obj.pk,
                    state__exact=State.ACQUIRED,
                )
                if can_view_requests
                else ""
            ),
            "queue": [
                {
                    "owner": ticket.owner,
                    "key": ticket.external_id,
                    "count": ticket.count,
                    "waiting": duration(ticket.created_at, now),
                    "since": ticket.created_at,
                    "gives_up": _expires(ticket.expires_at, now),
                }
                for ticket in waiting
            ],
            "queue_total": queue.count() if len(waiting) == HOLDERS_SHOWN else len(waiting),
            "history": list(history.select_related("changed_by")[:HISTORY_SHOWN]),
            "history_total": history.count(),
            "history_url": (
                self.admin_url(CapacityChange, "changelist", semaphore__id__exact=obj.pk)
                if self.can_view(request, CapacityChange)
                else ""
            ),
        }


def _expires(expires_at: datetime | None, now: datetime) -> str:
    if expires_at is None:
        return gettext("never (no TTL)")
    if expires_at <= now:
        return gettext("expired %(time)s ago") % {"time": duration(expires_at, now)}
    return gettext("in %(time)s") % {"time": duration(now, expires_at)}


def duration(start: datetime, end: datetime) -> str:
    """Like ``timesince``, but a short TTL reads "40 seconds", not "0 minutes"."""
    seconds = int((end - start).total_seconds())
    if seconds < 60:
        return ngettext("%(count)d second", "%(count)d seconds", seconds) % {"count": seconds}
    return timesince(start, end)


# --- permit requests --------------------------------------------------------------


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


class PermitInline(admin.TabularInline):
    """The request's share of each semaphore: read-only, 1..n rows."""

    model = Permit
    fields = ["semaphore", "count", "state", "fencing_token"]
    readonly_fields = ["semaphore", "count", "state", "fencing_token"]
    extra = 0
    can_delete = False
    show_change_link = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Permit]:
        return (
            super()
            .get_queryset(request)
            .using(routing.current_alias())
            .select_related("semaphore")
            .order_by("semaphore__name")
        )

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Permits have no admin of their own: seeing the request is seeing them.
        return self.admin_site.get_model_admin(PermitRequest).has_view_permission(request, obj)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


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
        return (
            super()
            .get_queryset(request)
            .prefetch_related(Prefetch("permits", queryset=permits.order_by("semaphore__name")))
        )

    @admin.display(description=_("semaphores"))
    def semaphores(self, obj: PermitRequest) -> str:
        return ", ".join(
            permit.semaphore.name
            if permit.count == 1
            else f"{permit.semaphore.name} ({permit.count})"
            for permit in obj.permits.all()
        )

    @admin.display(description=_("expires"), ordering="expires_at")
    def expires(self, obj: PermitRequest) -> str:
        if obj.state != State.ACQUIRED:
            return self.get_empty_value_display()
        return _expires(obj.expires_at, timezone.now())

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        codename = get_permission_codename("force_release", self.opts)
        return request.user.has_perm(f"{self.opts.app_label}.{codename}")

    @admin.action(
        permissions=["force_release"],
        description=_("Force-release selected permit requests"),
    )
    def force_release(self, request: HttpRequest, queryset: QuerySet[PermitRequest]) -> None:
        """End the selected held requests now (``release_reason="admin"``).

        Their holders find out at their next renew or release. Each request
        this ends gets a ``LogEntry`` naming the user, shown in its history.
        """
        selected = list(queryset.values_list("pk", "state"))
        held = [pk for pk, state in selected if state == State.ACQUIRED]
        released = release_requests(routing.current_alias(), held, ReleaseReason.ADMIN)
        if released:
            # release_requests() reports a count, not which rows: the ones now
            # ended for "admin" among those held a moment ago. Only a second
            # staff member force-releasing the same request at the same instant
            # would be logged twice, which is true of both of them anyway.
            ended = queryset.model.objects.using(routing.current_alias()).filter(
                pk__in=held, state=State.RELEASED, release_reason=ReleaseReason.ADMIN
            )
            LogEntry.objects.log_actions(
                user_id=cast(AbstractBaseUser, request.user).pk,
                queryset=ended,
                action_flag=CHANGE,
                change_message=gettext("Force-released (release reason: admin)."),
            )
            self.message_user(
                request,
                ngettext(
                    "%(count)d permit request was force-released.",
                    "%(count)d permit requests were force-released.",
                    released,
                )
                % {"count": released},
                messages.SUCCESS,
            )
        skipped = len(selected) - released
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


# --- parked tasks -------------------------------------------------------------------


@admin.register(ParkedTask)
class ParkedTaskAdmin(OperatorAdmin):
    """Parked Celery tasks, oldest first: the order they are woken in."""

    list_display = ["task_name", "task_id", "semaphores", "parked_at", "woken_at", "expires_at"]
    list_filter = ["demands__semaphore", "task_name"]
    search_fields = ["task_id", "task_name"]
    ordering = ["id"]
    actions = ["drop"]
    fields = ("task_name", "task_id", "semaphores", "parked_at", "woken_at", "expires_at")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[ParkedTask]:
        demands = ParkedDemand.objects.using(routing.current_alias()).select_related("semaphore")
        return (
            super()
            .get_queryset(request)
            .prefetch_related(Prefetch("demands", queryset=demands.order_by("semaphore__name")))
        )

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        # Django's bulk delete would skip parking.cancel, which offers the
        # room a woken task was keeping to the next in line.
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def delete_model(self, request: HttpRequest, obj: ParkedTask) -> None:
        parking.cancel([obj.task_id])

    @admin.display(description=_("semaphores"))
    def semaphores(self, obj: ParkedTask) -> str:
        return ", ".join(
            demand.semaphore.name
            if demand.count == 1
            else f"{demand.semaphore.name} ({demand.count})"
            for demand in obj.demands.all()
        )

    @admin.action(permissions=["delete"], description=_("Drop selected parked tasks"))
    def drop(self, request: HttpRequest, queryset: QuerySet[ParkedTask]) -> None:
        """Drop the selected tasks: never published again, their room offered
        to the next in line. Their Celery state stays ``PARKED``."""
        dropped = parking.cancel(queryset.values_list("task_id", flat=True))
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


# --- capacity history ---------------------------------------------------------------


@admin.register(CapacityChange)
class CapacityChangeAdmin(ReadOnlyAdmin):
    list_display = ["changed_at", "semaphore", "change", "changed_by", "reason"]
    list_filter = ["semaphore", ("changed_by", admin.RelatedOnlyFieldListFilter)]
    list_select_related = ["semaphore", "changed_by"]
    search_fields = ["semaphore__name", "reason"]
    ordering = ["-changed_at", "-id"]
    fields = ["semaphore", "old_capacity", "new_capacity", "changed_by", "changed_at", "reason"]

    @admin.display(description=_("change"))
    def change(self, obj: CapacityChange) -> SafeString:
        return format_html(
            "{} → {}",
            obj.old_capacity,
            obj.new_capacity,
        )
