"""The exact in-use counter, filled from the permits held when it is added.

Permits granted or released while this migration runs on a live system may
be missed by the fill; the orphan sweep's verifier (or ``manage.py
semaphore_status --verify``) corrects any difference and reports it.
"""

from django.db import migrations, models
from django.db.models import OuterRef, Subquery, Sum
from django.db.models.functions import Coalesce


def fill_in_use(apps, schema_editor):
    Semaphore = apps.get_model("django_semaphore", "Semaphore")
    Permit = apps.get_model("django_semaphore", "Permit")
    held = (
        Permit.objects.filter(semaphore=OuterRef("pk"), state="ACQUIRED")
        .order_by()
        .values("semaphore")
        .annotate(total=Sum("count"))
        .values("total")
    )
    Semaphore.objects.using(schema_editor.connection.alias).update(
        in_use=Coalesce(Subquery(held), 0)
    )


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0003_semaphore_fair_ticket"),
    ]

    operations = [
        migrations.AddField(
            model_name="semaphore",
            name="in_use",
            field=models.PositiveIntegerField(default=0, editable=False, verbose_name="in use"),
        ),
        migrations.RunPython(fill_in_use, migrations.RunPython.noop, elidable=True),
    ]
