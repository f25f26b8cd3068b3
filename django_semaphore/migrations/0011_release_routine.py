"""The routines once more (``engine/statements/routines.py``), for databases
that applied 0010 before it installed the release procedure and MariaDB's
grant procedure. Each is created or replaced, so on a new database this
repeats 0010; going back, 0010 drops them."""

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

from django_semaphore.engine.statements import routines


def install(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    routines.install(schema_editor.connection)


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0010_grant_function"),
    ]

    operations = [migrations.RunPython(install, migrations.RunPython.noop, elidable=False)]
