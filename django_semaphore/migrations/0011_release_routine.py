"""The routines again, with the release procedure and MariaDB's grant
procedure: frozen in ``sql/0011_release_routine.*.sql``."""

from django.db import migrations

from ._routines import replace


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0010_grant_function"),
    ]

    operations = [replace("0010_grant_function", "0011_release_routine")]
