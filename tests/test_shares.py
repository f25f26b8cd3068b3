"""Shares: the share keys waiting on a semaphore are served in turn, each
as often as its weight, rather than first come, first served
(``engine/line.turn``, ``SHARE_WEIGHTS``)."""

from __future__ import annotations

import collections
import threading
import time
from datetime import timedelta
from io import StringIO

import hypothesis
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connections
from django.test import override_settings
from hypothesis import strategies as st

from django_semaphore import acquire, holds_permit, permit, release
from django_semaphore.blockers import why_waiting
from django_semaphore.conf import app_settings, setting_problems
from django_semaphore.exceptions import InvalidRequest
from django_semaphore.models import PermitRequest, Semaphore, Ticket
from tests.conftest import unique
from tests.test_fair import Waiter, key, wait_for_tickets
from tests.test_priority import SETTLED, served_in_turn
from tests.test_rates import rate_limit

pytestmark = pytest.mark.django_db(transaction=True)


def line_up(name: str, order: list[str], *shares: str, **kwargs) -> list[Waiter]:
    """A waiter per share key given, each in line before the next starts."""
    waiters, before = [], Ticket.objects.filter(semaphore__name=name).count()
    for share in shares:
        waiter = Waiter(name, order, timeout=30, share=share, **kwargs)
        waiter.start()
        waiters.append(waiter)
        wait_for_tickets(name, before + len(waiters))
    time.sleep(SETTLED)
    return waiters


def in_line(name: str) -> list[str]:
    return list(
        Ticket.objects.filter(semaphore__name=name).in_line().values_list("external_id", flat=True)
    )


def test_a_share_key_that_comes_later_is_served_in_turn_with_one_that_has_a_backlog(
    make_semaphore,
):
    semaphore = make_semaphore(1)
    holder = key()
    acquire(semaphore.name, external_id=holder)
    order: list[str] = []
    a = line_up(semaphore.name, order, *["customer-a"] * 4)
    b = line_up(semaphore.name, order, *["customer-b"] * 2)
    turns = [a[0], b[0], a[1], b[1], a[2], a[3]]
    assert in_line(semaphore.name) == [waiter.key for waiter in turns]

    release(holder)
    served_in_turn(order, *turns)
    assert order == [waiter.key for waiter in turns]


@override_settings(DJANGO_SEMAPHORE={"SHARE_WEIGHTS": {"gold": 2}})
def test_a_heavier_share_key_is_served_as_often_as_its_weight(make_semaphore):
    semaphore = make_semaphore(1)
    acquire(semaphore.name, external_id=(holder := key()))
    order: list[str] = []
    plain = line_up(semaphore.name, order, *["plain"] * 4)
    gold = line_up(semaphore.name, order, *["gold"] * 4)
    turns = [plain[0], gold[0], gold[1], plain[1], gold[2], gold[3], plain[2], plain[3]]
    assert in_line(semaphore.name) == [waiter.key for waiter in turns]
    release(holder)
    served_in_turn(order, *turns)


def test_waiters_without_a_share_key_keep_their_arrival(make_semaphore):
    """A waiter without a key is in line from when it came: one that comes
    after a key's backlog is served before the backlog's later turns."""
    semaphore = make_semaphore(1)
    acquire(semaphore.name, external_id=(holder := key()))
    order: list[str] = []
    backlog = line_up(semaphore.name, order, *["tenant"] * 3)
    [plain] = line_up(semaphore.name, order, "")
    tickets = {t.external_id: t for t in Ticket.objects.filter(semaphore=semaphore)}
    assert tickets[plain.key].share == ""
    assert tickets[plain.key].turn_at is None
    assert {tickets[w.key].share for w in backlog} == {"tenant"}
    assert in_line(semaphore.name) == [backlog[0].key, plain.key, backlog[1].key, backlog[2].key]
    release(holder)
    served_in_turn(order, backlog[0], plain, backlog[1], backlog[2])


def test_priority_moves_a_share_keys_waiter_ahead_of_its_turn(make_semaphore):
    semaphore = make_semaphore(1)
    acquire(semaphore.name, external_id=(holder := key()))
    order: list[str] = []
    a = line_up(semaphore.name, order, *["a"] * 3)
    [urgent] = line_up(semaphore.name, order, "b", priority=100)
    assert in_line(semaphore.name) == [urgent.key, *(w.key for w in a)]
    release(holder)
    served_in_turn(order, urgent, *a)


