"""The routines once more (``engine/statements/routines.py``): the grant
routine for one name (PostgreSQL's function, MariaDB's procedure) now
grants and refuses the waiters of a fair line too (``one_trip.py``), so it
takes where the call stands in line and answers a refusal. PostgreSQL's
former signature is dropped first; going back, 0010 drops the new one."""

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

from django_semaphore.engine.statements import one_trip, routines


def install(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f"DROP FUNCTION IF EXISTS {one_trip.ONE_NAME_ROUTINE}"
            "(text, integer, text, text, integer, text)"
        )
    routines.install(schema_editor.connection)


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0015_parked_task_not_before"),
    ]

    operations = [migrations.RunPython(install, migrations.RunPython.noop, elidable=False)]
