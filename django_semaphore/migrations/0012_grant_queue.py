"""The routines again: on PostgreSQL the queue every grant waits in before
it locks the semaphore rows, the grant function waiting in it first, and
the grant function for one name. Frozen in ``sql/0012_grant_queue.*.sql``."""

from django.db import migrations

from ._routines import replace


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0011_release_routine"),
    ]

    operations = [replace("0011_release_routine", "0012_grant_queue")]
