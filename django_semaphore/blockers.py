"""Why a waiter waits: for each semaphore of its demand, whether it lacks
room there, who holds that room (and since when), which older waiters keep
some of it, and, on a rate limit, when the next slot opens.

A waiter here is one that holds tickets (``Ticket``): a waiting call, whose
ticket's key is its acquire's key, or a parked task (its key, or its task
id). Every read is a short, indexed query, with no
lock taken: the answer is a snapshot, a moment old when it is shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Count, Sum
from django.db.models.functions import Coalesce

from django_semaphore import routing
from django_semaphore.backends import DatabaseNow
from django_semaphore.engine.line import fits, room
from django_semaphore.limits import Limit
from django_semaphore.models import ParkedTask, Permit, Semaphore, Ticket
from django_semaphore.models.parked import SENDING
from django_semaphore.states import State

# Holders and older waiters named on each semaphore; the rest are counted.
NAMED = 5


@dataclass(frozen=True)
class Holder:
    """A request holding permits on the semaphore."""

    key: str
    owner: str
    count: int
    since: datetime
    expires_at: datetime | None


def room_for(in_use: int, capacity: int, kept: int) -> int:
    """What is free for a waiter, by the grant's rule: neither in use nor
    kept for the older waiters that lacked room (0 when over capacity)."""
    return max(0, room(in_use, capacity, kept))


@dataclass(frozen=True)
class Blocker:
    """One semaphore of the waiter's demand, as it stands."""

    semaphore: str
    wants: int
    limit: Limit
    in_use: int
    kept: int  # permits the waiters ahead of it that lacked room keep from it
    older: int  # how many such waiters there are
    older_named: list[str]  # the first of them (their waiter)
    holders: list[Holder]  # the first of them, oldest first
    held_by: int  # how many requests hold permits here
    next_slot: datetime | None  # a rate limit's: when its oldest counted grant stops counting
    by_priority: int = 0  # of the waiters ahead, those that came after it, of a higher priority
    # The share keys of the waiters ahead, and how many of each: most first.
    by_share: list[tuple[str, int]] = field(default_factory=list)

    @property
    def room(self) -> int:
        """What is free for this waiter: not in use, not kept for older waiters."""
        return room_for(self.in_use, self.limit.capacity, self.kept)

    @property
    def lacks_room(self) -> bool:
        """Whether this semaphore keeps the waiter waiting."""
        return not fits(self.in_use, self.wants, self.limit.capacity, self.kept)

    def explained(self) -> list[str]:
        """In words, as the status command and the admin show it: a summary,
        then the older waiters, the holders and a rate limit's next slot."""
        verdict = "lacks room" if self.lacks_room else "has room"
        lines = [
            f"{self.semaphore}: {verdict}: wants {self.wants}, {self.in_use} of {self.limit} "
            f"in use, {self.kept} kept for {self.older} waiter(s) ahead"
            + (f" ({self.by_priority} by priority)" if self.by_priority else "")
            + f", {self.room} free for it"
        ]
        if self.older_named:
            more = self.older - len(self.older_named)
            named = ", ".join(self.older_named) + (f" and {more} more" if more else "")
            lines.append(f"waiters ahead: {named}")
        if self.by_share:
            shares = ", ".join(f"share {share!r}: {n}" for share, n in self.by_share)
            lines.append(f"ahead by share key: {shares}")
        for holder in self.holders:
            until = "never" if holder.expires_at is None else _moment(holder.expires_at)
            lines.append(
                f"held by {holder.owner or '-'} ({holder.key}): {holder.count} since "
                f"{_moment(holder.since)}, lease until {until}"
            )
        if self.held_by > len(self.holders):
            lines.append(f"and {self.held_by - len(self.holders)} more holders")
        if self.next_slot is not None:
            lines.append(f"next slot: {_moment(self.next_slot)}")
        return lines


