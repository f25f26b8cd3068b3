from __future__ import annotations

from django.contrib import admin
from django.urls import path

from example_project.demo import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("exports/report.csv", views.export_csv, name="export-csv"),
    path("", views.index),
]
