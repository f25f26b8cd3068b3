"""Semaphores sharded by name over two aliases (two separate databases), and
the checks that keep grants on write aliases."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import InterfaceError, OperationalError, connection, connections
from django.test.utils import CaptureQueriesContext

from django_semaphore import (
    acquire,
    backends,
    checks,
    force_release,
    release,
    renew,
    routing,
    set_capacity,
    sweep,
)
from django_semaphore.declared import create_declared_semaphores
from django_semaphore.exceptions import (
    CrossShardRequest,
    InvalidRequest,
    PermitAlreadyReleased,
    PermitNotFound,
)
from django_semaphore.models import CapacityChange, Permit, PermitRequest, Semaphore
from django_semaphore.states import ReleaseOutcome
from django_semaphore.waiting.standby import learned_holds
from tests.conftest import static_checks, unique

SHARDED = {"SHARDS": {"b-*": "shard"}}
both = pytest.mark.django_db(transaction=True, databases=["default", "shard"])


@pytest.fixture
def sharded(settings):
    settings.DJANGO_SEMAPHORE = SHARDED


def make(prefix: str, capacity: int = 1) -> Semaphore:
    name = unique(prefix)
    return Semaphore.objects.using(routing.alias_for_name(name)).create(
        name=name, capacity=capacity
    )


def test_names_are_placed_by_the_first_matching_pattern(settings):
    settings.DJANGO_SEMAPHORE = {"SHARDS": {"b-x*": "semaphores", "b-*": "shard"}}
    assert routing.alias_for_name("b-x1") == "semaphores"
    assert routing.alias_for_name("b-1") == "shard"
    assert routing.alias_for_name("B-1") == "default"  # case-sensitive, as names are
    assert routing.alias_for_names(["b-1", "b-2"]) == "shard"
    assert routing.aliases() == ["default", "semaphores", "shard"]


def test_a_request_across_aliases_is_refused_before_any_write(sharded):
    with pytest.raises(CrossShardRequest, match="cannot span database aliases") as caught:
        acquire(["a-1", "b-1"], external_id="k")
    assert isinstance(caught.value, InvalidRequest)


@both
def test_acquire_release_renew_work_on_the_names_alias(sharded):
    a, b = make("a", capacity=1), make("b", capacity=2)

    on_b = acquire({b.name: 2}, external_id=unique("key"), ttl=60)
    on_a = acquire(a.name, external_id=unique("key"))

    assert on_b._state.db == "shard"
    assert Permit.objects.using("shard").filter(request__external_id=on_b.external_id).exists()
    assert not PermitRequest.objects.filter(external_id=on_b.external_id).exists()
    assert on_b.token(b.name) == 1
    assert renew(on_b.external_id, ttl=120).ttl == 120
    assert release(on_b.external_id) is ReleaseOutcome.RELEASED
    assert release(on_a.external_id) is ReleaseOutcome.RELEASED
    assert release(on_b.external_id) is ReleaseOutcome.ALREADY_RELEASED
    assert release(unique("key")) is ReleaseOutcome.NOT_FOUND
    with pytest.raises(PermitNotFound):
        renew(unique("key"))


@both
def test_capacity_changes_land_on_the_names_alias(sharded):
    b = make("b", capacity=1)

    set_capacity(b.name, 5, reason="more")

    assert Semaphore.objects.using("shard").get(name=b.name).capacity == 5
    assert CapacityChange.objects.using("shard").filter(semaphore__name=b.name).count() == 1


@both
def test_sweeps_and_force_release_visit_every_alias(sharded):
    a, b = make("a"), make("b")
    keys = [acquire(s.name, external_id=unique("key"), ttl=60).external_id for s in (a, b)]
    for alias in ("default", "shard"):
        PermitRequest.objects.using(alias).update(
            expires_at=PermitRequest.objects.using(alias).get().expires_at - timedelta(hours=1)
        )

    assert sweep.release_orphans().expired == 2
    assert force_release([*keys, "nope"]) == {
        keys[0]: ReleaseOutcome.ALREADY_RELEASED,
        keys[1]: ReleaseOutcome.ALREADY_RELEASED,
        "nope": ReleaseOutcome.NOT_FOUND,
    }


def held(key: str) -> dict[str, str]:
    """alias -> the state of ``key``'s request there."""
    return {
        alias: state
        for alias in ("default", "shard")
        for state in PermitRequest.objects.using(alias)
        .filter(external_id=key)
        .values_list("state", flat=True)
    }


