"""The routines that grant, and on MariaDB release, in one round trip
(``engine/statements/routines.py``); nothing on SQLite and MySQL."""

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

from django_semaphore.engine.statements import routines


def install(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    routines.install(schema_editor.connection)


def uninstall(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    routines.uninstall(schema_editor.connection)


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0009_rate_windows"),
    ]

    operations = [migrations.RunPython(install, uninstall, elidable=False)]
