"""A real 3-node MariaDB Galera cluster (multi-primary), clients spread over
its nodes, checked against the independent oracle of ``tests.clients``.

On Galera a row lock is local to its node: ``SELECT ... FOR UPDATE`` on node 1
does not stop node 2 from reading the same free room. What keeps grants safe
is the grant's write to the semaphore row (its fencing counter): two grants
that both write it conflict at certification, one fails with a deadlock
error (often at COMMIT) and is retried. The regression check below removes
that write and asserts that the cluster then over-grants, so the guard can
never silently disappear.

Run with ``DATABASE_URL`` on node 1 and ``SEMAPHORE_GALERA_URLS`` listing the
nodes (``scripts/servers.py start galera`` prints both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import MySQLdb
import pytest
from django.db import connection

from django_semaphore import backends, checks
from django_semaphore.models import Permit, ReleaseCounter, Semaphore
from tests import tasks
from tests.children import SPAWN, join, spawn
from tests.clients import Oracle
from tests.galera_clients import Tally, hammer_node, node_addresses, send_on_node

pytestmark = [pytest.mark.galera, pytest.mark.django_db(transaction=True)]

CLIENTS_PER_NODE = 2
DURATION = 8.0
# Without the guard an over-grant shows within a second or two; the cap only
# bounds a run that (wrongly) never shows one.
NEGATIVE_DURATION = 20.0


@pytest.fixture
def nodes() -> list[tuple[str, int]]:
    """The nodes' addresses; fails (never skips) without a 3-node cluster."""
    addresses = node_addresses()
    assert connection.vendor == "mysql", "the Galera tests run with DATABASE_URL on node 1"
    with connection.cursor() as cursor:
        cursor.execute("SHOW GLOBAL STATUS LIKE 'wsrep_cluster_size'")
        row = cursor.fetchone()
    assert row is not None, "not a Galera node"
    assert int(row[1]) == 3, f"not a 3-node Galera cluster: {row}"
    return addresses


@dataclass
class Run:
    oracle: Oracle
    tally: Tally
    entries: list[Any]  # (semaphore, entry sequence, fencing token) of every grant
    errors: list[str]


def run_on_nodes(
    addresses: list[tuple[str, int]],
    client: Any,
    target: Any,
    names: list[str],
    *,
    guard: bool,
    duration: float,
) -> Run:
    """``CLIENTS_PER_NODE`` spawned ``client``s on each node (``hammer_node``,
    ``send_on_node``), on ``target``, with their guard or without it; an
    oracle outside the database counts the holders of ``names``."""
    oracle, tally, stop = Oracle.create(names), Tally.create(), SPAWN.Event()
    name = connection.settings_dict["NAME"]
    workers = [
        spawn(
            client,
            oracle,
            target,
            duration,
            stop,
            tally,
            guard,
            bound=duration + 120,
            database={"NAME": name, "HOST": host, "PORT": port},
        )
        for host, port in addresses
        for _ in range(CLIENTS_PER_NODE)
    ]
    join(workers, within=duration + 130)
    return Run(oracle, tally, oracle.entries.items(), oracle.errors.items())


def node_view(address: tuple[str, int], semaphore: str) -> tuple[int, list[int]]:
    """One node's fencing counter of ``semaphore`` and its permits' tokens, read
    once the node has applied every write the cluster committed before."""
    settings = connection.settings_dict
    node = MySQLdb.connect(
        host=address[0],
        port=address[1],
        user=settings["USER"],
        password=settings["PASSWORD"],
        database=settings["NAME"],
    )
    try:
        cursor = node.cursor()
        cursor.execute("SET SESSION wsrep_sync_wait = 1")
        semaphores, permits = Semaphore._meta.db_table, Permit._meta.db_table
        counters = ReleaseCounter._meta.db_table
        # What the semaphore holds: its counter less the releases not folded in.
        cursor.execute(
            f"SELECT s.id, s.fencing_counter,"
            f" CAST(s.in_use_counter AS SIGNED) + s.released_folded - c.released"
            f" FROM {semaphores} s JOIN {counters} c ON c.semaphore_id = s.id WHERE s.name = %s",
            [semaphore],
        )
        semaphore_id, counter, in_use = cursor.fetchone()
        cursor.execute(
            f"SELECT fencing_token, count, state FROM {permits} WHERE semaphore_id = %s",
            [semaphore_id],
        )
        permits_rows = cursor.fetchall()
        held = sum(int(count) for _, count, state in permits_rows if state == "ACQUIRED")
        # The in-use counter exact on this node too: no drift.
        assert int(in_use) == held, f"node {address}: in_use {in_use}, permits held {held}"
        return int(counter), [int(token) for token, _, _ in permits_rows]
    finally:
        node.close()