@dataclass(frozen=True)
class Waiting:
    """A waiter and what keeps it waiting."""

    key: str
    waiter: str  # a waiter's owner, or "parked <task name>"
    task_id: str  # the parked task's id; "" for a waiter
    since: datetime
    # When its place lapses: a waiter's lease (renewed while it
    # waits), a parked task's expiry.
    expires_at: datetime
    woken: bool  # a parked task woken and on its way to run
    blockers: list[Blocker]
    priority: int = 0  # where it stands in line (``engine/line.py``)
    share: str = ""  # its share key ("": none)
    not_before: datetime | None = None  # a debounced send waits until then
    sending: bool = False  # its sender's transaction has not committed yet

    def explained(self) -> list[str]:
        """In words, as ``semaphore_status --why`` says it: who waits, since
        and until when, then each semaphore (``Blocker.explained``)."""
        lines = [
            f"{self.key} waits: {self.waiter or '-'}, since {_moment(self.since)}, "
            f"expires at {_moment(self.expires_at)}"
            + (f", priority {self.priority}" if self.priority else "")
            + (f", share {self.share!r}" if self.share else "")
        ]
        if self.woken:
            lines.append("  Woken: room is kept for it until its run takes it.")
        if self.sending:
            lines.append("  Being sent: its sender's transaction has not committed yet.")
        elif self.not_before is not None:
            lines.append(f"  Debounced: not woken before {_moment(self.not_before)}.")
        for blocker in self.blockers:
            summary, *details = blocker.explained()
            lines += [f"  {summary}", *(f"    {line}" for line in details)]
        return lines

    @property
    def lacking(self) -> list[Blocker]:
        """The semaphores that keep it waiting: none once a wake-up or a
        release made room everywhere, and its run has yet to take it."""
        return [blocker for blocker in self.blockers if blocker.lacks_room]


def _moment(at: datetime) -> str:
    return at.isoformat(timespec="seconds")


def why_waiting(key: str) -> Waiting | None:
    """What the waiter under ``key`` (a ticket's key, or a parked task's
    id) waits for; ``None`` when nobody waits under it."""
    for alias in routing.aliases():
        # ``key``, or the key of the task parked under the task id ``key``.
        parked = ParkedTask.objects.using(alias).filter(task_id=key).values_list("key", flat=True)
        tickets = list(
            Ticket.objects.using(alias)
            .filter(external_id=next(iter(parked), None) or key, expires_at__gt=DatabaseNow())
            .select_related("parked")
        )
        if tickets:
            return _waiting(alias, tickets)
    return None


def _waiting(alias: str, tickets: list[Ticket]) -> Waiting:
    # Read apart: the manager's ``in_use`` is an annotation a join would lack.
    semaphores = Semaphore.objects.using(alias).in_bulk([t.semaphore_id for t in tickets])
    first = tickets[0]
    parked = first.parked
    return Waiting(
        key=first.external_id,
        waiter=first.waiter,
        task_id=parked.task_id if parked is not None else "",
        since=min(ticket.created_at for ticket in tickets),
        expires_at=min(ticket.expires_at for ticket in tickets),
        woken=parked is not None and parked.woken_at is not None,
        blockers=sorted(
            (_blocker(alias, ticket, semaphores[ticket.semaphore_id]) for ticket in tickets),
            key=lambda blocker: blocker.semaphore,
        ),
        priority=first.priority,
        share=first.share,
        not_before=parked.not_before if parked is not None else None,
        sending=parked is not None and parked.not_before == SENDING,
    )


def _blocker(alias: str, ticket: Ticket, semaphore: Semaphore) -> Blocker:
    older = (
        Ticket.objects.using(alias)
        .holding_back()
        .filter(semaphore=semaphore)
        .ahead_of(ticket.ranked_at, ticket.pk)
    )
    kept = older.aggregate(n=Count("pk"), kept=Coalesce(Sum("count"), 0))
    permits = Permit.objects.using(alias).filter(semaphore=semaphore)
    held = permits.filter(state=State.ACQUIRED)
    holders = [
        Holder(
            key=permit.request.external_id,
            owner=permit.request.owner,
            count=permit.count,
            since=permit.request.created_at,
            expires_at=permit.request.expires_at,
        )
        for permit in held.select_related("request").order_by("request__created_at", "pk")[:NAMED]
    ]
    slots = permits.counting().values_list("slot_ends", flat=True)
    return Blocker(
        semaphore=semaphore.name,
        wants=ticket.count,
        limit=semaphore.limit,
        in_use=semaphore.in_use,
        kept=kept["kept"],
        older=kept["n"],
        older_named=[t.waiter for t in older.select_related("parked").in_line()[:NAMED]],
        by_priority=older.filter(
            created_at__gt=ticket.created_at, priority__gt=ticket.priority
        ).count(),
        by_share=list(older.per_share()[:NAMED]),
        holders=holders,
        held_by=held.count() if len(holders) == NAMED else len(holders),
        next_slot=slots.first() if semaphore.limit.is_rate else None,
    )
