"""The routines again: the grant routine for one name (PostgreSQL's
function, MariaDB's procedure) grants and refuses the waiters of a fair
line too, so it takes where the call stands in line and answers a refusal.
Frozen in ``sql/0016_fair_grant_in_one_trip.*.sql``."""

from django.db import migrations

from ._routines import replace


class Migration(migrations.Migration):
    dependencies = [
        ("django_semaphore", "0015_parked_task_not_before"),
    ]

    operations = [replace("0013_parked_tasks_in_line", "0016_fair_grant_in_one_trip")]
