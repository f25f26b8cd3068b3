"""A parked task may wait for a time as well as for room: a debounced
send (``holds_permit(debounce=...)``) is not woken before ``not_before``."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0014_parked_django_tasks"),
    ]

    operations = [
        migrations.AddField(
            model_name="parkedtask",
            name="not_before",
            field=models.DateTimeField(blank=True, null=True, verbose_name="not before"),
        ),
    ]
