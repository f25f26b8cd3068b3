"""Found by the fault suite's history check (grant time vs. lock wait): the
database's "now" must be read once the grant holds its row locks.

MySQL/MariaDB's ``UTC_TIMESTAMP()`` and PostgreSQL's ``STATEMENT_TIMESTAMP()``
are the time the *statement started*. Read in the locking ``SELECT ... FOR
UPDATE``, that is before the wait for the row lock: a grant that queued for
2 s behind another transaction got ``expires_at`` 2 s in the past of its
TTL, and could be reclaimed (handed to someone else) that much early.
"""

from __future__ import annotations

import pytest

from django_semaphore import acquire, release
from django_semaphore.backends import DatabaseNow
from django_semaphore.models import Semaphore
from tests.conftest import unique
from tests.test_backends import row_locked_elsewhere

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 2.0
TTL = 5


def database_now():
    return Semaphore.objects.annotate(now=DatabaseNow()).values_list("now", flat=True)[0]


def test_a_grant_that_queued_for_the_row_lock_keeps_its_whole_ttl(make_semaphore, settings):
    settings.DJANGO_SEMAPHORE = {"LOCK_WAIT_TIMEOUT": 10}
    sem = make_semaphore(capacity=1)
    key = unique()

    with row_locked_elsewhere(sem.name, hold=WAIT):
        request = acquire(sem.name, external_id=key, ttl=TTL)
    remaining = (request.expires_at - database_now()).total_seconds()

    assert remaining > TTL - 1, f"granted with {remaining:.1f}s of its {TTL}s TTL left"
    release(key)
