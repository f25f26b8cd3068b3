from __future__ import annotations

from contextlib import suppress

from django.apps import AppConfig
from django.core.exceptions import ImproperlyConfigured
from django.db.models.signals import post_migrate, pre_delete
from django.utils.translation import gettext_lazy as _


class DjangoSemaphoreConfig(AppConfig):
    name = "django_semaphore"
    verbose_name = _("Semaphores")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here, as Django asks: this module is imported while the app
        # registry loads, before any model can be.
        from django_semaphore import checks, parking  # noqa: F401  (checks registers the checks)
        from django_semaphore.conf import app_settings
        from django_semaphore.declared import create_declared_semaphores
        from django_semaphore.integrations import celery_tasks, django_tasks
        from django_semaphore.models import Permit, PermitRequest, Semaphore, requests, semaphore

        post_migrate.connect(create_declared_semaphores, sender=self)
        # Deleting what is held would end permits behind their holders'
        # backs, and a semaphore waited on would leave its waiters waiting.
        for model, guard in (
            (Semaphore, semaphore.refuse_deleting_a_semaphore_in_use),
            (PermitRequest, requests.refuse_deleting_held_request),
            (Permit, requests.refuse_deleting_held_permit),
        ):
            pre_delete.connect(
                guard, sender=model, dispatch_uid=f"django_semaphore.{guard.__name__}"
            )
        django_tasks.connect()
        # A malformed setting: start-up goes on, so that manage.py check
        # reports the settings (E001, E020) rather than a traceback here.
        with suppress(ImproperlyConfigured):
            if app_settings.PARK_TASKS:
                # Parking is the default: a release in any process (a web
                # request's permit() too) wakes the tasks parked for its room,
                # Celery's and Django's own.
                parking.enable()
        try:
            from celery.signals import before_task_publish, task_postrun, task_revoked
        except ImportError:  # Celery is optional
            return
        task_postrun.connect(celery_tasks.on_task_postrun, dispatch_uid="django_semaphore.postrun")
        before_task_publish.connect(
            celery_tasks.on_before_task_publish, dispatch_uid="django_semaphore.publish"
        )
        task_revoked.connect(parking.on_task_revoked, dispatch_uid="django_semaphore.revoked")
