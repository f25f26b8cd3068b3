"""A task sent inside the caller's transaction (``transaction.atomic()``,
every send of a view under ``ATOMIC_REQUESTS``): its decision is made aside
and holds its semaphores' row locks as briefly as a grant does, while the
task is still published only if the caller commits (``parking.aside``).

On SQLite the caller's transaction holds the database's one write lock
whatever the app does, and the decision is made in it as before."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import pytest
from django.db import connection, connections, transaction

from django_semaphore import acquire, release, sweep
from django_semaphore.blockers import why_waiting
from django_semaphore.exceptions import SemaphoreExhausted
from django_semaphore.models import ParkedTask, Semaphore, Ticket
from django_semaphore.models.parked import SENDING
from django_semaphore.parking import aside
from tests import own_tasks, tasks
from tests.conftest import ago, unique
from tests.test_closed import in_a_thread
from tests.test_policies import result_rows

pytestmark = pytest.mark.django_db(transaction=True)

CLIENTS = 8
WORK = 1.0  # seconds the sender's transaction goes on after the send


@pytest.fixture
def servers_only() -> None:
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has one writer at a time: the caller's transaction holds it.")


def test_clients_go_on_while_a_sender_s_transaction_is_open(servers_only, published):
    Semaphore.objects.create(name=tasks.ONCE, capacity=CLIENTS + 1)
    stop = threading.Event()
    cycles: list[tuple[float, float]] = []  # (start, end) of each grant
    errors: list[Exception] = []

    def client() -> None:
        try:
            while not stop.is_set():
                key = unique("client")
                started = time.monotonic()
                acquire(tasks.ONCE, external_id=key, ttl=60)
                cycles.append((started, time.monotonic()))
                release(key)
        except Exception as error:
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.3)
        with transaction.atomic():
            sent = tasks.once.delay("in-a-view", 0)
            opened = time.monotonic()
            time.sleep(WORK)  # the rest of the request
            closed = time.monotonic()
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)

    assert errors == []
    inside = [end - start for start, end in cycles if opened <= start and end <= closed]
    assert len(inside) >= CLIENTS
    print(
        f"grants while the sender's transaction was open: {len(inside)}, "
        f"median {statistics.median(inside) * 1000:.1f} ms, max {max(inside) * 1000:.1f} ms"
    )
    assert max(end - start for start, end in cycles) < WORK / 2
    assert published == [sent.id]


def test_the_task_is_published_once_the_caller_commits(servers_only, published):
    Semaphore.objects.create(name=tasks.ONCE, capacity=1)

    with transaction.atomic():
        sent = tasks.once.delay("a", 0)
        assert published == []
        # Its room is kept, for everybody, from the send on.
        with pytest.raises(SemaphoreExhausted):
            _acquire_elsewhere(tasks.ONCE)
        # Seen from elsewhere, it is being sent (not debounced until 9000).
        told = "\n".join(_in_a_thread(lambda: why_waiting(sent.id)).explained())
        assert "Being sent: its sender's transaction has not committed yet." in told
        assert "Debounced" not in told

    assert published == [sent.id]
    parked = ParkedTask.objects.get(task_id=sent.id)
    assert parked.not_before is None
    assert parked.woken_at is not None
    # A second send finds the first one's room taken, and names it.
    assert tasks.once.delay("b", 0).id == sent.id


def test_a_rolled_back_send_is_never_published_and_its_room_comes_back(servers_only, published):
    Semaphore.objects.create(name=tasks.ONCE, capacity=1)

    with pytest.raises(RuntimeError), transaction.atomic():
        tasks.once.delay("a", 0)
        raise RuntimeError("the view failed")
    rolled_back = time.monotonic()

    assert published == []
    assert list(ParkedTask.objects.values_list("not_before", flat=True)) == [SENDING]
    # No send, no sweep: the sending process sees its transaction gone.
    while True:
        try:
            _acquire_elsewhere(tasks.ONCE)
            break
        except SemaphoreExhausted:
            assert time.monotonic() - rolled_back < 3 * aside.ABANDONED_AFTER.total_seconds()
            time.sleep(0.05)
    assert not ParkedTask.objects.exists()
    assert published == []


def test_the_sweep_drops_a_rolled_back_send_whose_process_died(
    servers_only, published, monkeypatch
):
    Semaphore.objects.create(name=tasks.ONCE, capacity=1)
    monkeypatch.setattr(aside, "watch", lambda alias, parked_id: None)  # died before it looked

    with pytest.raises(RuntimeError), transaction.atomic():
        tasks.once.delay("a", 0)
        raise RuntimeError("the view failed")

    # Just written, the row may still be its sender's (not locked yet).
    assert sweep.sweep_parked().unsent == 0
    ParkedTask.objects.update(parked_at=ago(seconds=60))

    assert sweep.sweep_parked().unsent == 1

    assert not ParkedTask.objects.exists()
    assert not Ticket.objects.exists()
    acquire(tasks.ONCE, external_id="after")
    assert published == []


def test_the_sweep_leaves_the_row_of_a_transaction_still_open(servers_only, published):
    Semaphore.objects.create(name=tasks.ONCE, capacity=1)
    with transaction.atomic():
        sent = tasks.once.delay("a", 0)
        # Past the sender's stall allowed: only its lock says it is live.
        time.sleep(aside.ABANDONED_AFTER.total_seconds() * 1.5)
        swept = _in_a_thread(sweep.sweep_parked)

    assert swept.unsent == 0
    assert published == [sent.id]


def test_a_waiting_task_sent_in_a_transaction_is_woken_after_it_commits(servers_only, published):
    semaphore = Semaphore.objects.create(name=tasks.LATEST, capacity=1)
    acquire(tasks.LATEST, external_id="holder")

    with transaction.atomic():
        sent = tasks.latest.delay("a", 0)
        # Released while the send is not confirmed: the wake-up passes it over...
        _in_a_thread(lambda: release("holder"))

    # ...and the sender's commit wakes it.
    assert published == [sent.id]
    assert semaphore.tickets.get().lacked


def test_a_django_task_enqueued_in_a_rolled_back_transaction_leaves_no_result(
    servers_only, published
):
    Semaphore.objects.create(name=own_tasks.ONCE, capacity=1)

    with pytest.raises(RuntimeError), transaction.atomic():
        own_tasks.once.enqueue("a")
        assert len(result_rows()) == 1
        raise RuntimeError("the view failed")

    assert result_rows() == []
    assert published == []

    # Its sender's watcher drops the abandoned row (about a second; more on
    # a loaded machine): then its room is kept by nobody.
    deadline = time.monotonic() + 10
    while ParkedTask.objects.exists():
        assert time.monotonic() < deadline, "the rolled-back send's row was never dropped"
        time.sleep(0.05)
    with transaction.atomic():
        result = own_tasks.once.enqueue("b")
    assert [(id, status) for id, status, _ in result_rows()] == [(result.id, "READY")]
    assert published == [result.id]


def _acquire_elsewhere(name: str) -> None:
    """``acquire`` on another connection (a thread's), its error raised here."""
    _in_a_thread(lambda: acquire(name, external_id=unique("elsewhere")))


def _in_a_thread(call: Any) -> Any:
    """``call()`` on another connection (a thread's): its answer, or its error."""
    thread, outcome = in_a_thread(call)
    thread.join(timeout=30)
    assert not thread.is_alive()
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]
