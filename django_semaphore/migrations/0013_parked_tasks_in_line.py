"""Parked tasks wait in the one line of waiters: a parked task gets the
``key`` its run claims its permit under (its task id), each ``ParkedDemand``
becomes a ``Ticket`` under that key (in park order, so each keeps its place;
a woken task's tickets lack room, which keeps its room for it), the
semaphores where such tickets lack room have live queues, and the routines
are installed again (the release's read of where parked tasks wait), frozen
in ``sql/0013_parked_tasks_in_line.*.sql``."""

from datetime import timedelta

from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps
from django.db.models import Max

from ._routines import replace

# engine/statements/tickets.MAX_TICKET_LIFE, as of this migration.
MAX_TICKET_LIFE = timedelta(days=365)


def keys_from_task_ids(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    ParkedTask = apps.get_model("django_semaphore", "ParkedTask")
    ParkedTask.objects.using(schema_editor.connection.alias).update(key=models.F("task_id"))


def demands_to_tickets(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    ParkedDemand = apps.get_model("django_semaphore", "ParkedDemand")
    Ticket = apps.get_model("django_semaphore", "Ticket")
    Semaphore = apps.get_model("django_semaphore", "Semaphore")
    alias = schema_editor.connection.alias
    demands = (
        ParkedDemand.objects.using(alias)
        .select_related("task")
        .order_by("task_id", "semaphore_id")
        .iterator()
    )
    Ticket.objects.using(alias).bulk_create(
        (
            Ticket(
                semaphore_id=demand.semaphore_id,
                external_id=demand.task.key,
                count=demand.count,
                created_at=demand.task.parked_at,
                expires_at=demand.task.expires_at or demand.task.parked_at + MAX_TICKET_LIFE,
                lacked=demand.lacked or demand.task.woken_at is not None,
            )
            for demand in demands
        ),
        batch_size=1000,
        ignore_conflicts=True,
    )
    queues = (
        Ticket.objects.using(alias)
        .filter(lacked=True)
        .values("semaphore_id")
        .annotate(until=Max("expires_at"))
        .values_list("semaphore_id", "until")
    )
    for semaphore_id, until in queues:
        Semaphore.objects.using(alias).filter(pk=semaphore_id).filter(
            models.Q(queued_until__isnull=True) | models.Q(queued_until__lt=until)
        ).update(queued_until=until)


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0012_grant_queue"),
    ]

    operations = [
        # The line's index first: it serves the semaphore's foreign key once
        # the old unique key, which did, is gone (MySQL requires one).
        migrations.AddIndex(
            model_name="ticket",
            index=models.Index(fields=["semaphore", "lacked", "id"], name="semaphore_ticket_line"),
        ),
        migrations.AddConstraint(
            model_name="ticket",
            constraint=models.UniqueConstraint(
                fields=("external_id", "semaphore"), name="semaphore_ticket_key"
            ),
        ),
        migrations.RemoveConstraint(
            model_name="ticket",
            name="semaphore_ticket_unique_key",
        ),
        migrations.AddField(
            model_name="parkedtask",
            name="key",
            field=models.CharField(default="", max_length=255, verbose_name="key"),
            preserve_default=False,
        ),
        migrations.RunPython(keys_from_task_ids, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="parkedtask",
            name="key",
            field=models.CharField(max_length=255, unique=True, verbose_name="key"),
        ),
        migrations.AddField(
            model_name="ticket",
            name="parked",
            field=models.ForeignObject(
                from_fields=["external_id"],
                null=True,
                on_delete=models.DO_NOTHING,
                related_name="tickets",
                to="django_semaphore.parkedtask",
                to_fields=["key"],
            ),
        ),
        migrations.RunPython(demands_to_tickets, migrations.RunPython.noop),
        migrations.DeleteModel(name="ParkedDemand"),
        replace("0012_grant_queue", "0013_parked_tasks_in_line"),
    ]
