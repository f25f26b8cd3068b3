"""Declared settings and the database disagree: migrate and ``check
--database`` say so (a warning, never blocking migrate), and ``manage.py
semaphore_sync`` applies the settings on purpose, a dry run by default."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_semaphore import acquire, checks, release, set_capacity
from django_semaphore.declared import create_declared_semaphores
from django_semaphore.models import CapacityChange, Semaphore
from tests.conftest import unique

pytestmark = pytest.mark.django_db(transaction=True)


def declare(settings: Any, semaphores: dict[str, Any]) -> None:
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": semaphores}


def limits(name: str) -> tuple[int, int | None]:
    return Semaphore.objects.values_list("capacity", "window").get(name=name)


def drift_warnings() -> list[Any]:
    return checks.check_settings_drift(databases=["default"])


def sync(*args: str) -> str:
    out = StringIO()
    call_command("semaphore_sync", *args, stdout=out)
    return out.getvalue()


# Declared at first, then as settings say now; what the messages say; the
# (capacity, window) applied.
CHANGES = [
    pytest.param(3, 10, "settings say 10, the database has 3", (10, None), id="capacity"),
    pytest.param(
        5, {"rate": "5/s"}, "settings say 5/s, the database has 5", (5, 1), id="rate-added"
    ),
    pytest.param(
        {"rate": "5/s"}, 5, "settings say 5, the database has 5/s", (5, None), id="rate-removed"
    ),
    pytest.param(
        {"rate": "5/s"},
        {"capacity": 6, "window": 60},
        "settings say 6/min, the database has 5/s",
        (6, 60),
        id="rate-changed",
    ),
]
ARGS = ("before", "after", "said", "wanted")


@pytest.mark.parametrize(ARGS, CHANGES)
def test_the_database_check_names_each_semaphore_and_both_sides(
    settings, before, after, said, wanted
):
    name = unique()
    declare(settings, {name: before})
    create_declared_semaphores(using="default")
    assert drift_warnings() == []

    declare(settings, {name: after})
    (warning,) = drift_warnings()

    assert warning.id == "django_semaphore.W012"
    assert warning.level < 40  # a warning: migrate is not blocked by it
    assert repr(name) in warning.msg
    assert said in warning.msg
    assert "manage.py semaphore_sync --apply" in warning.hint
    assert checks.check_settings_drift() == []  # only with --database


def test_check_database_prints_it(settings):
    name = unique()
    declare(settings, {name: 3})
    create_declared_semaphores(using="default")
    declare(settings, {name: 10})
    err = StringIO()

    call_command("check", "--database", "default", stderr=err, stdout=StringIO())

    assert "django_semaphore.W012" in err.getvalue()
    assert name in err.getvalue()


def test_a_missing_semaphore_is_not_drift_for_the_check(settings):
    """migrate creates it (and runs the check first): nothing to warn of."""
    declare(settings, {unique(): 3})
    assert drift_warnings() == []


def test_malformed_settings_leave_it_to_the_settings_check(settings):
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": {"x": -1}}
    assert drift_warnings() == []


def test_migrate_leaves_the_capacity_alone_and_says_so(settings):
    name = unique()
    declare(settings, {name: 3})
    create_declared_semaphores(using="default")
    declare(settings, {name: {"rate": "10/s"}})
    out = StringIO()

    call_command("migrate", verbosity=1, stdout=out, interactive=False)

    assert limits(name) == (3, None)
    assert f"{name!r} on 'default': settings say 10/s, the database has 3" in out.getvalue()
    assert "manage.py semaphore_sync --apply" in out.getvalue()
    quiet = StringIO()
    call_command("migrate", verbosity=0, stdout=quiet, interactive=False)
    assert name not in quiet.getvalue()


# --- manage.py semaphore_sync ------------------------------------------------------------------


@pytest.mark.parametrize(ARGS, CHANGES)
def test_sync_is_a_dry_run_by_default(settings, before, after, said, wanted):
    name = unique()
    declare(settings, {name: before})
    create_declared_semaphores(using="default")
    stored = limits(name)
    declare(settings, {name: after})

    out = sync()

    assert "would change" in out
    assert said.split("settings say ")[1].split(",")[0] in out
    assert "--apply" in out
    assert limits(name) == stored
    assert not CapacityChange.objects.filter(semaphore__name=name).exists()


@pytest.mark.parametrize(ARGS, CHANGES)
def test_sync_apply_changes_through_the_audited_door(settings, before, after, said, wanted):
    name = unique()
    declare(settings, {name: before})
    create_declared_semaphores(using="default")
    declare(settings, {name: after})

    out = sync("--apply")

    assert "changed" in out
    assert limits(name) == wanted
    reasons = set(CapacityChange.objects.filter(semaphore__name=name).values_list("reason"))
    assert reasons == {("settings",)}
    assert drift_warnings() == []
    assert "nothing to do" in sync("--apply")


def test_sync_creates_missing_ones_only_with_apply(settings):
    name = unique()
    declare(settings, {name: {"rate": "3/m"}})

    assert "missing, would be created with 3/min" in sync()
    assert not Semaphore.objects.filter(name=name).exists()
    assert "missing, created" in sync("--apply")
    assert limits(name) == (3, 60)


def test_sync_records_the_reason_given(settings):
    name = unique()
    declare(settings, {name: 3})
    create_declared_semaphores(using="default")
    declare(settings, {name: 4})

    sync("--apply", "--reason", "deploy 42")

    (change,) = CapacityChange.objects.filter(semaphore__name=name)
    assert (change.old_capacity, change.new_capacity, change.reason) == (
        3,
        4,
        "settings: deploy 42",
    )


def test_sync_of_a_family_changes_its_default_and_the_members_that_follow_it(settings):
    pattern = f"{unique()}:*"
    following, own = pattern.replace("*", "a"), pattern.replace("*", "b")
    declare(settings, {pattern: 2})
    create_declared_semaphores(using="default")
    for name in (following, own):
        release(acquire(name, external_id=unique("key")).external_id)  # created on first use
    set_capacity(own, 7)
    declare(settings, {pattern: 4})

    out = sync("--apply")

    assert f"{pattern!r} on 'default': 2 -> 4 (changed)" in out
    assert (limits(pattern), limits(following), limits(own)) == ((4, None), (4, None), (7, None))
    assert [w.msg for w in drift_warnings()] == []


def test_sync_refuses_malformed_settings(settings):
    settings.DJANGO_SEMAPHORE = {"SEMAPHORES": {"x": {"rate": "often"}}}
    with pytest.raises(CommandError, match="rate"):
        sync()


def test_sync_with_nothing_declared_or_nothing_to_change(settings):
    settings.DJANGO_SEMAPHORE = {}
    assert "nothing to do" in sync()
