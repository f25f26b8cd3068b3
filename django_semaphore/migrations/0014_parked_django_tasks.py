"""A parked task may be a Django task deferred in its backend:
``ParkedTask.backend`` names that backend (empty for a Celery task)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0013_parked_tasks_in_line"),
    ]

    operations = [
        migrations.AddField(
            model_name="parkedtask",
            name="backend",
            field=models.CharField(blank=True, max_length=100, verbose_name="task backend"),
        ),
    ]
