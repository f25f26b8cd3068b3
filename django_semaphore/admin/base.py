"""The console's shared behaviour: every read through the app's alias (one
shard at a time, switched by ``?_alias=``), forbidden POSTs refused with 403,
and the read-only base of the lists the app alone writes.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext

from django_semaphore import routing

# Sharded semaphores: which alias the admin shows (see the docstring of django_semaphore.admin).
ALIAS_PARAMETER = "_alias"
ALIAS_SESSION_KEY = "django_semaphore_alias"


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
        links = ((ALIAS_PARAMETER, alias, alias) for alias in aliases if alias != shown)
        others = format_html_join(", ", '<a href="?{}={}">{}</a>', links)
        messages.info(request, format_html(gettext("Showing database {}; also: {}"), shown, others))

    def admin_url(self, model: type[Model], view: str, *args: Any, **query: Any) -> str:
        """This admin site's URL of ``view`` for ``model``, with a query string."""
        opts = model._meta
        url = reverse(
            f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_{view}", args=args
        )
        return f"{url}?{urlencode(query)}" if query else url

    def can_view(self, request: HttpRequest, model: type[Model]) -> bool:
        return self.admin_site.get_model_admin(model).has_view_or_change_permission(request)


def _rendered(response: HttpResponse) -> HttpResponse:
    # A TemplateResponse renders after the view returns: render it while the
    # shown alias is still pinned, so what the template reads comes from it.
    if isinstance(response, TemplateResponse):
        response.render()
    return response


class Unchanged:
    """Never added or changed here (deleted with the delete permission)."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnly(Unchanged):
    """Viewable, never added, changed or deleted here."""

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnlyAdmin(ReadOnly, OperatorAdmin):
    """History and state written only by the app: viewable, never edited here."""
