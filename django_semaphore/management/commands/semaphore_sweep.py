"""``manage.py semaphore_sweep``: the beat tasks' sweeps, for cron."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_semaphore import sweep
from django_semaphore.exceptions import InvalidRequest
from django_semaphore.validation import validate_batch_size, validate_time_budget

T = TypeVar("T")


def batch_size(text: str) -> int | None:
    """``--batch-size``: an int of at least 1, as ``sweep`` takes it."""
    return _checked(validate_batch_size, int(text))


def time_budget(text: str) -> float | None:
    """``--time-budget``: seconds, 0 or more (0: no limit)."""
    return _checked(validate_time_budget, float(text))


def _checked(validate: Callable[[Any], T], value: Any) -> T:
    """``value`` checked as the sweep functions check it. argparse names the
    option in its error (from call_command, a CommandError): here with the
    validator's words, and for text that does not parse as "invalid
    batch_size value: 'many'"."""
    try:
        return validate(value)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Command(BaseCommand):
    help = (
        "Release orphaned permits (expired, stale, dead owners; repair half-released; "
        "delete dead waiters' tickets) "
        "and delete old released requests and capacity history. With no option, all three."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--orphans", action="store_true", help="Release orphaned requests.")
        parser.add_argument(
            "--cleanup",
            action="store_true",
            help="Delete requests past RELEASED_RETENTION and family members idle past "
            "MEMBER_IDLE_LIMIT.",
        )
        parser.add_argument(
            "--history", action="store_true", help="Delete capacity history past HISTORY_RETENTION."
        )
        parser.add_argument(
            "--parked",
            action="store_true",
            help="Wake the parked tasks that fit, publish again the wake-ups overdue, drop "
            "expired ones: the wake_parked beat task, for a project without Celery beat. "
            "Only when asked for; no dry run.",
        )
        parser.add_argument("--dry-run", action="store_true", help="Count only; change nothing.")
        parser.add_argument(
            "--batch-size",
            type=batch_size,
            help="Rows per transaction, at least 1 (CLEANUP_BATCH_SIZE).",
        )
        parser.add_argument(
            "--time-budget",
            type=time_budget,
            default=sweep.DEFAULT_TIME_BUDGET,
            help="Seconds, 0 or more, after which a clean-up starts no new batch (0: no limit; "
            f"default {sweep.DEFAULT_TIME_BUDGET:g}).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        self.verbosity = int(options["verbosity"])
        everything = not any(options[name] for name in ("orphans", "cleanup", "history", "parked"))
        try:  # again: call_command(batch_size=...) does not go through argparse
            size = validate_batch_size(options["batch_size"])
            budget = validate_time_budget(options["time_budget"]) or None
        except InvalidRequest as exc:
            raise CommandError(str(exc)) from exc
        dry_run = options["dry_run"]
        if options["parked"]:
            if dry_run:
                raise CommandError("--parked has no dry run: it wakes what fits.")
            self.stdout.write(str(sweep.sweep_parked()))
        if options["orphans"] or everything:
            self.stdout.write(str(sweep.release_orphans(batch_size=size, dry_run=dry_run)))
            tickets = sweep.clean_tickets(batch_size=size, dry_run=dry_run)
            if tickets.deleted:  # rarely any: granted waiters delete their own
                self.stdout.write(str(tickets))
        limits: dict[str, Any] = {"batch_size": size, "time_budget": budget, "dry_run": dry_run}
        if options["cleanup"] or everything:
            self.stdout.write(str(sweep.clean_released(**limits, progress=self._progress)))
            members = sweep.clean_idle_members(**limits, progress=self._progress)
            if members.deleted:  # as for tickets: a line only when there were some
                self.stdout.write(str(members))
        if options["history"] or everything:
            self.stdout.write(str(sweep.clean_history(**limits, progress=self._progress)))

    def _progress(self, report: sweep.CleanupReport) -> None:
        if self.verbosity >= 2 or (self.verbosity >= 1 and report.batches % 100 == 0):
            self.stdout.write(f"  ... {report.what}: {report.deleted} deleted so far")
