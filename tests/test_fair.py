"""The line: every waiter's tickets, first come first served, no barging, the queue's cost."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_semaphore import acquire, release
from django_semaphore.backends import DatabaseNow
from django_semaphore.exceptions import (
    AcquireTimeout,
    PermitAlreadyReleased,
    SemaphoreExhausted,
    WaitersInLine,
)
from django_semaphore.models import Semaphore, Ticket
from tests.conftest import behind_the_engine

pytestmark = pytest.mark.django_db(transaction=True)


def key() -> str:
    return uuid.uuid4().hex


def wait_for_tickets(name: str, count: int, within: float = 10.0) -> None:
    """Until ``count`` tickets wait on ``name``: a waiter's place is taken."""
    deadline = time.monotonic() + within
    while Ticket.objects.filter(semaphore__name=name).count() < count:
        assert time.monotonic() < deadline, f"{count} tickets never appeared on {name}"
        time.sleep(0.01)


def statements_of_a_cycle(name: str) -> int:
    """The statements one acquire and its release send."""
    k = key()
    with CaptureQueriesContext(connection) as queries:
        acquire(name, external_id=k)
    release(k)
    return len(queries)


class Waiter(threading.Thread):
    """acquire() in a thread; records when it was granted, in order."""

    def __init__(self, names, order: list[str], **kwargs) -> None:
        super().__init__(daemon=True)
        self.names, self.order, self.kwargs = names, order, kwargs
        self.key = key()
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            acquire(self.names, external_id=self.key, **self.kwargs)
            self.order.append(self.key)
        except Exception as exc:
            self.error = exc
        finally:
            connections.close_all()

    def finish(self, within: float = 10.0) -> None:
        """Join; a waiter still running would outlive the test and its database."""
        self.join(within)
        assert not self.is_alive(), f"waiter {self.key} still waiting after {within}s"


def test_a_waiter_takes_a_ticket_and_drops_it_when_granted(make_semaphore):
    semaphore = make_semaphore(1)
    holder = key()
    acquire(semaphore.name, external_id=holder)
    order: list[str] = []
    waiter = Waiter({semaphore.name: 1}, order, timeout=10, owner="w1")
    waiter.start()
    wait_for_tickets(semaphore.name, 1)
    ticket = Ticket.objects.get(semaphore=semaphore)
    assert (ticket.external_id, ticket.owner, ticket.count) == (waiter.key, "w1", 1)
    queued = Semaphore.objects.with_usage().get(pk=semaphore.pk)
    assert queued.waiters == 1
    assert timedelta(0) <= queued.longest_wait < timedelta(seconds=10)
    release(holder)
    waiter.finish()
    assert waiter.error is None
    assert order == [waiter.key]
    assert not Ticket.objects.filter(semaphore=semaphore).exists()
    assert Semaphore.objects.with_usage().get(pk=semaphore.pk).waiters == 0


def test_waiters_are_granted_in_arrival_order_even_when_a_later_one_fits(make_semaphore):
    semaphore = make_semaphore(3)
    held = [key() for _ in range(3)]
    for k in held:
        acquire(semaphore.name, external_id=k)
    order: list[str] = []
    big = Waiter({semaphore.name: 2}, order, timeout=20)
    big.start()
    wait_for_tickets(semaphore.name, 1)
    small = Waiter({semaphore.name: 1}, order, timeout=20)
    small.start()
    wait_for_tickets(semaphore.name, 2)
    release(held[0])  # room for the small one, not for the big one
    time.sleep(0.5)
    assert order == [], "the small request was granted ahead of the older big one"
    release(held[1])
    big.finish()
    assert big.error is None
    assert order == [big.key]
    release(held[2])
    small.finish()
    assert small.error is None
    assert order == [big.key, small.key]


def test_fail_fast_does_not_barge_past_a_queue(make_semaphore):
    semaphore = make_semaphore(2)
    held = [key(), key()]
    for k in held:
        acquire(semaphore.name, external_id=k)
    order: list[str] = []
    big = Waiter({semaphore.name: 2}, order, timeout=20)
    big.start()
    wait_for_tickets(semaphore.name, 1)
    release(held[0])
    # There is room for one, but an older ticket waits: refused, fair or not.
    with pytest.raises(SemaphoreExhausted):
        acquire(semaphore.name, external_id=key())
    with pytest.raises(SemaphoreExhausted):
        acquire(semaphore.name, external_id=key())
    release(held[1])
    big.finish()
    assert big.error is None
    assert order == [big.key]


