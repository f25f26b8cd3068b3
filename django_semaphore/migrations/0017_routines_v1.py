"""Version 1 of the routines, under versioned names (``django_semaphore_grant_v1``
and the rest), frozen in ``sql/0017_routines_v1.*.sql``: installed beside
the unversioned ones of 0010-0016, which the code of the previous release
still calls while a deploy is under way. A migration of the release after
this one drops those."""

from django.db import migrations

from ._routines import replace


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0016_fair_grant_in_one_trip"),
    ]

    operations = [replace(None, "0017_routines_v1")]
