"""Leases: one heartbeat per process renews every lease it holds, one UPDATE
per alias; a holder killed with SIGKILL gives its permits back when its
lease runs out, with no beat and no liveness checker; owners by default."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_semaphore import acquire, permit
from django_semaphore.engine.releasing import release_requests
from django_semaphore.exceptions import InvalidRequest
from django_semaphore.integrations.leases import HEARTBEAT, hold
from django_semaphore.models import PermitRequest, Semaphore
from django_semaphore.owners import this_process
from django_semaphore.states import ReleaseReason, State
from tests import tasks
from tests.children import Outbox, spawn, stop
from tests.clients import hold_until_killed
from tests.conftest import forked_child_exit_code, unique
from tests.testapp.models import RunLog

pytestmark = pytest.mark.django_db(transaction=True)

# A killed holder's permit is granted again within its lease and this much.
GRACE = 5.0


def expiry(key: str) -> Any:
    return PermitRequest.objects.get(external_id=key).expires_at


@pytest.fixture
def idle_heartbeat():
    """Each test starts and ends with a heartbeat that holds nothing."""
    assert HEARTBEAT.holding == 0
    yield HEARTBEAT
    assert HEARTBEAT.holding == 0


# --- the defaults ------------------------------------------------------------------


def test_permit_holds_the_lease_setting_by_default(make_semaphore, settings, idle_heartbeat):
    sem = make_semaphore()
    settings.DJANGO_SEMAPHORE = {"LEASE": timedelta(seconds=42)}
    with permit(sem.name) as grant:
        assert grant.request.ttl == 42
        assert idle_heartbeat.holding == 1
    with permit(sem.name, ttl=None) as grant:  # no expiry, nothing to renew
        assert grant.request.ttl is None
        assert grant.request.expires_at is None
        assert idle_heartbeat.holding == 0


def test_raw_acquire_keeps_no_ttl_by_default(make_semaphore):
    sem = make_semaphore()
    request = acquire(sem.name, external_id=unique())
    assert request.ttl is None
    with pytest.raises(InvalidRequest, match="no ttl"):
        hold(request)


def test_owners_are_recorded_by_default(make_semaphore):
    sem = make_semaphore(capacity=3)
    here = f"{__name__}.test_owners_are_recorded_by_default on {this_process()}"
    assert acquire(sem.name, external_id=unique()).owner == here
    with permit(sem.name) as grant:
        assert grant.request.owner == here
    assert acquire(sem.name, external_id=unique(), owner="given").owner == "given"


# --- one heartbeat, one statement per alias ----------------------------------------


def test_one_update_renews_a_hundred_leases(make_semaphore, idle_heartbeat):
    sem = make_semaphore(capacity=100)
    requests = [acquire(sem.name, external_id=unique(), ttl=ttl) for ttl in [600, 900] * 50]
    leases = [hold(request) for request in requests]  # due in 200 s: the thread stays out
    before = {r.external_id: expiry(r.external_id) for r in requests}
    time.sleep(0.05)
    try:
        with CaptureQueriesContext(connection) as statements:
            idle_heartbeat.beat()
    finally:
        for lease in leases:
            lease.drop()
    assert len(statements) == 1
    assert statements[0]["sql"].lstrip().upper().startswith("UPDATE")
    assert all(expiry(key) > was for key, was in before.items())
    assert not any(lease.lost for lease in leases)


def test_a_lost_lease_marks_only_its_holder(make_semaphore, idle_heartbeat):
    sem = make_semaphore(capacity=3)
    lapsed = acquire(sem.name, external_id=unique(), ttl=1)
    time.sleep(1.2)  # past its expiry, never renewed: a renewal must not revive it
    kept, revoked = (acquire(sem.name, external_id=unique(), ttl=600) for _ in range(2))
    # The thread's first beat is due in ttl/3: this test's own beat comes first.
    leases = {r.external_id: hold(r) for r in (kept, revoked, lapsed)}
    release_requests("default", [revoked.pk], ReleaseReason.ADMIN)
    with CaptureQueriesContext(connection) as statements:
        idle_heartbeat.beat()
    assert len(statements) == 2  # the renewal fell short: which keys it missed
    assert {key for key, lease in leases.items() if lease.lost} == {
        revoked.external_id,
        lapsed.external_id,
    }
    assert expiry(lapsed.external_id) == lapsed.expires_at
    assert idle_heartbeat.holding == 1
    leases[kept.external_id].drop()


@pytest.mark.usefixtures("sync_thread_connections")
async def test_async_permit_is_renewed_by_the_same_heartbeat(make_semaphore, idle_heartbeat):
    sem = await sync_to_async(make_semaphore)(capacity=1)
    tasks_before = len(asyncio.all_tasks())
    async with permit(sem.name, ttl=1) as grant:
        assert len(asyncio.all_tasks()) == tasks_before  # no task of its own
        assert idle_heartbeat.holding == 1
        first = await sync_to_async(expiry)(grant.external_id)
        await asyncio.sleep(2.5)  # past the ttl: the process heartbeat renewed it
        assert await sync_to_async(expiry)(grant.external_id) > first
    assert not grant.lost


def test_a_forked_child_starts_with_no_lease_and_no_thread(make_semaphore, idle_heartbeat):
    sem = make_semaphore()
    with permit(sem.name, ttl=600):
        pid = os.fork()
        if pid == 0:  # the child: report and leave at once, touching nothing
            clean = idle_heartbeat.holding == 0 and not any(
                thread.name == "semaphore-heartbeat" for thread in threading.enumerate()
            )
            os._exit(0 if clean else 1)
        assert forked_child_exit_code(pid, 10, "the forked child did not exit") == 0
        assert idle_heartbeat.holding == 1  # the parent's lease is untouched


# --- a holder killed with SIGKILL: its permit back within lease + 5 s --------------


def granted_again_within(name: str, bound: float) -> float:
    """Seconds until a new acquire of ``name`` is granted (fails past ``bound``)."""
    started = time.monotonic()
    acquire(name, external_id=unique("after-crash"), timeout=bound)
    return time.monotonic() - started


def test_a_killed_process_gives_its_permit_back_after_its_lease(make_semaphore):
    sem = make_semaphore(capacity=1)
    outbox = Outbox.create()
    holder = spawn(hold_until_killed, sem.name, 2, outbox, bound=90)
    deadline = time.monotonic() + 60
    while not outbox.items():
        if time.monotonic() > deadline or not holder.is_alive():
            pytest.fail(f"The holder never held:\n{stop([holder])}")
        time.sleep(0.05)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    (key,) = outbox.items()
    assert granted_again_within(sem.name, 2 + GRACE) <= 2 + GRACE
    request = PermitRequest.objects.get(external_id=key)
    assert (request.state, request.release_reason) == (State.RELEASED, ReleaseReason.EXPIRED)


# The two real-worker tests below are marked ``once``: the database's part
# (an expired lease's permit granted again; a kept permit found by its token)
# is tested on every database by the killed process's test above and by
# test_tasks' permit kept across a retry; what these add is Celery's side (a
# pool child's lease, a countdown longer than the lease).


@pytest.mark.slow
@pytest.mark.once
def test_a_killed_worker_child_gives_its_task_permit_back_after_its_lease(short_lease_worker):
    Semaphore.objects.create(name=tasks.ONE, capacity=1)
    result = tasks.held_until_killed.delay("killed-leased", 120)
    os.kill(short_lease_worker.started("killed-leased").pid, signal.SIGKILL)

    assert granted_again_within(tasks.ONE, 2 + GRACE) <= 2 + GRACE
    request = PermitRequest.objects.get(external_id=result.id)
    assert (request.state, request.release_reason) == (State.RELEASED, ReleaseReason.EXPIRED)


@pytest.mark.slow
@pytest.mark.once
def test_a_permit_kept_across_a_retry_outlasts_the_lease(short_lease_worker):
    """A countdown of twice the lease: nobody renews the parked permit, yet
    the retry finds it (the same token, no second key)."""
    Semaphore.objects.create(name=tasks.ONE, capacity=1)
    result = tasks.retries_after_a_lease.delay("kept-across", 4)
    result.get(timeout=60, propagate=False)

    assert result.state == "SUCCESS", short_lease_worker.log_tail()
    first, second = RunLog.objects.filter(label="kept-across").order_by("started_at")
    assert (second.started_at - first.started_at).total_seconds() >= 4
    assert first.token == second.token
    assert list(
        PermitRequest.objects.filter(external_id__startswith=result.id).values_list(
            "external_id", flat=True
        )
    ) == [result.id]