@both
def test_a_key_held_on_two_aliases_is_released_on_both(sharded):
    a, b = make("a"), make("b")
    key = unique("job")
    acquire(a.name, external_id=key, ttl=60)
    acquire(b.name, external_id=key, ttl=60)

    assert release(key) is ReleaseOutcome.RELEASED
    assert held(key) == {"default": "RELEASED", "shard": "RELEASED"}
    assert release(key) is ReleaseOutcome.ALREADY_RELEASED
    # Their room is back on both.
    acquire(a.name, external_id=unique("key"))
    acquire(b.name, external_id=unique("key"))


@both
def test_a_key_ended_on_one_alias_is_released_where_it_is_still_held(sharded):
    a, b = make("a"), make("b")
    key = unique("job")
    acquire(a.name, external_id=key)
    release(key)
    acquire(b.name, external_id=key)  # the shard cannot know the key ended elsewhere

    assert release(key) is ReleaseOutcome.RELEASED
    assert held(key) == {"default": "RELEASED", "shard": "RELEASED"}


@both
def test_a_key_held_on_two_aliases_is_renewed_on_both(sharded):
    a, b = make("a"), make("b")
    key = unique("job")
    requests = [acquire(s.name, external_id=key, ttl=60) for s in (a, b)]

    assert renew(key, ttl=600).ttl == 600
    for request in requests:
        stored = PermitRequest.objects.using(request._state.db).get(pk=request.pk)
        assert stored.ttl == 600
        assert stored.expires_at > request.expires_at + timedelta(seconds=500)

    # One of them ended: the holder has lost permits under its key.
    PermitRequest.objects.using("shard").filter(external_id=key).update(
        expires_at=requests[1].expires_at - timedelta(hours=1)
    )
    with pytest.raises(PermitAlreadyReleased):
        renew(key)


@both
def test_force_release_ends_a_key_on_every_alias_holding_it(sharded):
    a, b = make("a"), make("b")
    key = unique("job")
    acquire(a.name, external_id=key)
    acquire(b.name, external_id=key)

    assert force_release([key]) == {key: ReleaseOutcome.RELEASED}
    assert held(key) == {"default": "RELEASED", "shard": "RELEASED"}


@both
def test_a_release_learns_the_hold_on_each_alias_holding_the_key(sharded):
    a, b = make("a"), make("b")
    key = unique("job")
    acquire(a.name, external_id=key)
    acquire(b.name, external_id=key)

    release(key)

    # Each alias's grant was noted, and its release woke that alias's pollers.
    assert learned_holds({a.name: 1})
    assert learned_holds({b.name: 1})


def test_with_one_alias_a_key_is_placed_without_asking_the_database(db):
    with CaptureQueriesContext(connection) as queries:
        assert routing.aliases_for_key(unique("key")) == ["default"]
    assert not queries.captured_queries


@both
def test_status_command_lists_every_alias(sharded):
    a, b = make("a", capacity=2), make("b", capacity=3)
    acquire(b.name, external_id=unique("key"))
    out = StringIO()

    call_command("semaphore_status", a.name, b.name, stdout=out)

    lines = out.getvalue().splitlines()
    assert [line.split()[:3] for line in lines[1:]] == [[a.name, "2", "0"], [b.name, "3", "1"]]


@both
def test_declared_semaphores_are_created_on_their_alias(settings):
    a, b = unique("a"), unique("b")
    settings.DJANGO_SEMAPHORE = {**SHARDED, "SEMAPHORES": {a: 1, b: 2}}

    for alias in ("default", "shard"):
        create_declared_semaphores(using=alias)

    assert list(Semaphore.objects.using("shard").filter(name__in=[a, b]).values_list("name")) == [
        (b,)
    ]
    assert Semaphore.objects.filter(name=a).exists()


# --- where grants are decided --------------------------------------------------


class ElsewhereRouter:
    def db_for_read(self, model, **hints):
        return "replica"

    def db_for_write(self, model, **hints):
        return "semaphores" if model._meta.app_label == "django_semaphore" else None


def test_without_a_database_setting_the_app_follows_the_routers_writes(settings):
    settings.DATABASE_ROUTERS = [f"{__name__}.ElsewhereRouter"]
    assert routing.current_alias() == "semaphores"  # never db_for_read's "replica"
    settings.DJANGO_SEMAPHORE = {"DATABASE": "default"}
    assert routing.current_alias() == "default"


