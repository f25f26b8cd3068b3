"""The routines once more (``engine/statements/routines.py``): on PostgreSQL
the queue every grant waits in before it locks the semaphore rows
(``queue.py``), for the general grant; the grant function again, which now
waits in it first; and the grant function for one name (``one_trip.py``).
Each is created or replaced; going back, 0010 drops them."""

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

from django_semaphore.engine.statements import routines


def install(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    routines.install(schema_editor.connection)


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0011_release_routine"),
    ]

    operations = [migrations.RunPython(install, migrations.RunPython.noop, elidable=False)]
