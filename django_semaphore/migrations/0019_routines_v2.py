"""Version 2 of the routines (``django_semaphore_grant_v2`` and the rest),
frozen in ``sql/0019_routines_v2.*.sql``: the grant's decision on one name
written once for both servers, its writes the general grant's statements.
Installed beside version 1, which the code of the previous release calls
while a deploy is under way; a migration of a later release drops it."""

from django.db import migrations

from ._routines import replace


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0018_ticket_priority"),
    ]

    operations = [replace(None, "0019_routines_v2")]