def test_a_router_writing_elsewhere_than_the_alias_is_warned(settings):
    settings.DJANGO_SEMAPHORE = {"DATABASE": "default"}
    settings.DATABASE_ROUTERS = [f"{__name__}.ElsewhereRouter"]
    assert "django_semaphore.W003" in [m.id for m in static_checks()]
    settings.DJANGO_SEMAPHORE = {"DATABASE": "default", "SHARDS": {"x-*": "semaphores"}}
    # Writes routed to a shard alias are the app's own: no replica there.
    assert [m for m in checks.check_production_database() if "routers" in m.msg] == []


@pytest.mark.parametrize("shards", [["x"], {"x-*": "nope"}, {1: "default"}])
def test_bad_shards_are_reported(settings, shards):
    settings.DJANGO_SEMAPHORE = {"SHARDS": shards}
    assert "django_semaphore.E010" in [m.id for m in static_checks()]


def test_a_read_only_or_lagging_server_is_warned():
    warnings = checks._server_warnings(
        "default",
        backends.ServerSettings(
            read_only="read_only", galera=True, causal_reads=False, isolation="read committed"
        ),
    )
    assert [w.id for w in warnings] == ["django_semaphore.W011", "django_semaphore.W004"]


@pytest.mark.django_db(transaction=True)
def test_the_database_check_reads_the_servers_session():
    assert checks.check_database_servers(databases=["default"]) == []
    if connection.vendor == "sqlite":
        return
    set_level = {
        "mysql": "SET SESSION TRANSACTION ISOLATION LEVEL {}",
        "postgresql": "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL {}",
    }[connection.vendor]
    with connection.cursor() as cursor:
        cursor.execute(set_level.format("REPEATABLE READ"))
    try:
        ids = [m.id for m in checks.check_database_servers(databases=["default"])]
    finally:
        connections["default"].close()  # a fresh session, as Django sets it up
    assert ids == ["django_semaphore.W005"]


class FakeMySQL:
    vendor = "mysql"


@pytest.mark.parametrize(
    ("code", "failure"),
    [
        (1213, backends.Failure.CONTENTION),  # Galera certification failure, also at COMMIT
        (3101, backends.Failure.CONTENTION),  # group replication's conflict at COMMIT
        (1047, backends.Failure.DISCONNECT),  # Galera node not ready (not in the primary)
        (1180, backends.Failure.DISCONNECT),  # Galera node losing its cluster at COMMIT
        (1290, backends.Failure.DISCONNECT),  # a primary demoted to read-only by a failover
        (1062, None),  # a real error: surfaced (translated), never retried
    ],
)
def test_cluster_errors_are_retried(code, failure):
    assert backends.classify(FakeMySQL(), OperationalError(code, "...")) is failure  # type: ignore[arg-type]


class FakePostgres:
    vendor = "postgresql"


class FakeSQLite:
    vendor = "sqlite"


@pytest.mark.parametrize(
    ("database", "failure"),
    [
        (FakeMySQL, backends.Failure.DISCONNECT),
        (FakePostgres, backends.Failure.DISCONNECT),
        (FakeSQLite, None),  # no connection to lose: a value it could not bind
    ],
)
def test_an_interface_error_is_a_lost_connection_only_on_a_server(database, failure):
    error = InterfaceError("Error binding parameter 1: type 'object' is not supported")
    assert backends.classify(database(), error) is failure  # type: ignore[arg-type]


def test_a_standby_refusing_writes_is_retried_on_a_new_connection():
    error = OperationalError("cannot execute UPDATE in a read-only transaction")
    error.__cause__ = type("PgError", (Exception,), {"sqlstate": "25006"})()
    assert backends.classify(FakePostgres(), error) is backends.Failure.DISCONNECT  # type: ignore[arg-type]


@both
def test_the_admin_shows_one_alias_at_a_time(sharded, admin_client):
    from django.urls import reverse

    a, b = make("a", capacity=2), make("b", capacity=3)
    request = acquire(b.name, external_id=unique("key"))
    semaphores = reverse("admin:django_semaphore_semaphore_changelist")

    page = admin_client.get(semaphores).content.decode()
    assert a.name in page
    assert b.name not in page
    assert "?_alias=shard" in page  # the way to the other alias

    switched = admin_client.get(f"{semaphores}?_alias=shard&q=b-")
    assert switched.status_code == 302
    assert switched["Location"] == f"{semaphores}?q=b-"
    page = admin_client.get(semaphores).content.decode()
    assert b.name in page
    assert a.name not in page
    change = reverse("admin:django_semaphore_semaphore_change", args=[b.pk])
    assert request.external_id in admin_client.get(change).content.decode()

    assert admin_client.get(f"{semaphores}?_alias=nope").status_code == 302
    assert b.name in admin_client.get(semaphores).content.decode()  # unchanged
