"""Families (issue 17): which pattern created a semaphore on first use, and
whether a member's capacity was changed on its own. Existing rows are no
family's members.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0005_parked_tasks"),
    ]

    operations = [
        migrations.AddField(
            model_name="semaphore",
            name="family",
            field=models.CharField(
                blank=True, default="", editable=False, max_length=255, verbose_name="family"
            ),
        ),
        migrations.AddField(
            model_name="semaphore",
            name="own_capacity",
            field=models.BooleanField(default=False, editable=False, verbose_name="own capacity"),
        ),
        migrations.AddIndex(
            model_name="semaphore",
            index=models.Index(fields=["family", "updated_at"], name="semaphore_family_idle"),
        ),
    ]
