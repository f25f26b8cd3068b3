"""permit(): acquire on entry, release on exit, heartbeat, PermitLost; signals."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from django_semaphore import acquire, permit, signals
from django_semaphore.engine.releasing import release_requests
from django_semaphore.exceptions import PermitLost, SemaphoreExhausted
from django_semaphore.integrations.leases import HEARTBEAT
from django_semaphore.models import PermitRequest, Semaphore
from django_semaphore.states import ReleaseReason, State
from tests.conftest import unique

pytestmark = pytest.mark.django_db(transaction=True)


def in_use(semaphore: Semaphore) -> int:
    return Semaphore.objects.with_usage().get(pk=semaphore.pk).in_use


def test_held_inside_released_after(make_semaphore):
    sem = make_semaphore(capacity=1)
    with permit(sem.name, owner="me") as grant:
        assert in_use(sem) == 1
        assert grant.request.owner == "me"
        assert grant.token(sem.name) == 1
        assert not grant.lost
    assert in_use(sem) == 0
    assert PermitRequest.objects.get(external_id=grant.external_id).state == State.RELEASED


def test_released_when_the_block_raises(make_semaphore):
    sem = make_semaphore(capacity=1)
    with pytest.raises(ZeroDivisionError), permit(sem.name):
        _ = 1 / 0
    assert in_use(sem) == 0


def test_block_never_runs_without_its_permit(make_semaphore):
    sem = make_semaphore(capacity=1)
    acquire(sem.name, external_id=unique())
    ran = False
    with pytest.raises(SemaphoreExhausted), permit(sem.name):
        ran = True
    assert not ran


def test_heartbeat_keeps_a_short_ttl_alive_through_long_work(make_semaphore):
    sem = make_semaphore(capacity=1)
    with permit(sem.name, ttl=1) as grant:
        time.sleep(3)  # three times the TTL: renewed every third of it
        # Another client still finds no room: the TTL never lapsed.
        with pytest.raises(SemaphoreExhausted):
            acquire(sem.name, external_id=unique())
        assert not grant.lost
    assert PermitRequest.objects.get(external_id=grant.external_id).release_reason == "released"


def test_force_release_mid_block_raises_permit_lost(make_semaphore):
    sem = make_semaphore(capacity=1)
    with pytest.raises(PermitLost), permit(sem.name, ttl=1) as grant:
        release_requests("default", [grant.request.pk], ReleaseReason.ADMIN)
        deadline = time.monotonic() + 5
        while not grant.lost and time.monotonic() < deadline:
            time.sleep(0.05)
    assert grant.lost


def test_without_heartbeat_the_ttl_is_left_alone(make_semaphore):
    sem = make_semaphore()
    with permit(sem.name, ttl=60, heartbeat=False) as grant:
        first = PermitRequest.objects.get(pk=grant.request.pk).expires_at
        time.sleep(0.1)
    assert grant.request.expires_at == first


def test_one_heartbeat_thread_however_many_permits(make_semaphore):
    sem = make_semaphore(capacity=5)
    with contextlib.ExitStack() as stack:
        for _ in range(5):
            stack.enter_context(permit(sem.name, ttl=3))
        heartbeats = [t for t in threading.enumerate() if t.name == "semaphore-heartbeat"]
        assert len(heartbeats) == 1
        assert HEARTBEAT.holding == 5
    assert HEARTBEAT.holding == 0  # idle: nothing left to renew


@pytest.mark.usefixtures("sync_thread_connections")
async def test_async_with(make_semaphore):
    sem = await sync_to_async(make_semaphore)(capacity=1)
    async with permit(sem.name, ttl=1) as grant:
        await asyncio.sleep(2.5)  # past the TTL: the heartbeat task renews it
        assert await sync_to_async(in_use)(sem) == 1
        assert not grant.lost
    assert await sync_to_async(in_use)(sem) == 0


@pytest.mark.usefixtures("sync_thread_connections")
async def test_async_with_lost(make_semaphore):
    sem = await sync_to_async(make_semaphore)(capacity=1)
    with pytest.raises(PermitLost):
        async with permit(sem.name, ttl=1) as grant:
            await sync_to_async(release_requests)("default", [grant.request.pk], "admin")
            await asyncio.sleep(1.5)


def test_signals_are_sent_after_commit(make_semaphore):
    sem = make_semaphore(capacity=2)
    seen: list[tuple[str, object]] = []

    def on_acquired(sender, request, using, **kwargs):
        # A receiver sees committed state: another connection finds the row.
        def check() -> None:
            try:
                seen.append(("committed", PermitRequest.objects.filter(pk=request.pk).exists()))
            finally:
                connections.close_all()

        thread = threading.Thread(daemon=True, target=check)
        thread.start()
        thread.join()
        seen.append(("acquired", request.external_id))

    def on_released(sender, request_ids, reason, using, **kwargs):
        seen.append(("released", (tuple(request_ids), reason)))

    signals.permit_acquired.connect(on_acquired)
    signals.permit_released.connect(on_released)
    try:
        with permit(sem.name, external_id="signalled") as grant:
            pass
    finally:
        signals.permit_acquired.disconnect(on_acquired)
        signals.permit_released.disconnect(on_released)

    assert seen == [
        ("committed", True),
        ("acquired", "signalled"),
        ("released", ((grant.request.pk,), "released")),
    ]
