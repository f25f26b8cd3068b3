"""A waiter's priority, and its place in line from it (``Ticket.ranked_at``).
Database defaults, so that code of the previous release, which inserts
tickets without them, keeps working during a deploy: its waiters are in
line from when they came, at priority 0."""

import django.db.models.functions.datetime
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0017_routines_v1"),
    ]

    operations = [
        migrations.AddField(
            model_name="ticket",
            name="priority",
            field=models.SmallIntegerField(db_default=0, default=0, verbose_name="priority"),
        ),
        migrations.AddField(
            model_name="ticket",
            name="ranked_at",
            field=models.DateTimeField(
                db_default=django.db.models.functions.datetime.Now(),
                default=django.utils.timezone.now,
                verbose_name="in line from",
            ),
        ),
        migrations.AlterModelOptions(
            name="ticket",
            options={
                "ordering": ["ranked_at", "id"],
                "verbose_name": "ticket",
                "verbose_name_plural": "tickets",
            },
        ),
    ]
