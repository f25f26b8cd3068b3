"""Releases count what they free on a row of their own (``ReleaseCounter``),
not on the semaphore's row that grants lock: see docs/decisions.md, "Room
returned on time". Every semaphore gets its counter, at zero."""

from django.db import migrations, models


def create_counters(apps, schema_editor):
    Semaphore = apps.get_model("django_semaphore", "Semaphore")
    ReleaseCounter = apps.get_model("django_semaphore", "ReleaseCounter")
    alias = schema_editor.connection.alias
    ids = Semaphore.objects.using(alias).values_list("pk", flat=True).iterator()
    batch: list = []
    for pk in ids:
        batch.append(ReleaseCounter(semaphore_id=pk))
        if len(batch) == 1000:
            ReleaseCounter.objects.using(alias).bulk_create(batch)
            batch = []
    ReleaseCounter.objects.using(alias).bulk_create(batch)


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0007_waiters_lacked_room"),
    ]

    operations = [
        migrations.RenameField(
            model_name="semaphore", old_name="in_use", new_name="in_use_counter"
        ),
        migrations.AlterField(
            model_name="semaphore",
            name="in_use_counter",
            field=models.PositiveIntegerField(
                default=0, editable=False, verbose_name="in-use counter"
            ),
        ),
        migrations.AddField(
            model_name="semaphore",
            name="released_folded",
            field=models.PositiveBigIntegerField(
                default=0, editable=False, verbose_name="releases folded in"
            ),
        ),
        migrations.CreateModel(
            name="ReleaseCounter",
            fields=[
                (
                    "semaphore",
                    models.OneToOneField(
                        on_delete=models.deletion.CASCADE,
                        primary_key=True,
                        related_name="release_counter",
                        serialize=False,
                        to="django_semaphore.semaphore",
                    ),
                ),
                (
                    "released",
                    models.PositiveBigIntegerField(default=0, verbose_name="permits released"),
                ),
            ],
            options={
                "verbose_name": "release counter",
                "verbose_name_plural": "release counters",
            },
        ),
        migrations.AlterModelOptions(
            name="semaphore",
            options={
                "base_manager_name": "objects",
                "ordering": ["name"],
                "verbose_name": "semaphore",
                "verbose_name_plural": "semaphores",
            },
        ),
        migrations.RunPython(create_counters, migrations.RunPython.noop),
    ]
