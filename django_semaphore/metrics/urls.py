"""``path("metrics/", include("django_semaphore.metrics.urls"))``."""

from __future__ import annotations

from django.urls import path

from django_semaphore.metrics import views

app_name = "django_semaphore_metrics"
urlpatterns = [path("", views.metrics, name="metrics")]
