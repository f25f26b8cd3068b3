"""The routines: frozen in the migrations that install them, called by the
version the code was written for, and a deploy in either order never fails
a call (``engine/statements/routines.py``, ``migrations/_routines.py``)."""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from io import BytesIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connections
from django.test.utils import CaptureQueriesContext

from django_semaphore import acquire, backends, checks, release
from django_semaphore.engine.statements import ROUTINES_VERSION, routines
from django_semaphore.exceptions import LockContention, MissingPrivilege
from django_semaphore.migrations import _routines
from django_semaphore.states import ReleaseOutcome
from tests.children import join, spawn
from tests.conftest import unique
from tests.test_backends import row_locked_elsewhere

pytestmark = pytest.mark.django_db(transaction=True)

connection = connections["default"]  # the wrapper itself: the engine keeps state by it

REPOSITORY = Path(__file__).resolve().parent.parent
# The previous release: its code calls version 1 of the routines.
PREVIOUS_RELEASE = "ca0014a"
NEWEST = "0019_routines_v2"
# The previous release's last migration: its routines, and tickets not ranked.
BEFORE_NEWEST = "0017_routines_v1"
BEFORE_ROUTINES = "0018_ticket_priority"


@pytest.fixture(autouse=True)
def _routine_databases():
    if not routines.names_on(connection):
        pytest.skip("SQLite and MySQL have no routines")


@pytest.fixture
def fresh_routines(monkeypatch):
    """The test migrates the app back and forth; it ends with this version's
    routines installed again, and this process calling them."""
    monkeypatch.setattr(backends, "_without_routines", {})
    monkeypatch.setattr(backends, "_without_ranks", {})
    yield
    call_command("migrate", "django_semaphore", BEFORE_NEWEST, verbosity=0)
    call_command("migrate", "django_semaphore", verbosity=0)


def server() -> str:
    return "postgresql" if connection.vendor == "postgresql" else "mariadb"


