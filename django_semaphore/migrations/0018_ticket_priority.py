"""A waiter's priority and share key, and its place in line from them
(``Ticket.ranked_at``, ``turn_at``). Database defaults, so that code of the
previous release, which inserts tickets without them, keeps working during
a deploy: its waiters are in line from when they came, at priority 0,
without a share key."""

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
        migrations.AddField(
            model_name="ticket",
            name="share",
            field=models.CharField(
                blank=True, db_default="", default="", max_length=255, verbose_name="share"
            ),
        ),
        migrations.AddField(
            model_name="ticket",
            name="turn_at",
            field=models.DateTimeField(blank=True, null=True, verbose_name="share's turn"),
        ),
        migrations.AddIndex(
            model_name="ticket",
            index=models.Index(
                fields=["semaphore", "share", "turn_at"], name="semaphore_ticket_share"
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
