from __future__ import annotations

from django.apps import AppConfig
from django.db.models.signals import post_migrate
from django.utils.translation import gettext_lazy as _


class DjangoSemaphoreConfig(AppConfig):
    name = "django_semaphore"
    label = "django_semaphore"
    verbose_name = _("Semaphores")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_semaphore import checks  # noqa: F401  (registers the checks)
        from django_semaphore.declared import create_declared_semaphores

        post_migrate.connect(create_declared_semaphores, sender=self)
        try:
            from celery.signals import task_postrun
        except ImportError:  # Celery is optional
            return
        from django_semaphore.task_runs import on_task_postrun

        task_postrun.connect(on_task_postrun, dispatch_uid="django_semaphore.task_postrun")