def test_a_waiter_that_times_out_stops_blocking(make_semaphore):
    semaphore = make_semaphore(1)
    holder = key()
    acquire(semaphore.name, external_id=holder)
    with pytest.raises(AcquireTimeout):
        acquire(semaphore.name, external_id=key(), timeout=0.3)
    release(holder)
    acquire(semaphore.name, external_id=key())


def test_a_retry_with_the_same_key_keeps_its_place(make_semaphore):
    semaphore = make_semaphore(1)
    holder = key()
    acquire(semaphore.name, external_id=holder)
    order: list[str] = []
    first = Waiter(semaphore.name, order, timeout=20)
    first.start()
    wait_for_tickets(semaphore.name, 1)
    second = Waiter(semaphore.name, order, timeout=20)
    second.start()
    wait_for_tickets(semaphore.name, 2)
    again = Waiter(semaphore.name, [], timeout=20)
    again.key = first.key  # the same call, retried (say after a lost connection)
    again.start()
    time.sleep(0.3)
    assert Ticket.objects.filter(semaphore=semaphore).count() == 2
    release(holder)
    first.finish()
    assert first.error is None
    release(first.key)
    # One line per demand in a process: the retry waits behind the second
    # waiter, then finds its key's request, released by now.
    for waiter in (second, again):
        waiter.finish()
    assert second.error is None
    assert order == [first.key, second.key]
    assert isinstance(again.error, PermitAlreadyReleased)


def test_an_acquire_pays_nothing_once_the_queue_is_gone(make_semaphore):
    fair, plain = make_semaphore(1), make_semaphore(1)
    holder = key()
    acquire(fair.name, external_id=holder)
    with pytest.raises(AcquireTimeout):
        acquire(fair.name, external_id=key(), timeout=0.2)
    release(holder)
    # The same history on both: full, then released (the first grant after
    # reads the release counter).
    release(acquire(plain.name, external_id=key()).external_id)
    with behind_the_engine():
        Semaphore.objects.filter(pk=fair.pk).update(queued_until=timezone.now() - timedelta(1))
    assert statements_of_a_cycle(fair.name) == statements_of_a_cycle(plain.name)


def test_a_queue_whose_tickets_were_granted_is_over_before_its_deadline(make_semaphore):
    """The first newcomer granted past a queue with no ticket left ends it:
    the grants after it pay nothing for a queue that holds nobody back."""
    fair, plain = make_semaphore(1), make_semaphore(1)
    holder = key()
    acquire(fair.name, external_id=holder)
    order: list[str] = []
    waiter = Waiter({fair.name: 1}, order, timeout=30)
    waiter.start()
    wait_for_tickets(fair.name, 1)
    release(holder)
    waiter.finish()
    assert order == [waiter.key]
    release(waiter.key)
    assert Semaphore.objects.get(pk=fair.pk).queued_until is not None  # its deadline's

    release(acquire(fair.name, external_id=key()).external_id)
    assert Semaphore.objects.get(pk=fair.pk).queued_until is None
    release(acquire(plain.name, external_id=key()).external_id)  # the same history
    assert statements_of_a_cycle(fair.name) == statements_of_a_cycle(plain.name)


def test_multi_semaphore_waiters_keep_their_order_on_each_semaphore(make_semaphore):
    a, b = make_semaphore(1), make_semaphore(1)
    holder = key()
    acquire([a.name, b.name], external_id=holder)
    order: list[str] = []
    both = Waiter([a.name, b.name], order, timeout=20)
    both.start()
    wait_for_tickets(a.name, 1)
    only_b = Waiter(b.name, order, timeout=20)
    only_b.start()
    wait_for_tickets(b.name, 2)
    release(holder)
    both.finish()
    assert both.error is None
    assert order == [both.key]
    release(both.key)
    only_b.finish()
    assert only_b.error is None
    assert order == [both.key, only_b.key]


@pytest.mark.filterwarnings("ignore:fair= is deprecated")  # the waiter's, in its thread
@pytest.mark.parametrize("fair", [False, True])
def test_fair_is_deprecated_and_a_waiter_waits_in_line_whatever_it_says(make_semaphore, fair):
    from django_semaphore import holds_permit, permit

    semaphore = make_semaphore(1)
    with pytest.warns(DeprecationWarning, match="fair= is deprecated"):
        release(acquire(semaphore.name, external_id=key(), fair=fair).external_id)
    with (
        pytest.warns(DeprecationWarning, match="fair= is deprecated"),
        permit(semaphore.name, fair=fair),
    ):
        pass
    with pytest.warns(DeprecationWarning, match="fair= is deprecated"):

        @holds_permit(semaphore.name, fair=fair)
        def work():
            return "done"

    assert work() == "done"
    holder = key()
    acquire(semaphore.name, external_id=holder)
    order: list[str] = []
    waiter = Waiter(semaphore.name, order, timeout=20, fair=fair)
    waiter.start()
    wait_for_tickets(semaphore.name, 1)
    release(holder)
    waiter.finish()
    assert order == [waiter.key]


