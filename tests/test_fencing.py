from __future__ import annotations

import threading

import pytest
from django.db import connections, transaction

from django_semaphore import acquire, fencing
from django_semaphore.exceptions import InvalidRequest, StaleFencingToken
from django_semaphore.models import FencingMark
from tests.conftest import unique

pytestmark = pytest.mark.django_db(transaction=True)


def test_advance_records_the_highest_token():
    resource = unique("res")
    fencing.advance(resource, 3)
    fencing.advance(resource, 3)  # the same holder writing twice
    fencing.advance(resource, 7)

    assert FencingMark.objects.get(resource=resource).token == 7


def test_lower_token_is_stale():
    resource = unique("res")
    fencing.advance(resource, 7)
    with pytest.raises(StaleFencingToken) as excinfo:
        fencing.advance(resource, 6)
    assert (excinfo.value.token, excinfo.value.highest) == (6, 7)
    assert FencingMark.objects.get(resource=resource).token == 7


def test_stale_holder_after_expiry_is_fenced_off(make_semaphore):
    """Kleppmann's scenario: a paused holder's TTL lapses, a new holder writes."""
    from datetime import timedelta

    from django_semaphore.models import PermitRequest

    sem = make_semaphore(capacity=1)
    old = acquire(sem.name, external_id=unique(), ttl=30)
    PermitRequest.objects.filter(pk=old.pk).update(expires_at=old.created_at - timedelta(seconds=1))
    new = acquire(sem.name, external_id=unique())

    fencing.advance("report.csv", new.token(sem.name))
    with pytest.raises(StaleFencingToken):
        fencing.advance("report.csv", old.token(sem.name))


def test_advance_inside_the_writers_transaction_rolls_back_with_it():
    resource = unique("res")

    def advance_then_fail() -> None:
        with transaction.atomic():
            fencing.advance(resource, 5)
            raise RuntimeError("the guarded write failed")

    with pytest.raises(RuntimeError):
        advance_then_fail()
    assert not FencingMark.objects.filter(resource=resource).exists()


def test_concurrent_first_advances():
    resource = unique("res")
    barrier = threading.Barrier(8)
    outcomes: list[object] = []

    def advance(token: int) -> None:
        try:
            barrier.wait()
            fencing.advance(resource, token)
            outcomes.append(token)
        except StaleFencingToken as exc:
            outcomes.append(exc)
        finally:
            connections.close_all()

    threads = [
        threading.Thread(daemon=True, target=advance, args=(token,)) for token in range(1, 9)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert FencingMark.objects.get(resource=resource).token == 8
    assert 8 in outcomes  # the highest token is never refused
    assert all(isinstance(o, int | StaleFencingToken) for o in outcomes)


@pytest.mark.parametrize(
    ("resource", "token"), [("", 1), ("r" * 256, 1), (None, 1), ("r", -1), ("r", "1"), ("r", True)]
)
def test_bad_input(resource, token):
    with pytest.raises(InvalidRequest):
        fencing.advance(resource, token)


@pytest.mark.parametrize("token", [2**63, 2**64, 2**70])
def test_a_token_beyond_the_column_is_refused_and_nothing_is_written(token):
    """The token column holds 0..2**63-1 (PostgreSQL, SQLite; MySQL's unsigned
    one more): one rule on every database, not a driver's error on some."""
    resource = unique("res")
    fencing.advance(resource, 5)

    with pytest.raises(InvalidRequest, match="from 0 to 9223372036854775807"):
        fencing.advance(resource, token)
    with pytest.raises(InvalidRequest):
        fencing.advance(unique("res"), token)

    assert FencingMark.objects.get(resource=resource).token == 5
    assert FencingMark.objects.count() == 1


def test_the_highest_token_the_column_holds_is_accepted():
    resource = unique("res")
    fencing.advance(resource, 2**63 - 1)

    assert FencingMark.objects.get(resource=resource).token == 2**63 - 1


@pytest.mark.parametrize("using", ["no-such-alias", 5, ""])
def test_an_unknown_alias_is_refused(using):
    with pytest.raises(InvalidRequest, match="using"):
        fencing.advance(unique("res"), 1, using=using)
    assert not FencingMark.objects.exists()
