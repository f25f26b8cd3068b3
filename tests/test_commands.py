"""Management commands: sweep (for cron), status, create, capacity, release."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_semaphore import acquire, release, set_capacity
from django_semaphore.models import CapacityChange, PermitRequest, Semaphore
from django_semaphore.states import ReleaseReason, State
from tests.conftest import ago, unique

pytestmark = pytest.mark.django_db


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_sweep_runs_all_three_by_default(leftovers):
    expired, old = leftovers
    output = run("semaphore_sweep")
    assert "Orphans: released 1 (repaired 0, expired 1, owner_dead 0, stale 0)." in output
    assert "Released requests: deleted 1 and 1 permits in 1 batches." in output
    assert "Capacity history: deleted 1 in 1 batches." in output
    expired.refresh_from_db()
    assert (expired.state, expired.release_reason) == (State.RELEASED, ReleaseReason.EXPIRED)
    assert not PermitRequest.objects.filter(pk=old.pk).exists()
    assert not CapacityChange.objects.exists()


def test_sweep_options_choose_what_runs(leftovers):
    expired, _ = leftovers
    output = run("semaphore_sweep", "--cleanup")
    assert output.splitlines() == ["Released requests: deleted 1 and 1 permits in 1 batches."]
    assert PermitRequest.objects.get(pk=expired.pk).state == State.ACQUIRED
    assert CapacityChange.objects.exists()
    assert run("semaphore_sweep", "--orphans", "--history").splitlines() == [
        "Orphans: released 1 (repaired 0, expired 1, owner_dead 0, stale 0).",
        "Capacity history: deleted 1 in 1 batches.",
    ]


def test_sweep_dry_run_changes_nothing(leftovers):
    output = run("semaphore_sweep", "--dry-run")
    assert output.splitlines() == [
        "Orphans: would release 1 (repaired 0, expired 1, owner_dead 0, stale 0).",
        "Released requests: would delete 1 and 1 permits.",
        "Capacity history: would delete 1.",
    ]
    assert PermitRequest.objects.filter(state=State.ACQUIRED).count() == 1
    assert PermitRequest.objects.count() == 2
    assert CapacityChange.objects.count() == 1


def test_sweep_reports_progress_and_a_spent_time_budget(make_semaphore):
    sem = make_semaphore(capacity=10)
    for _ in range(5):
        key = unique()
        acquire(sem.name, external_id=key)
        release(key)
    PermitRequest.objects.update(released_at=ago(days=8))

    output = run("semaphore_sweep", "--cleanup", "--batch-size=2", "-v", "2")
    assert output.splitlines() == [
        "  ... released requests: 2 deleted so far",
        "  ... released requests: 4 deleted so far",
        "  ... released requests: 5 deleted so far",
        "Released requests: deleted 5 and 5 permits in 3 batches.",
    ]


def test_status_shows_capacity_use_and_holders(make_semaphore):
    busy, idle, over = make_semaphore(capacity=3), make_semaphore(capacity=2), make_semaphore(2)
    acquire({busy.name: 2}, external_id=unique())
    acquire(busy.name, external_id=unique())
    acquire({over.name: 2}, external_id=unique())
    set_capacity(over.name, 1)

    lines = run("semaphore_status", busy.name, idle.name, over.name).splitlines()

    assert lines[0].split() == [
        "name", "capacity", "in", "use", "available", "holders", "waiters", "longest", "wait",
        "parked", "oldest", "parked",
    ]  # fmt: skip
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert rows == {
        busy.name: ["3", "3", "0", "2", "0", "-", "0", "-"],
        idle.name: ["2", "0", "2", "0", "0", "-", "0", "-"],
        over.name: ["1", "2", "0", "(over)", "1", "0", "-", "0", "-"],
    }


def test_status_writes_control_characters_in_names_as_escapes(make_semaphore):
    """A name is any text a caller gave: printed raw, "\\x1b[2J" would clear
    the operator's terminal and a line break forge a row."""
    sem = Semaphore.objects.create(name=unique("\x1b[2J\nfake\t"), capacity=1)
    acquire(sem.name, external_id=unique())

    output = run("semaphore_status", sem.name)

    assert not any(c in output for c in "\x1b\t")
    assert "\\x1b[2J\\nfake\\t" in output
    assert len(output.splitlines()) == 2


def test_status_without_semaphores():
    assert "(no semaphores)" in run("semaphore_status", "no-such-name")


def test_create_then_set_capacity_is_recorded_as_by_command():
    name = unique()
    assert run("semaphore_create", name, "3") == f"Created semaphore {name!r} with capacity 3.\n"
    with pytest.raises(CommandError, match="exists"):
        run("semaphore_create", name, "4")

    assert "capacity 3 -> 5" in run("semaphore_capacity", name, "5", "--reason", "more exports")
    run("semaphore_capacity", name, "2")

    assert Semaphore.objects.get(name=name).capacity == 2
    changes = CapacityChange.objects.filter(semaphore__name=name).order_by("id")
    assert [(c.old_capacity, c.new_capacity, c.reason, c.changed_by) for c in changes] == [
        (3, 5, "by command: more exports", None),
        (5, 2, "by command", None),
    ]


