"""The default answer to a request ``@holds_permit`` refused
(``DJANGO_SEMAPHORE["REFUSED_VIEW"]``)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse

from django_semaphore.exceptions import PermitRefused


def permit_refused(request: HttpRequest, exception: PermitRefused) -> HttpResponse:
    """An empty answer with the refusal's status and ``Retry-After``.

    A project renders its own page by naming another view, with the same
    arguments, in ``DJANGO_SEMAPHORE["REFUSED_VIEW"]``.
    """
    return HttpResponse(
        status=exception.status, headers={"Retry-After": str(exception.retry_after)}
    )
