"""Rate limits: a semaphore may carry a window (docs/rates.md); each grant on
one keeps the end of its slot on its permit, and the audit trail records
window changes beside capacity changes."""

import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0008_release_counter"),
    ]

    operations = [
        migrations.AddField(
            model_name="capacitychange",
            name="new_window",
            field=models.PositiveIntegerField(blank=True, null=True, verbose_name="new window"),
        ),
        migrations.AddField(
            model_name="capacitychange",
            name="old_window",
            field=models.PositiveIntegerField(blank=True, null=True, verbose_name="old window"),
        ),
        migrations.AddField(
            model_name="permit",
            name="slot_ends",
            field=models.DateTimeField(blank=True, null=True, verbose_name="slot ends"),
        ),
        migrations.AddField(
            model_name="semaphore",
            name="slots_closed_until",
            field=models.DateTimeField(
                blank=True, editable=False, null=True, verbose_name="slots closed until"
            ),
        ),
        migrations.AddField(
            model_name="semaphore",
            name="slots_open",
            field=models.PositiveIntegerField(
                db_default=0, default=0, editable=False, verbose_name="slots open"
            ),
        ),
        migrations.AddField(
            model_name="semaphore",
            name="window",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="Empty: at most capacity permits held at once. Set: a rate limit, at most capacity grants in any window of this many seconds, released or not.",
                null=True,
                validators=[
                    django.core.validators.MinValueValidator(1),
                    django.core.validators.MaxValueValidator(86400),
                ],
                verbose_name="window (seconds)",
            ),
        ),
        migrations.AddIndex(
            model_name="permit",
            index=models.Index(
                fields=["semaphore", "slot_ends", "count"], name="semaphore_permit_slots"
            ),
        ),
    ]
