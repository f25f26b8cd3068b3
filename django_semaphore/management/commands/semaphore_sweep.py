"""``manage.py semaphore_sweep``: the beat tasks' sweeps, for cron."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_semaphore import sweep


class Command(BaseCommand):
    help = (
        "Release orphaned permits (expired, stale, dead owners; repair half-released; "
        "delete dead fair-mode tickets) "
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
        parser.add_argument("--dry-run", action="store_true", help="Count only; change nothing.")
        parser.add_argument(
            "--batch-size",
            type=int,
            default=None,
            help="Rows per transaction (CLEANUP_BATCH_SIZE).",
        )
        parser.add_argument(
            "--time-budget",
            type=float,
            default=sweep.DEFAULT_TIME_BUDGET,
            help="Seconds after which a clean-up starts no new batch (0: no limit; "
            f"default {sweep.DEFAULT_TIME_BUDGET:g}).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        self.verbosity = int(options["verbosity"])
        everything = not (options["orphans"] or options["cleanup"] or options["history"])
        dry_run, size = options["dry_run"], options["batch_size"]
        budget = options["time_budget"] or None
        if options["orphans"] or everything:
            self.stdout.write(str(sweep.release_orphans(batch_size=size, dry_run=dry_run)))
            tickets = sweep.clean_tickets(batch_size=size, dry_run=dry_run)
            if tickets.deleted:  # rarely any: granted waiters delete their own
                self.stdout.write(str(tickets))
        if options["cleanup"] or everything:
            report = sweep.clean_released(
                batch_size=size, time_budget=budget, dry_run=dry_run, progress=self._progress
            )
            self.stdout.write(str(report))
            members = sweep.clean_idle_members(
                batch_size=size, time_budget=budget, dry_run=dry_run, progress=self._progress
            )
            if members.deleted:  # as for tickets: a line only when there were some
                self.stdout.write(str(members))
        if options["history"] or everything:
            report = sweep.clean_history(
                batch_size=size, time_budget=budget, dry_run=dry_run, progress=self._progress
            )
            self.stdout.write(str(report))

    def _progress(self, report: sweep.CleanupReport) -> None:
        if self.verbosity >= 2 or (self.verbosity >= 1 and report.batches % 100 == 0):
            self.stdout.write(f"  ... {report.what}: {report.deleted} deleted so far")