def installed() -> dict[str, str]:
    """Each of the app's routines on the test database, by name and
    signature: its definition as the server keeps it."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT oid::regprocedure::text, pg_get_functiondef(oid) FROM pg_proc"
                " WHERE proname LIKE 'django\\_semaphore\\_%%'"
                " AND pronamespace = current_schema()::regnamespace"
            )
        else:
            cursor.execute(
                "SELECT r.ROUTINE_NAME, CONCAT(COALESCE(GROUP_CONCAT(p.PARAMETER_NAME, ' ',"
                " p.DTD_IDENTIFIER ORDER BY p.ORDINAL_POSITION), ''), r.ROUTINE_DEFINITION)"
                " FROM information_schema.ROUTINES r LEFT JOIN information_schema.PARAMETERS p"
                " ON p.SPECIFIC_SCHEMA = r.ROUTINE_SCHEMA AND p.SPECIFIC_NAME = r.ROUTINE_NAME"
                " WHERE r.ROUTINE_SCHEMA = DATABASE() GROUP BY r.ROUTINE_NAME, r.ROUTINE_DEFINITION"
            )
        return dict(cursor.fetchall())


def test_the_code_renders_the_text_its_version_froze():
    """A routine changed in the code without a new version and migration
    fails here: the migrations would never install it."""
    frozen = sorted(_routines.FROZEN.glob(f"*.{server()}.sql"))[-1].name.split(".")[0]
    assert frozen == NEWEST
    assert frozen.endswith(f"_v{ROUTINES_VERSION}")
    rendered = [unquoted(sql.strip()) for sql in routines.creates(connection)]
    assert rendered == [unquoted(sql) for sql in _routines._statements(frozen, server())], (
        "A routine's text changed: raise ROUTINES_VERSION and freeze it in a new migration "
        "(scripts/freeze_routines.py)."
    )


def unquoted(sql: str) -> str:
    """``sql`` without identifier quotes: Django 6.1 quotes the ORM's table
    aliases (`` `U0` ``) where 5.2 does not, in the locking read a routine
    embeds; the same statement either way."""
    return sql.replace("`", "").replace('"', "")


def test_the_migrations_installed_this_versions_frozen_text():
    frozen = dict(
        zip(routines.names_on(connection), _routines._statements(NEWEST, server()), strict=True)
    )
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT proname, prosrc FROM pg_proc WHERE proname = ANY(%s)", [list(frozen)]
            )
        else:
            cursor.execute(
                "SELECT ROUTINE_NAME, ROUTINE_DEFINITION FROM information_schema.ROUTINES"
                " WHERE ROUTINE_SCHEMA = DATABASE() AND ROUTINE_NAME LIKE %s",
                [f"%\\_v{ROUTINES_VERSION}"],
            )
        bodies = dict(cursor.fetchall())
    assert bodies.keys() == frozen.keys()
    for name, body in bodies.items():
        assert body in frozen[name]


@pytest.mark.once
def test_each_migrations_reverse_restores_the_routines_before_it(fresh_routines):
    steps = [
        "0009_rate_windows",
        "0010_grant_function",
        "0011_release_routine",
        "0012_grant_queue",
        "0013_parked_tasks_in_line",
        "0015_parked_task_not_before",
        "0016_fair_grant_in_one_trip",
        BEFORE_NEWEST,
        NEWEST,
    ]
    call_command("migrate", "django_semaphore", steps[0], verbosity=0)
    seen = [installed()]
    assert seen[0] == {}
    for before, step in itertools.pairwise(steps):
        call_command("migrate", "django_semaphore", step, verbosity=0)
        seen.append(installed())
        call_command("migrate", "django_semaphore", before, verbosity=0)
        assert installed() == seen[-2], f"reversing {step}"
        call_command("migrate", "django_semaphore", step, verbosity=0)
    versioned = {s for s in seen[-1] if s.split("(")[0].endswith(f"_v{ROUTINES_VERSION}")}
    assert len(versioned) == len(routines.names_on(connection))
    assert {s: d for s, d in seen[-1].items() if s not in versioned} == seen[-2]


def test_without_its_version_the_code_takes_the_general_path(
    fresh_routines, make_semaphore, caplog
):
    """Deployed before ``migrate``: every call works, the general way,
    logged once, and ``check --database`` says why; once migrated, one
    call again."""
    one, other = make_semaphore(capacity=1), make_semaphore(capacity=2)
    call_command("migrate", "django_semaphore", BEFORE_NEWEST, verbosity=0)
    [warning] = checks.check_routines(databases=["default"])
    assert warning.id == "django_semaphore.W021"
    assert all(name in warning.msg for name in routines.names_on(connection))

    with caplog.at_level(logging.WARNING, logger="django_semaphore"):
        for _ in range(2):
            key = unique()
            with CaptureQueriesContext(connection) as sent:
                acquire(one.name, external_id=key)
            assert len(sent) > 1
            assert release(key) is ReleaseOutcome.RELEASED
        acquire({one.name: 1, other.name: 1}, external_id="both")
        with pytest.raises(Exception, match="No capacity"):
            acquire(one.name, external_id="late")
        assert release("both") is ReleaseOutcome.RELEASED
    assert len([r for r in caplog.records if "lacks the routines" in r.message]) == 1

    call_command("migrate", "django_semaphore", NEWEST, verbosity=0)
    assert checks.check_routines(databases=["default"]) == []
    backends._without_routines.clear()  # as ROUTINES_RECHECK seconds later
    backends._without_ranks.clear()
    with CaptureQueriesContext(connection) as sent:
        acquire(other.name, external_id="one-trip")
    assert len(sent) == 1


def deploying_client(name: str, pair: list[str], until: float, done: str) -> None:
    """Acquire and release as fast as it can until ``until`` (wall clock),
    one name and two, waiting for room; any error fails the process."""
    ops = 0
    try:
        while time.time() < until:
            for demand in (name, {name: 1, pair[0]: 1}, {pair[1]: 1, name: 1}):
                key = unique("deploy")
                acquire(demand, external_id=key, timeout=30)
                assert release(key) is ReleaseOutcome.RELEASED
                ops += 2
    finally:
        connections.close_all()
    Path(done).write_text(str(ops))


OLD_CLIENT = """
import os, sys, time, uuid
import django
django.setup()
from django.db import connections
connections["default"].settings_dict["NAME"] = os.environ["TEST_DATABASE_NAME"]
from django_semaphore import acquire, release
name, until, ops = sys.argv[1], float(sys.argv[2]), 0
while time.time() < until:
    key = uuid.uuid4().hex
    acquire(name, external_id=key, timeout=30)
    assert release(key).value == "released"
    ops += 2