def test_a_share_key_is_validated_and_an_int_is_its_str(make_semaphore):
    semaphore = make_semaphore(1)
    for bad in (["a"], True, " ", "x" * 256, "a\x00b"):
        with pytest.raises(InvalidRequest, match="share"):
            acquire(semaphore.name, external_id=unique(), share=bad)
    acquire(semaphore.name, external_id=(holder := key()))
    order: list[str] = []
    waiter = Waiter(semaphore.name, order, timeout=30, share=42)
    waiter.start()
    wait_for_tickets(semaphore.name, 1)
    assert Ticket.objects.get(semaphore=semaphore).share == "42"
    release(holder)
    served_in_turn(order, waiter)
    with pytest.raises(InvalidRequest, match="share"):
        holds_permit(semaphore.name, share=3.5)


def test_share_weights_are_checked():
    assert setting_problems("SHARE_WEIGHTS", {"gold": 2, "silver": 1.5}) == []
    assert setting_problems("SHARE_WEIGHTS", lambda share: 1) == []
    assert setting_problems("SHARE_WEIGHTS", ["gold"])
    assert setting_problems("SHARE_WEIGHTS", {"gold": 0})
    assert setting_problems("SHARE_WEIGHTS", {"gold": 1001})
    assert "an int key is its str: '7'" in setting_problems("SHARE_WEIGHTS", {7: 2})[0]
    with (
        override_settings(DJANGO_SEMAPHORE={"SHARE_WEIGHTS": {"gold": -1}}),
        pytest.raises(ImproperlyConfigured, match="SHARE_WEIGHTS"),
    ):
        app_settings.share_weight("gold")


@override_settings(DJANGO_SEMAPHORE={"SHARE_WEIGHTS": lambda share: "heavy"})
def test_a_callable_that_gives_no_weight_is_a_clear_error(make_semaphore):
    semaphore = make_semaphore(1)
    acquire(semaphore.name, external_id=key())
    with pytest.raises(InvalidRequest, match="weight 'heavy'"):
        acquire(semaphore.name, external_id=key(), timeout=1, share="x")


def test_a_computed_share_key_takes_the_calls_arguments(make_semaphore):
    semaphore = make_semaphore(1)
    acquire(semaphore.name, external_id=(holder := key()))
    seen: list[str] = []

    @holds_permit(semaphore.name, timeout=30, share=lambda customer_id: customer_id)
    def export(customer_id: int) -> None:
        seen.append(str(customer_id))

    thread = threading.Thread(target=lambda: (export(7), connections.close_all()), daemon=True)
    thread.start()
    wait_for_tickets(semaphore.name, 1)
    assert Ticket.objects.get(semaphore=semaphore).share == "7"
    release(holder)
    thread.join(10)
    assert not thread.is_alive()
    assert seen == ["7"]
    with permit(semaphore.name, share="direct") as held:
        assert held.request is not None


@pytest.mark.slow
@override_settings(DJANGO_SEMAPHORE={"SHARE_WEIGHTS": {"one": 1, "two": 2, "three": 3}})
def test_three_keys_with_backlogs_are_granted_by_their_weights(make_semaphore):
    """Three share keys weighted 1:2:3, each with four threads that always
    wait: over 600 grants, each key's share within 10 % of its weight's."""
    semaphore = make_semaphore(1)
    grants: list[str] = []
    stop = threading.Event()
    errors: list[Exception] = []

    def customer(share: str) -> None:
        try:
            while not stop.is_set():
                taken = key()
                acquire(semaphore.name, external_id=taken, timeout=30, share=share)
                grants.append(share)
                release(taken)
        except Exception as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [
        threading.Thread(target=customer, args=(share,), daemon=True)
        for share in ("one", "two", "three")
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 240
    while len(grants) < 700 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for thread in threads:
        thread.join(30)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads)
    # The first 100 while the backlogs build up; then 600 with all three waiting.
    counted = collections.Counter(grants[100:700])
    print(f"\n600 grants by weight 1:2:3: {counted}")
    assert sum(counted.values()) == 600
    for share, weight in (("one", 1), ("two", 2), ("three", 3)):
        expected = 600 * weight / 6
        assert abs(counted[share] - expected) <= expected / 10, counted