def test_waiting_threads_of_one_process_share_one_poller(make_semaphore, monkeypatch):
    from django_semaphore.engine import grant

    semaphore = make_semaphore(1)
    acquire(semaphore.name, external_id=key())
    attempts: list[float] = []
    real = grant.acquire_once

    def counted(*args):
        attempts.append(time.monotonic())
        return real(*args)

    monkeypatch.setattr(grant, "acquire_once", counted)
    threads, wait = 16, 2.0
    errors: list[Exception] = []

    def waiter() -> None:
        try:
            with pytest.raises(AcquireTimeout):
                acquire(semaphore.name, external_id=key(), timeout=wait)
        except Exception as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    started = time.monotonic()
    workers = [threading.Thread(daemon=True, target=waiter) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert errors == []
    # At most one first attempt each (it takes the waiter's tickets), then
    # one poller: next in line it attempts at least every second (probing in
    # between), further back it backs off; a herd would make 16 x that.
    within = [t for t in attempts if t - started < wait]
    assert attempts
    assert len(within) <= threads + 2 * wait + 4


def test_a_semaphore_fair_waiters_wait_on_is_not_deleted(client, make_semaphore):
    from tests.test_admin import semaphore_url, staff

    free, held = make_semaphore(1), make_semaphore(1)
    holder = key()
    acquire(held.name, external_id=holder)
    order: list[str] = []
    waiter = Waiter({free.name: 1, held.name: 1}, order, timeout=20, owner="w")
    waiter.start()
    try:
        wait_for_tickets(free.name, 1)
        with pytest.raises(WaitersInLine):
            free.delete()
        with pytest.raises(WaitersInLine):
            Semaphore.objects.filter(pk=free.pk).delete()
        client.force_login(staff("view_semaphore", "delete_semaphore"))
        page = client.post(semaphore_url(free, "delete"), {"post": "yes"})
        assert page.context["protected"] == [f"Waiter: {waiter.key} (w)"]
        assert Semaphore.objects.filter(pk=free.pk).exists()
    finally:
        release(holder)
        waiter.finish()
    assert order == [waiter.key], waiter.error
    release(waiter.key)
    free.delete()  # nobody waits any more


# --- a waiter's ticket lives by a lease it renews while it waits --------------------

SHORT_LEASE = 3  # the least TICKET_LEASE


@override_settings(DJANGO_SEMAPHORE={"TICKET_LEASE": SHORT_LEASE})
def test_waiting_threads_renew_their_tickets_and_their_queue(make_semaphore):
    """Three waiters of one process, one polling and two asleep, keep
    their tickets and their queue live for three leases, and their order."""
    semaphore = make_semaphore(1)
    holder = key()
    acquire(semaphore.name, external_id=holder)
    order: list[str] = []
    waiters = [Waiter(semaphore.name, order, timeout=30) for _ in range(3)]
    for count, waiter in enumerate(waiters, 1):
        waiter.start()
        wait_for_tickets(semaphore.name, count)
    time.sleep(3 * SHORT_LEASE)
    live = Ticket.objects.filter(expires_at__gt=DatabaseNow(), semaphore=semaphore)
    assert live.count() == 3
    queued = Semaphore.objects.filter(pk=semaphore.pk, queued_until__gt=DatabaseNow())
    assert queued.exists()
    release(holder)
    with pytest.raises(SemaphoreExhausted):  # no barging: the room is the first's
        acquire(semaphore.name, external_id=key())
    for waiter in waiters:
        waiter.finish(within=10)
        release(waiter.key)
    assert order == [waiter.key for waiter in waiters]


@override_settings(DJANGO_SEMAPHORE={"TICKET_LEASE": SHORT_LEASE})
def test_a_waiter_whose_lapsed_ticket_was_swept_takes_it_again(make_semaphore):
    semaphore = make_semaphore(1)
    holder = key()
    acquire(semaphore.name, external_id=holder)
    waiter = Waiter(semaphore.name, [], timeout=30)
    waiter.start()
    wait_for_tickets(semaphore.name, 1)
    Ticket.objects.filter(external_id=waiter.key).delete()  # as the sweep does a lapsed one
    wait_for_tickets(semaphore.name, 1, within=3 * SHORT_LEASE)
    release(holder)
    waiter.finish()
    assert waiter.error is None