def in_grant_order(entries: list[Any], name: str) -> list[int]:
    return [token for sem, _, token in sorted(entries, key=lambda e: e[1]) if sem == name]


def test_clients_on_three_nodes_never_over_grant(nodes, make_semaphore):
    one, three = make_semaphore(capacity=1).name, make_semaphore(capacity=3).name
    capacities = {one: 1, three: 3}

    run = run_on_nodes(
        nodes, hammer_node, capacities, sorted(capacities), guard=True, duration=DURATION
    )

    assert run.errors == [], "a raw driver error (or a bug) surfaced"
    assert run.tally.grants.value > 100, "too few grants to mean anything"
    assert {name: run.oracle.peak[name].value for name in capacities} == capacities
    # Concurrent grants on different nodes did conflict, and were retried.
    assert run.tally.conflicts.value > 0
    # One holder at a time: entry order is grant order, and tokens follow it.
    tokens = in_grant_order(run.entries, one)
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)
    for name in capacities:
        granted = len(in_grant_order(run.entries, name))
        for address in nodes:
            counter, node_tokens = node_view(address, name)
            # Every node holds the same history: one token per grant, none twice.
            assert counter == granted, f"node {address}: counter {counter} != {granted} grants"
            assert sorted(node_tokens) == list(range(1, granted + 1)), f"node {address}"


def test_without_the_semaphore_row_write_the_cluster_over_grants(nodes, make_semaphore):
    """The regression check: the same run with the grant's write to the
    semaphore row removed must over-grant. If this fails, the Galera test
    above no longer proves that the write is what protects the cluster."""
    one, three = make_semaphore(capacity=1).name, make_semaphore(capacity=3).name
    capacities = {one: 1, three: 3}

    run = run_on_nodes(
        nodes, hammer_node, capacities, sorted(capacities), guard=False, duration=NEGATIVE_DURATION
    )

    assert run.errors == []
    peaks = {name: run.oracle.peak[name].value for name in capacities}
    assert any(peaks[name] > capacities[name] for name in capacities), (
        f"no over-grant without the semaphore-row write: peaks {peaks}"
    )


def run_sends(addresses: list[tuple[str, int]], *, guard_write: bool, duration: float) -> Run:
    """Clients on each node sending a task of ``on_conflict="discard"`` on
    the capacity-1 ``tasks.ONCE``."""
    Semaphore.objects.create(name=tasks.ONCE, capacity=1)
    return run_on_nodes(
        addresses, send_on_node, tasks.ONCE, [tasks.ONCE], guard=guard_write, duration=duration
    )


def test_sends_on_three_nodes_are_sent_one_at_a_time(nodes):
    """``on_conflict="discard"`` from clients on every node: never two sent
    (woken, their room kept) at once on a capacity of 1."""
    run = run_sends(nodes, guard_write=True, duration=DURATION)

    assert run.errors == [], "a raw driver error (or a bug) surfaced"
    assert run.tally.grants.value > 50, "too few sends went out to mean anything"
    assert run.oracle.peak[tasks.ONCE].value == 1


def test_without_the_sends_row_write_two_are_sent_at_once(nodes):
    """The regression check: without the send's write to the semaphore row,
    sends on two nodes both find room."""
    run = run_sends(nodes, guard_write=False, duration=NEGATIVE_DURATION)

    assert run.errors == []
    assert run.oracle.peak[tasks.ONCE].value > 1, "no double send without the row write"


def test_the_database_check_warns_that_reads_may_lag_the_other_nodes(nodes):
    server = backends.server_settings(connection)
    assert server.galera
    assert not server.causal_reads  # the server's default wsrep_sync_wait = 0
    ids = [m.id for m in checks.check_database_servers(databases=["default"])]
    assert ids == ["django_semaphore.W004"]