def test_the_ticket_lease_keeps_a_share_keys_turn(make_semaphore):
    """A waiter's ticket renewed while it waits keeps its turn: the key's
    next waiter comes after it, not beside the head again."""
    semaphore = make_semaphore(1)
    acquire(semaphore.name, external_id=(holder := key()))
    order: list[str] = []
    first, second = line_up(semaphore.name, order, "k", "k")
    turns = dict(Ticket.objects.values_list("external_id", "turn_at"))
    assert turns[second.key] - turns[first.key] == timedelta(seconds=1)
    release(holder)
    served_in_turn(order, first, second)


def test_why_waiting_and_the_status_name_the_share_keys(make_semaphore):
    semaphore = make_semaphore(1)
    acquire(semaphore.name, external_id=(holder := key()))
    order: list[str] = []
    a = line_up(semaphore.name, order, *["a"] * 3)
    [b] = line_up(semaphore.name, order, "b")
    waiting = why_waiting(b.key)
    assert waiting is not None
    [blocker] = waiting.blockers
    assert (blocker.older, blocker.by_share) == (1, [("a", 1)])
    explained = "\n".join(waiting.explained())
    assert "share 'b'" in waiting.explained()[0]
    assert "ahead by share key: share 'a': 1" in explained

    out = StringIO()
    call_command("semaphore_status", semaphore.name, stdout=out)
    lines = out.getvalue().splitlines()
    shown = [line.split()[-1] for line in lines if any(w.key in line for w in [*a, b])]
    assert shown == ["a", "b", "a", "a"]
    assert "Waiting by share key, most first: a 3, b 1" in lines
    release(holder)
    served_in_turn(order, a[0], b, a[1], a[2])


@pytest.mark.slow
@hypothesis.settings(
    max_examples=3,
    deadline=None,
    phases=[hypothesis.Phase.generate],  # an example takes seconds: none shrunk
    suppress_health_check=list(hypothesis.HealthCheck),
)
@hypothesis.given(
    capacity=st.integers(1, 3),
    rate=st.integers(2, 6),
    own=st.integers(1, 2),
    customers=st.lists(st.sampled_from("abc"), min_size=6, max_size=6),
    weights=st.dictionaries(st.sampled_from("abc"), st.integers(1, 3)),
)
def test_shares_with_a_rate_limit_and_a_family_never_exceed_any_of_them(
    settings, capacity, rate, own, customers, weights
):
    """Six threads of random customers (share keys of random weights), each
    demand the shared ``exports``, a rate limit on ``smtp`` and the
    customer's own member of a family, in one grant: at no moment more
    holders than a capacity, in no window more grants than the rate."""
    prefix = unique("share")
    settings.DJANGO_SEMAPHORE = {
        "SEMAPHORES": {f"{prefix}:customer:*": own},
        "SHARE_WEIGHTS": weights,
    }
    exports = Semaphore.objects.create(name=f"{prefix}-exports", capacity=capacity).name
    smtp = rate_limit(rate, window=1).name
    holding: collections.Counter[str] = collections.Counter()
    most: collections.Counter[str] = collections.Counter()
    lock, errors, until = threading.Lock(), [], time.monotonic() + 3

    def customer(share: str) -> None:
        demand = [exports, smtp, f"{prefix}:customer:{share}"]
        try:
            while time.monotonic() < until:
                taken = key()
                acquire(demand, external_id=taken, timeout=30, share=share)
                with lock:
                    holding.update(demand[::2])
                    for name in demand[::2]:
                        most[name] = max(most[name], holding[name])
                time.sleep(0.01)
                with lock:
                    holding.subtract(demand[::2])
                release(taken)
        except Exception as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=customer, args=(c,), daemon=True) for c in customers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    if errors:
        raise errors[0]
    assert most[exports] <= capacity
    assert all(most[name] <= own for name in most if name != exports)
    granted = sorted(
        PermitRequest.objects.filter(permits__semaphore__name=smtp).values_list(
            "created_at", flat=True
        )
    )
    assert granted
    assert all(
        later - earlier >= timedelta(seconds=1)
        for earlier, later in zip(granted, granted[rate:], strict=False)
    )
