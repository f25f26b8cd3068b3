"""The routines that grant, and on MariaDB release, in one round trip:
frozen in ``sql/0010_grant_function.*.sql``; nothing on SQLite and MySQL."""

from django.db import migrations

from ._routines import replace


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0009_rate_windows"),
    ]

    operations = [replace(None, "0010_grant_function")]
