"""Listening for releases behind a transaction pooler (PgBouncer's
``pool_mode = transaction``), where a ``LISTEN`` hears nothing: the
listener connects through the direct alias ``LISTEN_DATABASES`` names;
without one, the waiters of an alias known to be pooled poll, and
``check`` says so."""

from __future__ import annotations

import threading
import uuid

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from django_semaphore import acquire, checks, release, waiting
from django_semaphore.waiting import listening
from tests.children import SPAWN, Outbox, join, spawn
from tests.waiting_clients import DIRECT, wait_listening_directly

# Far below the waiter's probes (waiting_clients.SLOW): only a notification
# grants it this soon.
WOKEN_WITHIN = 10.0


@pytest.fixture
def pooled(monkeypatch):
    """``default`` behind a transaction pooler, as its settings tell it."""
    monkeypatch.setitem(connections["default"].settings_dict, "DISABLE_SERVER_SIDE_CURSORS", True)


@pytest.fixture
def no_listener():
    """No listener thread of an earlier test, and none left behind."""
    listening.LISTENER.stop()
    yield
    listening.LISTENER.stop()


def postgresql() -> bool:
    return listening.notifies(connections["default"])


def test_an_alias_listens_on_itself_or_on_the_direct_alias_named(settings, monkeypatch):
    # MariaDB and SQLite have no LISTEN: nobody listens, wherever the settings point.
    assert listening.listen_alias("default") == ("default" if postgresql() else None)
    settings.DJANGO_SEMAPHORE = {"LISTEN_DATABASES": {"default": "semaphores"}}
    assert listening.listen_alias("default") == ("semaphores" if postgresql() else None)
    settings.DJANGO_SEMAPHORE = {"LISTEN_DATABASES": {"default": None}}
    assert listening.listen_alias("default") is None


def test_behind_a_pooler_without_a_direct_alias_nobody_listens(settings, pooled):
    assert listening.listen_alias("default") is None
    settings.DJANGO_SEMAPHORE = {"LISTEN_DATABASES": {"default": "semaphores"}}
    assert listening.listen_alias("default") == ("semaphores" if postgresql() else None)


@pytest.mark.django_db(transaction=True)
def test_a_pooled_alias_starts_no_listener_and_sends_no_notify(make_semaphore, pooled, no_listener):
    listening.LISTENER.wanted("default")
    assert "semaphore-listener-default" not in {t.name for t in threading.enumerate()}

    semaphore = make_semaphore(1)
    key = uuid.uuid4().hex
    acquire(semaphore.name, external_id=key)
    waiting._saw_wait("default", [semaphore.name])  # where it would notify
    with CaptureQueriesContext(connection) as queries:
        release(key)
    assert not any("pg_notify" in q["sql"] for q in queries.captured_queries)


@pytest.mark.django_db(transaction=True)
def test_behind_a_pooler_the_listener_listens_on_the_direct_alias(make_semaphore):
    if not postgresql():
        pytest.skip("only PostgreSQL listens")
    semaphore = make_semaphore(1)
    holder = uuid.uuid4().hex
    acquire(semaphore.name, external_id=holder)
    waiting._saw_wait("default", [semaphore.name])  # so this process notifies
    ready, waited = SPAWN.Event(), Outbox.create()
    child = spawn(wait_listening_directly, semaphore.name, ready, waited, bound=60)
    try:
        assert ready.wait(40), "the waiter never queued and listened"
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT query FROM pg_stat_activity "
                "WHERE application_name = %s AND datname = current_database()",
                [DIRECT],
            )
            listeners = cursor.fetchall()
    finally:
        release(holder)  # its NOTIFY is sent on the app's alias
        join([child], within=45)

    assert listeners == [(f"LISTEN {listening.CHANNEL}",)]
    [seconds] = waited.items()
    assert seconds is not None, "the waiter timed out"
    assert seconds < WOKEN_WITHIN


def test_check_says_a_pooled_alias_polls(settings, pooled):
    warned = checks.check_listening()
    if postgresql():
        assert [m.id for m in warned] == ["django_semaphore.W040"]
        assert "LISTEN_DATABASES" in warned[0].hint
    else:
        assert warned == []  # nothing listens there anyway
    for chosen in ("semaphores", None):
        settings.DJANGO_SEMAPHORE = {"LISTEN_DATABASES": {"default": chosen}}
        assert checks.check_listening() == []


def test_check_is_silent_without_a_pooler():
    assert checks.check_listening() == []


@pytest.mark.parametrize(
    "value",
    [
        ["semaphores"],
        {"nope": "semaphores"},
        {"default": "nope"},
        {"default": "shard", "semaphores": "default"},  # default is pooled
    ],
)
def test_malformed_listen_databases_are_reported(settings, pooled, value):
    settings.DJANGO_SEMAPHORE = {"LISTEN_DATABASES": value}
    assert [m.id for m in checks.check_settings()] == ["django_semaphore.E040"]