def test_status_shows_a_rate_limits_rate_and_its_grants_in_the_window():
    rated = unique()
    run("semaphore_create", rated, "5/m")
    acquire({rated: 2}, external_id=unique())

    (line,) = [line for line in run("semaphore_status", rated).splitlines() if rated in line]

    assert line.split()[1:4] == ["5/min", "2", "3"]


def test_a_rate_makes_a_rate_limit_and_no_window_a_concurrency_limit_again():
    name, rated = unique(), unique()
    run("semaphore_create", name, "3")
    assert "capacity 5/min" in run("semaphore_create", rated, "5/m")
    assert Semaphore.objects.filter(name=rated, capacity=5, window=60).exists()

    assert "capacity 3 -> 100/s" in run("semaphore_capacity", name, "100/s")
    assert "capacity 100/s -> 4" in run("semaphore_capacity", name, "4", "--no-window")

    changes = CapacityChange.objects.filter(semaphore__name=name).order_by("id")
    # Capacity and window change together: one record each time.
    assert [(c.old_capacity, c.new_capacity, c.old_window, c.new_window) for c in changes] == [
        (3, 100, None, 1),
        (100, 4, 1, None),
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["semaphore_create", "", "3"], "name"),
        (["semaphore_create", "x", "-1"], "apacity"),
        (["semaphore_capacity", "no-such-semaphore", "3"], "no-such-semaphore"),
        (["semaphore_capacity", "x", "5/d"], "rate"),
        (["semaphore_capacity", "x", "five"], "capacity"),
        (["semaphore_create", "x", "5/d"], "rate"),
        (["semaphore_capacity", "x", "5/s", "--no-window"], "window"),
        (["semaphore_capacity", "x", "-1"], "apacity"),
        (["semaphore_capacity", "a\x00b", "3"], "name"),
        (["semaphore_capacity", "x", "3", "--reason", "r" * 300], "reason"),
        (["semaphore_status", "a\x00b"], "name"),
        (["semaphore_status", "--verify", "x" * 256], "name"),
        (["semaphore_release", ""], "external_id"),
        (["semaphore_release", "k\x00"], "external_id"),
    ],
)
def test_bad_arguments_are_command_errors(args, message):
    with pytest.raises(CommandError, match=message):
        run(*args)


def test_release_by_key(make_semaphore):
    sem = make_semaphore(capacity=2)
    held = acquire(sem.name, external_id=unique())
    done = acquire(sem.name, external_id=unique())
    release(done.external_id)

    assert run("semaphore_release", held.external_id, done.external_id).splitlines() == [
        f"{held.external_id}: released",
        f"{done.external_id}: was already released",
    ]
    held.refresh_from_db()
    assert (held.state, held.release_reason) == (State.RELEASED, ReleaseReason.ADMIN)
    with pytest.raises(CommandError, match="no-such-key"):
        run("semaphore_release", "no-such-key")


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--cleanup", "--batch-size", "-3"], "--batch-size"),
        (["--batch-size", "0"], "--batch-size"),
        (["--batch-size", "2.5"], "--batch-size"),
        (["--batch-size", "many"], "--batch-size"),
        (["--time-budget", "-1"], "--time-budget"),
        (["--time-budget", "nan"], "--time-budget"),
        (["--time-budget", "inf"], "--time-budget"),
        (["--history", "--time-budget", "soon"], "--time-budget"),
    ],
)
def test_bad_sweep_options_are_refused_naming_the_option_before_any_sweep(leftovers, args, option):
    expired, old = leftovers
    with pytest.raises(CommandError, match=option):
        run("semaphore_sweep", *args)

    expired.refresh_from_db()
    assert expired.state == State.ACQUIRED
    assert PermitRequest.objects.filter(pk=old.pk).exists()
    assert CapacityChange.objects.exists()


@pytest.mark.parametrize(
    ("options", "name"), [({"batch_size": -3}, "batch_size"), ({"time_budget": -1}, "time_budget")]
)
def test_bad_sweep_options_given_to_call_command_are_refused_too(leftovers, options, name):
    """call_command(batch_size=...) skips argparse's type=: handle() checks again."""
    expired, _ = leftovers
    with pytest.raises(CommandError, match=name):
        call_command("semaphore_sweep", stdout=StringIO(), **options)
    expired.refresh_from_db()
    assert expired.state == State.ACQUIRED


def test_a_zero_time_budget_still_means_no_limit(leftovers):
    assert "deleted 1 and 1 permits" in run("semaphore_sweep", "--cleanup", "--time-budget", "0")
