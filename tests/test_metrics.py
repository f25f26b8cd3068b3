"""The Prometheus integration: real counters after real grants, refusals,
releases, reclaims and retries; the view's exposition parsed back; several
processes counted together in multiprocess mode."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from prometheus_client import REGISTRY
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

import django_semaphore.metrics
from django_semaphore import (
    acquire,
    force_release,
    parking,
    release,
    set_capacity,
    set_window,
    sweep,
)
from django_semaphore.exceptions import AcquireTimeout, SemaphoreExhausted
from django_semaphore.metrics import checks
from django_semaphore.metrics.views import metrics
from django_semaphore.models import Permit, PermitRequest, Semaphore
from django_semaphore.parking.rows import Row
from tests.children import Outbox, join, spawn
from tests.conftest import unique
from tests.metrics_clients import acquire_and_release, scrape
from tests.test_backends import kill_own_connection, row_locked_elsewhere
from tests.test_parked import aged, park_row
from tests.test_sweep import shift

pytestmark = pytest.mark.django_db(transaction=True)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def sample(name: str, **labels: str) -> float:
    """This process's value of a series; 0 if it was never touched."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def parse(exposition: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }


def at(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_grants_refusals_waits_and_holds_are_counted(make_semaphore):
    sem = make_semaphore(capacity=2)
    name = sem.name
    keys = [unique(), unique()]
    for key in keys:
        acquire(sem.name, external_id=key)
    acquire(sem.name, external_id=keys[0])  # an idempotent repeat grants nothing
    with pytest.raises(SemaphoreExhausted):
        acquire(sem.name, external_id=unique())
    with pytest.raises(AcquireTimeout):
        acquire(sem.name, external_id=unique(), timeout=0.3)
    for key in keys:
        release(key)

    assert sample("django_semaphore_grants_total", semaphore=name) == 2
    assert sample("django_semaphore_exhaustions_total", semaphore=name) == 2
    granted = {"semaphore": name, "outcome": "granted"}
    exhausted = {"semaphore": name, "outcome": "exhausted"}
    assert sample("django_semaphore_wait_seconds_count", **granted) == 3
    assert sample("django_semaphore_wait_seconds_count", **exhausted) == 2
    assert sample("django_semaphore_wait_seconds_sum", **exhausted) >= 0.3
    released = {"semaphore": name, "reason": "released"}
    assert sample("django_semaphore_releases_total", **released) == 2
    assert sample("django_semaphore_hold_seconds_count", **released) == 2


def test_reclaims_are_counted_by_release_reason(make_semaphore):
    sem = make_semaphore(capacity=3)
    expired = acquire(sem.name, external_id=unique(), ttl=60)
    shift(expired, expires_at=-timedelta(seconds=1))
    revoked = unique()
    acquire(sem.name, external_id=revoked)

    sweep.release_orphans()
    force_release([revoked])

    for reason in ("expired", "admin"):
        assert sample("django_semaphore_releases_total", semaphore=sem.name, reason=reason) == 1
        assert sample("django_semaphore_hold_seconds_count", semaphore=sem.name, reason=reason) == 1
    assert sample("django_semaphore_releases_total", semaphore=sem.name, reason="released") == 0


def test_retries_are_counted_by_kind(make_semaphore, settings):
    settings.DJANGO_SEMAPHORE = {"LOCK_WAIT_TIMEOUT": 1, "RETRY_ATTEMPTS": 3}
    sem = make_semaphore()
    before = sample("django_semaphore_retries_total", kind="contention")

    # A real row lock held elsewhere past one bounded wait: the grant's first
    # attempt times out (1205 / 55P03 / "database is locked") and is retried.
    with row_locked_elsewhere(sem.name, hold=1.5):
        acquire(sem.name, external_id=unique())

    assert sample("django_semaphore_retries_total", kind="contention") > before


def test_the_view_serves_gauges_from_the_database_and_counters(client, make_semaphore):
    sem = make_semaphore(capacity=3)
    acquire({sem.name: 2}, external_id=unique())
    over = make_semaphore(capacity=2)
    acquire({over.name: 2}, external_id=unique())
    set_capacity(over.name, 1)

    response = client.get("/metrics/")

    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    samples = parse(response.content.decode())
    assert at(samples, "django_semaphore_database_up") == 1
    assert at(samples, "django_semaphore_capacity", semaphore=sem.name) == 3
    assert at(samples, "django_semaphore_in_use", semaphore=sem.name) == 2
    assert at(samples, "django_semaphore_capacity", semaphore=over.name) == 1
    assert at(samples, "django_semaphore_in_use", semaphore=over.name) == 2
    assert at(samples, "django_semaphore_grants_total", semaphore=sem.name) == 1


def test_a_fair_waiter_shows_in_the_gauges_until_granted(client, make_semaphore):
    sem = make_semaphore(capacity=1)
    holder = unique()
    acquire(sem.name, external_id=holder)
    granted = threading.Event()

    def wait_fairly() -> None:
        try:
            acquire(sem.name, external_id=unique(), timeout=30)
            granted.set()
        finally:
            connections.close_all()

    waiter = threading.Thread(daemon=True, target=wait_fairly)
    waiter.start()
    try:
        deadline = time.monotonic() + 10
        while True:
            samples = parse(client.get("/metrics/").content.decode())
            if at(samples, "django_semaphore_waiters", semaphore=sem.name) == 1:
                break
            assert time.monotonic() < deadline, "the waiter's ticket never showed"
            time.sleep(0.05)
        time.sleep(0.3)
        samples = parse(client.get("/metrics/").content.decode())
        assert 0.25 <= at(samples, "django_semaphore_longest_wait_seconds", semaphore=sem.name) < 30
    finally:
        release(holder)
        waiter.join(timeout=60)
    assert granted.is_set()

    samples = parse(client.get("/metrics/").content.decode())
    assert at(samples, "django_semaphore_waiters", semaphore=sem.name) == 0
    assert at(samples, "django_semaphore_longest_wait_seconds", semaphore=sem.name) == 0
    waits = {"semaphore": sem.name, "outcome": "granted"}
    assert at(samples, "django_semaphore_wait_seconds_count", **waits) == 2
    assert at(samples, "django_semaphore_wait_seconds_sum", **waits) >= 0.3


def test_the_view_answers_openmetrics_when_the_scraper_asks(client, make_semaphore):
    sem = make_semaphore(capacity=4)

    response = client.get(
        "/metrics/", headers={"accept": "application/openmetrics-text; version=1.0.0"}
    )

    assert response["Content-Type"].startswith("application/openmetrics-text")
    families = {f.name: f for f in openmetrics_families(response.content.decode())}
    capacity = [s for s in families["django_semaphore_capacity"].samples if s.labels]
    assert {"semaphore": sem.name} in [s.labels for s in capacity]
    assert families["django_semaphore_grants"].type == "counter"


@pytest.mark.django_db(transaction=True, databases=["default", "semaphores"])
def test_an_unreachable_database_is_a_gauge_not_a_failed_scrape(client, make_semaphore):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite is a file in this process: there is no connection to lose.")
    sem = make_semaphore(capacity=2)
    acquire(sem.name, external_id=unique())
    kill_own_connection()

    response = client.get("/metrics/")
    connection.close()  # the test client keeps the request's dead connection

    assert response.status_code == 200
    samples = parse(response.content.decode())
    assert at(samples, "django_semaphore_database_up") == 0
    assert at(samples, "django_semaphore_capacity", semaphore=sem.name) is None
    # The counters of this process are still served.
    assert at(samples, "django_semaphore_grants_total", semaphore=sem.name) == 1


def test_multiprocess_mode_sums_every_process_and_reads_gauges_once(
    make_semaphore, tmp_path, monkeypatch
):
    """Three spawned "workers" acquire and release; a fourth process serves
    the view, as one gunicorn worker answers a scrape for all of them."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    sem = make_semaphore(capacity=2)

    join([spawn(acquire_and_release, sem.name, 4, bound=120) for _ in range(3)], within=130)
    results = Outbox.create()
    join([spawn(scrape, results, bound=120)], within=130)
    [exposition] = results.items()

    samples = parse(exposition)
    assert at(samples, "django_semaphore_grants_total", semaphore=sem.name) == 12
    released = {"semaphore": sem.name, "reason": "released"}
    assert at(samples, "django_semaphore_releases_total", **released) == 12
    assert at(samples, "django_semaphore_hold_seconds_count", **released) == 12
    # Read from the database by the serving process: one series, not one per process.
    assert at(samples, "django_semaphore_capacity", semaphore=sem.name) == 2
    assert at(samples, "django_semaphore_in_use", semaphore=sem.name) == 0
    assert at(samples, "django_semaphore_database_up") == 1


@pytest.mark.once
def test_the_check_reports_a_missing_prometheus_client(monkeypatch):
    assert checks.check_prometheus_client() == []
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed

    errors = checks.check_prometheus_client()

    assert [error.id for error in errors] == ["django_semaphore_metrics.E001"]
    assert "django-semaphore[metrics]" in errors[0].hint


@pytest.mark.once
def test_without_prometheus_client_the_project_loads_and_the_check_says_why():
    """Both apps import, the URLconf with the view mounted loads, and
    ``manage.py check`` fails with the metrics app's error, not a traceback."""
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import django; django.setup()\n"
        "from django.urls import reverse; print(reverse('django_semaphore_metrics:metrics'))\n"
        "from django.core.management import call_command; call_command('check')\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )

    assert result.stdout.strip() == "/metrics/"
    assert result.returncode != 0
    assert "django_semaphore_metrics.E001" in result.stderr
    assert "Traceback" not in result.stderr.split("SystemCheckError")[-1]


def test_the_view_says_what_is_missing(rf, monkeypatch):
    # As if prometheus_client were missing: the view's import of it fails.
    monkeypatch.delattr(django_semaphore.metrics, "exposition", raising=False)
    monkeypatch.setitem(sys.modules, "django_semaphore.metrics.exposition", None)
    with pytest.raises(ImproperlyConfigured, match="prometheus_client"):
        metrics(rf.get("/metrics/"))

    monkeypatch.setattr(apps, "is_installed", lambda name: name != "django_semaphore.metrics")
    with pytest.raises(ImproperlyConfigured, match="INSTALLED_APPS"):
        metrics(rf.get("/metrics/"))


# --- families: one series per family unless named in METRICS_PER_MEMBER ------------


@pytest.fixture
def family(settings) -> str:
    """A family ``<prefix>:*`` of capacity 2 and a declared ``<prefix>:vip``
    that its pattern also matches; returns the pattern."""
    prefix = unique("fam")
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": {f"{prefix}:vip": 5, f"{prefix}:*": 2}}
    Semaphore.objects.create(name=f"{prefix}:vip", capacity=5)
    return f"{prefix}:*"


def member(pattern: str, key: str) -> str:
    return pattern.replace("*", key)


def use_family(pattern: str) -> None:
    """Member a holds 2 (full), b holds 1 with a task parked 60 s ago, c a
    task parked 30 s ago; the declared vip holds 1; a refusal on a."""
    a, b, c = (member(pattern, key) for key in "abc")
    acquire({a: 2}, external_id=unique())
    acquire(b, external_id=unique())
    acquire(c, external_id=unique())  # created, then free again
    release_all_of(c)
    acquire(member(pattern, "vip"), external_id=unique())
    with pytest.raises(SemaphoreExhausted):
        acquire(a, external_id=unique())
    aged(park_row({b: 1}), 60)
    aged(park_row({c: 1}), 30)


def release_all_of(name: str) -> None:
    held = PermitRequest.objects.filter(permits__semaphore__name=name, state="ACQUIRED")
    for external_id in held.values_list("external_id", flat=True):
        release(external_id)


def test_a_familys_members_are_one_series_labelled_with_its_pattern(client, family):
    use_family(family)

    samples = parse(client.get("/metrics/").content.decode())

    labels = {dict(labels).get("semaphore") for _, labels in samples} - {None}
    assert not {label for label in labels if label.startswith(family[:-1])} - {
        family,
        member(family, "vip"),
    }
    # Capacity, in use and parked add up over the three members (the family's
    # default row adds none); the oldest parked is the worst of them.
    assert at(samples, "django_semaphore_capacity", semaphore=family) == 6
    assert at(samples, "django_semaphore_in_use", semaphore=family) == 3
    assert at(samples, "django_semaphore_parked_tasks", semaphore=family) == 2
    assert 60 <= at(samples, "django_semaphore_oldest_parked_seconds", semaphore=family) < 120
    assert at(samples, "django_semaphore_grants_total", semaphore=family) == 3
    assert at(samples, "django_semaphore_exhaustions_total", semaphore=family) == 1
    released = {"semaphore": family, "reason": "released"}
    assert at(samples, "django_semaphore_releases_total", **released) == 1
    # A name declared on its own keeps its own series.
    vip = member(family, "vip")
    assert at(samples, "django_semaphore_capacity", semaphore=vip) == 5
    assert at(samples, "django_semaphore_grants_total", semaphore=vip) == 1


def test_a_family_named_in_metrics_per_member_has_a_series_per_member(client, family, settings):
    settings.DJANGO_SEMAPHORE = {**settings.DJANGO_SEMAPHORE, "METRICS_PER_MEMBER": [family]}
    use_family(family)

    samples = parse(client.get("/metrics/").content.decode())

    a, b = member(family, "a"), member(family, "b")
    assert at(samples, "django_semaphore_in_use", semaphore=a) == 2
    assert at(samples, "django_semaphore_in_use", semaphore=b) == 1
    assert 60 <= at(samples, "django_semaphore_oldest_parked_seconds", semaphore=b) < 120
    assert at(samples, "django_semaphore_grants_total", semaphore=a) == 1
    assert at(samples, "django_semaphore_exhaustions_total", semaphore=a) == 1
    # The family's default row is reported as it always was: nothing in use.
    assert at(samples, "django_semaphore_in_use", semaphore=family) == 0
    assert at(samples, "django_semaphore_grants_total", semaphore=family) is None


def test_a_scrape_reads_no_permit_only_what_it_reports(client, family):
    use_family(family)

    with CaptureQueriesContext(connections["default"]) as queries:
        client.get("/metrics/")

    permit = Permit._meta.db_table
    (read,) = [q["sql"] for q in queries if permit in q["sql"]]
    # Permits are read only where a rate limit's in-use is its grants in the
    # window (the slots not closed yet: two ranges of the (semaphore,
    # slot_ends) index, one chosen); never the held permits (no holders'
    # subquery, which would filter on their state).
    reads = read.split(f"FROM {connections['default'].ops.quote_name(permit)}")[1:]
    assert len(reads) == 2
    wheres = [after.partition("GROUP BY")[0] for after in reads]
    assert all("slot_ends" in where for where in wheres)
    assert all("state" not in where for where in wheres)


def test_waiters_per_share_key_are_a_gauge_by_the_keys_the_weights_name(
    client, make_semaphore, settings
):
    """A key SHARE_WEIGHTS names is its own series; any other key is
    "other" (a key per customer grows no series per customer)."""
    settings.DJANGO_SEMAPHORE = {"SHARE_WEIGHTS": {"gold": 2}}
    sem = make_semaphore(capacity=1)
    acquire(sem.name, external_id=unique())
    for share in ("gold", "gold", "7", "8", ""):
        task_id = unique("task")
        row = Row(task_id, task_id, "tests.parked", b"{}", "application/json", "utf-8", None)
        parked = dataclasses.replace(row, share=share)
        parking._insert(connections["default"], parked, {sem.name: 1}, None)

    samples = parse(client.get("/metrics/").content.decode())
    per_share = "django_semaphore_waiters_per_share"
    assert at(samples, per_share, semaphore=sem.name, share="gold") == 2
    assert at(samples, per_share, semaphore=sem.name, share="other") == 2
    assert at(samples, per_share, semaphore=sem.name, share="") is None


def test_a_rate_limits_window_is_a_gauge_beside_its_grants_in_the_window(client, make_semaphore):
    rate_limit, plain = make_semaphore(capacity=5), make_semaphore(capacity=2)
    set_window(rate_limit.name, 60)
    release(acquire({rate_limit.name: 2}, external_id=unique()).external_id)
    acquire(plain.name, external_id=unique())

    samples = parse(client.get("/metrics/").content.decode())

    assert at(samples, "django_semaphore_window_seconds", semaphore=rate_limit.name) == 60
    assert (
        at(samples, "django_semaphore_in_use", semaphore=rate_limit.name) == 2
    )  # released, in its window
    assert at(samples, "django_semaphore_capacity", semaphore=rate_limit.name) == 5
    assert at(samples, "django_semaphore_window_seconds", semaphore=plain.name) == 0
