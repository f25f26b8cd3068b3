"""PostgreSQL: the function that grants in one round trip
(``engine/statements/one_trip.py``); nothing on other databases."""

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

from django_semaphore.engine.statements import one_trip


def install(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    one_trip.install(schema_editor.connection)


def uninstall(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    one_trip.uninstall(schema_editor.connection)


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0009_rate_windows"),
    ]

    operations = [migrations.RunPython(install, uninstall, elidable=False)]
