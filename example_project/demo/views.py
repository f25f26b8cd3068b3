"""The views of the demo: a CSV export that at most three clients stream at once."""

from __future__ import annotations

import time
from collections.abc import Iterator

from django.http import HttpRequest, HttpResponse, StreamingHttpResponse

from django_semaphore import holds_permit


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


def index(request: HttpRequest) -> HttpResponse:
    return HttpResponse(
        "<h1>django-semaphore demo</h1>"
        '<p><a href="/exports/report.csv">Download the export</a> (3 at a time) · '
        '<a href="/admin/">Admin</a> (demo / demo)</p>'
    )
