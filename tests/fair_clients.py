"""Spawned clients of the fair-mode tests, and what they record."""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

from django.db import connections, transaction

from django_semaphore import acquire, release
from django_semaphore.engine import fairness
from django_semaphore.engine.statements import Statements
from django_semaphore.engine.statements.one_trip import Granted, OneTripStatements, Refused
from django_semaphore.exceptions import SemaphoreExhausted
from tests.children import Outbox


def stream(name: str, stop: Any, errors: Outbox) -> None:
    """One-permit requests back to back until ``stop`` (an event) is set: fail
    fast and retry at once, hold 10-50 ms. The traffic that starves a big
    request on a semaphore without a queue."""
    try:
        while not stop.is_set():
            key = uuid.uuid4().hex
            try:
                acquire(name, external_id=key, owner="stream")
            except SemaphoreExhausted:
                time.sleep(random.uniform(0, 0.003))
                continue
            time.sleep(random.uniform(0.01, 0.05))
            release(key)
    except Exception as exc:
        errors.put(f"{type(exc).__name__}: {exc}")
    finally:
        connections.close_all()


def record_tickets(history: Outbox) -> None:
    """Make this process record each ticket it takes, once committed: (key,
    semaphore id, ticket id, the semaphore's fencing counter when it came to
    hold back there (None while it does not), the permits it asks there),
    as the general grant's fair queue or the one-trip refusal took it;
    and each grant's usage, the general grant's and the one-trip grant's:
    (None, semaphore id, fencing token, permits in use once granted, None)."""
    admit = fairness.admit
    count_grant = Statements.count_grant
    grant_in_one_trip = OneTripStatements.grant

    from django_semaphore.models import Semaphore, Ticket

    def recording(connection, cursor, locked, now, lock_wait, ask, standing):
        names, after = admit(connection, cursor, locked, now, lock_wait, ask, standing)
        took = after.ticketed and (not standing.ticketed or after.lacked != standing.lacked)
        if not took:
            return names, after
        ids = dict(
            Ticket.objects.using(connection.alias)
            .filter(external_id=ask.key)
            .values_list("semaphore_id", "id")
        )
        # The counter was read under the row lock this ticket is marked under:
        # every grant with a higher token comes after it holds back.
        rows = [
            (
                "ticket",
                ask.key,
                s.id,
                ids[s.id],
                s.fencing_counter if s.id in after.lacked else None,
                ask.demand.counts[s.name],
            )
            for s in locked
            if s.id in after.lacked - standing.lacked or not standing.ticketed
        ]
        transaction.on_commit(lambda: [history.put(row) for row in rows], using=connection.alias)
        return names, after

    def counting(self, cursor, locked, added, now) -> None:
        count_grant(self, cursor, locked, added, now)
        rows = [
            ("usage", None, s.id, s.fencing_counter + 1, max(s.in_use, 0) + added[s.id], None)
            for s in locked
        ]
        transaction.on_commit(
            lambda: [history.put(row) for row in rows], using=self.connection.alias
        )

    def granting(self, counts, key, *args) -> Granted | Refused | None:
        granted = grant_in_one_trip(self, counts, key, *args)
        if isinstance(granted, Refused):
            # The routine's refusal of one name, its ticket taken under the lock.
            if granted.ticket_taken:
                [(id, name, _)] = granted.lacking
                ticket = Ticket.objects.using(self.connection.alias).get(
                    external_id=key, semaphore_id=id
                )
                history.put(("ticket", key, id, ticket.id, granted.grants, counts[name]))
        elif granted is not None:
            ids = dict(
                Semaphore.objects.using(self.connection.alias)
                .filter(name__in=counts)
                .values_list("name", "id")
            )
            for name, token in granted.fencing_tokens.items():
                history.put(("usage", None, ids[name], token, granted.in_use[name], None))
        return granted

    fairness.admit = recording  # type: ignore[assignment]
    Statements.count_grant = counting  # type: ignore[method-assign]
    OneTripStatements.grant = granting  # type: ignore[method-assign]


def fair_traffic(
    demands: list[dict[str, int]], start: Any, duration: float, history: Outbox, errors: Outbox
) -> None:
    """Waiting acquires of random demands for ``duration`` seconds from when
    every client is ready (``start``, a barrier); records every ticket and
    every grant (key, semaphore id, fencing token)."""
    from django_semaphore.models import Semaphore

    record_tickets(history)
    ids = dict(Semaphore.objects.values_list("name", "id"))
    start.wait(timeout=60)
    stop_at = time.monotonic() + duration
    try:
        while time.monotonic() < stop_at:
            demand = random.choice(demands)
            key = uuid.uuid4().hex
            request = acquire(demand, external_id=key, owner="fifo", timeout=30)
            for name in demand:
                history.put(("grant", key, ids[name], request.token(name), None, None))
            time.sleep(random.uniform(0.005, 0.02))
            release(key)
    except Exception as exc:
        errors.put(f"{type(exc).__name__}: {exc}")
    finally:
        connections.close_all()


def wait_forever(name: str, timeout: float) -> None:
    """A fair waiter that will be killed while it waits."""
    try:
        acquire(name, external_id=f"doomed-{uuid.uuid4().hex}", owner="doomed", timeout=timeout)
    finally:
        connections.close_all()
