"""The views of the demo: a CSV export that at most three clients stream at
once, and a per-customer export, at most two at once for each customer."""

from __future__ import annotations

import time
from collections.abc import Iterator

from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import redirect

from django_semaphore import holds_permit
from django_semaphore.models import Semaphore


@holds_permit("exports", ttl=60)
def export_csv(request: HttpRequest) -> StreamingHttpResponse:
    """Held until the last row is sent: a fourth concurrent client gets 429."""

    def rows() -> Iterator[str]:
        yield "id,name,amount\n"
        for n in range(1, 41):
            time.sleep(0.05)  # a slow query, so permits are visible in the admin
            yield f"{n},item-{n},{n * 3.5:.2f}\n"

    response = StreamingHttpResponse(rows(), content_type="text/csv")
    response["Content-Disposition"] = 'attachment; filename="report.csv"'
    return response


def _customer(request: HttpRequest) -> str:
    # In a real project: f"export:customer:{request.user.pk}" behind a login.
    # The demo has no customers to log in, so the URL names one.
    assert request.resolver_match is not None
    return f"export:customer:{request.resolver_match.kwargs['customer']}"


@holds_permit(_customer, ttl=60)
def customer_export_csv(request: HttpRequest, customer: int) -> StreamingHttpResponse:
    """At most two exports per customer at once (the family ``export:customer:*``
    in settings): each customer's semaphore is created on its first export,
    and deleted by the clean-up once idle. A third concurrent download of the
    same customer gets 429; other customers are not affected."""

    def rows() -> Iterator[str]:
        yield "id,customer,amount\n"
        for n in range(1, 21):
            time.sleep(0.05)
            yield f"{n},{customer},{n * 1.5:.2f}\n"

    response = StreamingHttpResponse(rows(), content_type="text/csv")
    response["Content-Disposition"] = f'attachment; filename="customer-{customer}.csv"'
    return response


def index(request: HttpRequest) -> HttpResponse:
    """The demo's first screen: the ``exports`` semaphore in the admin, where the
    traffic generator's downloads come and go (the admin asks for the demo
    login first, then comes back here)."""
    exports = Semaphore.objects.get(name="exports")
    return redirect("admin:django_semaphore_semaphore_change", exports.pk)