print(ops)
"""


def old_release(directory: str) -> str:
    """The package as the previous release had it, unpacked in ``directory``."""
    archive = subprocess.run(
        ["git", "-C", str(REPOSITORY), "archive", PREVIOUS_RELEASE, "django_semaphore"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    return directory


@pytest.mark.slow
def test_a_rolling_deploy_in_either_order_fails_no_call(fresh_routines, make_semaphore, tmp_path):
    """8 clients of this code and 2 of the previous release acquire and
    release while the database is migrated back and forward under them:
    not one call fails, and the counters stay exact (checked after every
    test)."""
    name = make_semaphore(capacity=3).name
    pair = [make_semaphore(capacity=2).name, make_semaphore(capacity=2).name]
    until = time.time() + 20
    done = [str(tmp_path / f"client-{i}") for i in range(8)]
    clients = [spawn(deploying_client, name, pair, until, d, bound=120) for d in done]
    with tempfile.TemporaryDirectory() as old:
        env = {
            **os.environ,
            "PYTHONPATH": f"{old_release(old)}{os.pathsep}{REPOSITORY}",
            "TEST_DATABASE_NAME": connection.settings_dict["NAME"],
        }
        olds = [
            subprocess.Popen(
                [sys.executable, "-c", OLD_CLIENT, name, str(until)],
                env=env,
                cwd=old,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        try:
            migrations = 0
            while time.time() < until - 2:
                call_command("migrate", "django_semaphore", BEFORE_NEWEST, verbosity=0)
                time.sleep(1)
                call_command("migrate", "django_semaphore", NEWEST, verbosity=0)
                time.sleep(1)
                migrations += 2
            join(clients, within=90)
            old_ops = [int(process.communicate(timeout=90)[0]) for process in olds]
        finally:
            for process in olds:
                process.kill()
    assert [process.returncode for process in olds] == [0, 0]
    assert min(old_ops) > 0
    assert min(int(Path(d).read_text()) for d in done) > 0
    assert migrations >= 4


def test_a_routine_dropped_while_a_call_runs_in_it_is_made_again_the_general_way(
    fresh_routines, make_semaphore
):
    """A migration drops the routines (its reverse, or a later release's
    cleanup of this version) while a release waits inside one for a row
    lock: the call is undone as a whole and made again without them -- it
    ends the request, once, and says so."""
    name = make_semaphore(capacity=1).name
    acquire(name, external_id="k")
    outcomes: list[ReleaseOutcome] = []

    def release_and_close() -> None:
        try:
            outcomes.append(release("k"))
        finally:
            connections.close_all()

    def migrate_back() -> None:
        try:
            call_command("migrate", "django_semaphore", BEFORE_NEWEST, verbosity=0)
        finally:
            connections.close_all()

    with row_locked_elsewhere(name, row="release counter") as unlock:
        releasing = threading.Thread(target=release_and_close, daemon=True)
        releasing.start()
        assert _releasing(within=10)
        # MariaDB's DROP waits for the call to end, PostgreSQL's does not.
        dropping = threading.Thread(target=migrate_back, daemon=True)
        dropping.start()
        dropping.join(timeout=1)
        unlock.set()
        releasing.join(timeout=30)
        dropping.join(timeout=30)
    assert not releasing.is_alive()
    assert not dropping.is_alive()
    assert outcomes == [ReleaseOutcome.RELEASED]
    assert release("k") is ReleaseOutcome.ALREADY_RELEASED


def _releasing(within: float) -> bool:
    """Whether another session runs the release routine within ``within``
    seconds: its CALL on PostgreSQL, the statement inside it on MariaDB."""
    running, pattern = (
        (
            "SELECT COUNT(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE %s",
            "CALL django_semaphore_release_v%",
        )
        if connection.vendor == "postgresql"
        else (
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST"
            " WHERE INFO LIKE %s AND ID <> CONNECTION_ID()",
            "%release_reason%",
        )
    )
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(running, [pattern])
            if cursor.fetchone()[0]:
                return True
        time.sleep(0.02)
    return False


@pytest.fixture
def app_user():
    """Connect the test as a user who may read and write the app's tables,
    create no routine, and run them only with ``execute``."""
    user, database = unique("app").replace("-", "_"), connection.settings_dict["NAME"]
    owner = {key: connection.settings_dict[key] for key in ("USER", "PASSWORD")}
    teardown: list[str] = []

    def connect_as(execute: bool) -> None:
        if connection.vendor == "postgresql":
            setup = [
                f"CREATE ROLE {user} LOGIN PASSWORD '{user}'",
                f"GRANT USAGE ON SCHEMA public TO {user}",
                f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {user}",
                f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {user}",
                "REVOKE EXECUTE ON ALL ROUTINES IN SCHEMA public FROM PUBLIC",
            ]
            teardown.extend(
                [
                    "GRANT EXECUTE ON ALL ROUTINES IN SCHEMA public TO PUBLIC",
                    f"DROP OWNED BY {user}",
                    f"DROP ROLE {user}",
                ]
            )
        else:
            rights = "SELECT, INSERT, UPDATE, DELETE" + (", EXECUTE" if execute else "")
            setup = [
                f"CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY '{user}'",
                f"GRANT {rights} ON `{database}`.* TO '{user}'@'127.0.0.1'",
            ]
            teardown.append(f"DROP USER '{user}'@'127.0.0.1'")
        with connection.cursor() as cursor:
            for sql in setup:
                cursor.execute(sql)
        connection.close()
        connection.settings_dict.update(USER=user, PASSWORD=user)

    yield connect_as
    connection.close()
    connection.settings_dict.update(owner)
    with connection.cursor() as cursor:
        for sql in teardown:
            cursor.execute(sql)


def test_a_user_who_may_not_run_the_routines_is_told_the_grant(make_semaphore, app_user):
    name = make_semaphore(capacity=1).name
    app_user(execute=False)
    with pytest.raises(MissingPrivilege, match="GRANT EXECUTE"):
        acquire(name, external_id="k")


def test_a_statement_timeout_is_lock_contention(make_semaphore, settings):
    """The server's bound on statements (PostgreSQL ``statement_timeout``,
    MariaDB ``max_statement_time``) cuts a wait for the row short: retried
    as contention, then ``LockContention`` naming it."""
    settings.DJANGO_SEMAPHORE = {"RETRY_ATTEMPTS": 2, "LOCK_WAIT_TIMEOUT": 5}
    name = make_semaphore(capacity=1).name
    bound = (
        "SET statement_timeout = '50ms'"
        if connection.vendor == "postgresql"
        else "SET SESSION max_statement_time = 0.05"
    )
    with connection.cursor() as cursor:
        cursor.execute(bound)
    try:
        with row_locked_elsewhere(name), pytest.raises(LockContention, match="statement"):
            acquire(name, external_id="k")
    finally:
        connection.close()


def test_a_user_without_create_routine_migrates_and_is_served(
    fresh_routines, make_semaphore, app_user, caplog
):
    """MariaDB: the migration skips its routines with a warning naming the
    GRANT; the app grants the general way, and ``check --database`` says so."""
    if connection.vendor != "mysql":
        pytest.skip("PostgreSQL's CREATE on the schema covers tables and routines alike")
    name = make_semaphore(capacity=1).name
    call_command("migrate", "django_semaphore", BEFORE_ROUTINES, verbosity=0)
    app_user(execute=True)
    with caplog.at_level(logging.WARNING, logger="django_semaphore"):
        call_command("migrate", "django_semaphore", NEWEST, verbosity=0)
    assert "GRANT CREATE ROUTINE" in caplog.text
    assert [w.id for w in checks.check_routines(databases=["default"])] == ["django_semaphore.W021"]
    acquire(name, external_id="k")
    assert release("k") is ReleaseOutcome.RELEASED
