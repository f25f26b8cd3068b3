from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from tests import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics/", include("django_semaphore.metrics.urls")),
    path("plain/", views.plain),
    path("rated/", views.rated),
    path("slow/", views.slow),
    path("failing/", views.failing),
    path("streaming/", views.streaming),
    path("async/", views.async_view),
    path("async-streaming/", views.async_streaming),
    path("class/", views.DecoratedClass.as_view()),
    path("dispatch/", views.DecoratedDispatch.as_view()),
    path("writes/", views.writes),
    path("opted-out/", views.opted_out),
    path("unknown-name/", views.unknown_name),
    path("too-many/", views.too_many),
    path("undeclared-family/", views.undeclared_family),
]
