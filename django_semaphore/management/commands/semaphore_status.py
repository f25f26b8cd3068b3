"""``manage.py semaphore_status``: every semaphore's capacity, use, holders,
waiters and parked tasks, then the line of each semaphore that callers wait on.
``--verify`` first checks every in-use counter against the permits it counts
(``sweep.verify_counters``), corrects any difference and reports it.
``--why KEY`` says why one waiter waits instead (``blockers.why_waiting``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import QuerySet

from django_semaphore import parking, routing, sweep
from django_semaphore.blockers import why_waiting
from django_semaphore.exceptions import InvalidRequest
from django_semaphore.models import Semaphore, Ticket
from django_semaphore.validation import validate_keys

QUEUE_SHOWN = 20
# The semaphores' table: each column's header, and its cell of a semaphore
# (annotated by with_usage() and with_parked()).
COLUMNS: tuple[tuple[str, Callable[[Any], str]], ...] = (
    ("name", lambda s: s.name),
    ("capacity", lambda s: str(s.limit)),
    ("in use", lambda s: str(s.in_use)),
    ("available", lambda s: str(s.capacity - s.in_use) if s.in_use <= s.capacity else "0 (over)"),
    ("holders", lambda s: str(s.holders)),
    ("waiters", lambda s: str(s.waiters)),
    ("longest wait", lambda s: _seconds(s.longest_wait)),
    ("parked", lambda s: str(s.parked)),
    ("oldest parked", lambda s: _seconds(s.oldest_parked)),
)


class Command(BaseCommand):
    help = (
        "Show each semaphore: capacity (a rate limit's rate), in use (its grants in "
        "the window), available, holders, waiters, the "
        "longest wait, parked tasks and how long the first of them has waited; then "
        "who waits in line on each."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("names", nargs="*", help="Only these semaphores.")
        parser.add_argument(
            "--verify",
            action="store_true",
            help="First recount what each semaphore holds under its row lock; correct "
            "and report any in-use counter that differs (a bug: please report it).",
        )
        parser.add_argument(
            "--why",
            metavar="KEY",
            help="Only say why the waiter under KEY waits (a waiter's key, a parked "
            "task's id): which semaphore lacks room, who holds it and since when, which "
            "older waiters keep some, and a rate limit's next slot.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            names = validate_keys(options["names"], "semaphore name")
        except InvalidRequest as exc:
            raise CommandError(str(exc)) from exc
        if options["why"] is not None:
            self._why(options["why"])
            return
        if options["verify"]:
            self._verify(names or None)
        # Every alias holding semaphores (sharded by name: see routing.py).
        found = [s for alias in routing.aliases() for s in self._semaphores(alias, names)]
        semaphores = sorted(found, key=lambda s: s.name)
        headers = tuple(header for header, _ in COLUMNS)
        self._table([headers, *(tuple(cell(s) for _, cell in COLUMNS) for s in semaphores)])
        if not semaphores:
            self.stdout.write("(no semaphores)")
        for semaphore in semaphores:
            if semaphore.waiters or semaphore.parked:  # type: ignore[attr-defined]
                self._queue(semaphore)

    def _verify(self, names: list[str] | None) -> None:
        drifts = sweep.verify_counters(names)
        for drift in drifts:
            self.stderr.write(self.style.ERROR(f"Corrected in-use counter drift: {drift}."))
        if not drifts:
            self.stdout.write(self.style.SUCCESS("Every in-use counter is exact."))

    def _why(self, key: str) -> None:
        waiting = why_waiting(key)
        if waiting is None:
            raise CommandError(f"Nobody waits under {key!r} (a waiter's key, a parked task's id).")
        for line in waiting.explained():
            self.stdout.write(line)

    def _queue(self, semaphore: Semaphore) -> None:
        # Live tickets, in their places in line.
        tickets = (
            Ticket.objects.using(semaphore._state.db)
            .live()
            .filter(semaphore=semaphore)
            .select_related("parked")
            .in_line()
        )
        self.stdout.write(f"\nWaiting in line on {_shown(semaphore.name)}, first served first:")
        rows = [
            ("place", "owner", "key", "count", "waiting since", "expires at", "priority", "share")
        ]
        rows += [
            (
                str(place),
                ticket.waiter or "-",
                ticket.external_id,
                str(ticket.count),
                ticket.created_at.isoformat(timespec="seconds"),
                ticket.expires_at.isoformat(timespec="seconds"),
                str(ticket.priority),
                ticket.share or "-",
            )
            for place, ticket in enumerate(tickets[:QUEUE_SHOWN], start=1)
        ]
        self._table(rows)
        if shares := tickets.per_share()[:QUEUE_SHOWN]:
            counted = ", ".join(f"{_shown(share)} {n}" for share, n in shares)
            self.stdout.write(f"Waiting by share key, most first: {counted}")

    def _table(self, rows: Sequence[tuple[str, ...]]) -> None:
        rows = [tuple(map(_shown, row)) for row in rows]
        widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
        for first, *rest in rows:
            cells = [first.ljust(widths[0])]
            cells += [cell.rjust(width) for cell, width in zip(rest, widths[1:], strict=True)]
            self.stdout.write("  ".join(cells).rstrip())

    def _semaphores(self, alias: str, names: list[str]) -> QuerySet[Semaphore]:
        semaphores = parking.with_parked(Semaphore.objects.db_manager(alias).with_usage())
        return semaphores.filter(name__in=names) if names else semaphores


def _seconds(wait: timedelta | None) -> str:
    return "-" if wait is None else f"{wait.total_seconds():.1f}s"


def _shown(text: str) -> str:
    """``text`` with what a terminal would act on (escape sequences, line
    breaks) written as escapes: names, keys and owners come from callers."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
