from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from example_project.demo import views

urlpatterns = [
    path("admin/", admin.site.urls),
    # Open to anyone who reaches the server: the demo listens on 127.0.0.1 only.
    # A real project restricts it (an internal port, a network policy, or a
    # wrapper view; see docs/metrics.md).
    path("metrics/", include("django_semaphore.metrics.urls")),
    path("exports/report.csv", views.export_csv, name="export-csv"),
    path(
        "exports/customer/<int:customer>/report.csv",
        views.customer_export_csv,
        name="customer-export-csv",
    ),
    path("", views.index),
]
