"""The independent checker: reads the clients' histories and the database's
own audit trail (triggers) and verifies, without trusting the app:

- **over-grants**: per semaphore, replaying committed permit inserts and
  releases in audit order (the database's timeline), the permits held never
  exceed capacity; and on the clients' timeline (one monotonic clock), the
  holders that believed they held at once never exceed capacity, except
  where a holder's grant had been reclaimed by its TTL meanwhile (flagged
  separately: that is what TTLs and fencing are for);
- **tokens**: per semaphore, fencing tokens strictly increase in commit order,
  and every client was told the tokens the database stored;
- **duplicate grants**: one request insert per key, one permit per request and
  semaphore, and every answer for a key names the same request;
- **half-grants**: every committed request has exactly the permits its
  client asked for, written by one session; nothing is left half-released;
- **raw driver errors**: no client ever saw an exception that is not a
  ``django_semaphore.exceptions`` error;
- **lost acknowledgements**: every grant a client was told about exists;
- **leaks**: after the clients are gone and one sweep ran, nothing is held;
- **fencing**: the guarded resource accepted tokens in non-decreasing order.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.faults import db
from benchmarks.faults.history import read

RECLAIMED = {"expired", "owner_dead", "stale", "admin"}


def held(url: str) -> dict[str, int]:
    with db.cursor(url) as cur:
        cur.execute("SELECT COUNT(*) FROM django_semaphore_permitrequest WHERE state = 'ACQUIRED'")
        requests = cur.fetchone()[0]
        cur.execute("SELECT COUNT(*) FROM django_semaphore_permit WHERE state = 'ACQUIRED'")
        permits = cur.fetchone()[0]
    return {"requests": int(requests), "permits": int(permits)}


def counter_drift(url: str) -> dict[str, list[int]]:
    """Semaphore name -> [its in-use counter, the permits it holds], for each
    counter that differs: every grant and release changes both in one
    transaction, so any entry is a bug."""
    with db.cursor(url) as cur:
        cur.execute(
            # What the semaphore holds: its counter less the releases not
            # folded in yet (models.ReleaseCounter).
            "SELECT s.name, CAST(s.in_use_counter AS SIGNED) + s.released_folded - c.released,"
            " COALESCE(SUM(p.count), 0)"
            " FROM django_semaphore_semaphore s"
            " JOIN django_semaphore_releasecounter c ON c.semaphore_id = s.id"
            " LEFT JOIN django_semaphore_permit p ON p.semaphore_id = s.id AND p.state = 'ACQUIRED'"
            " GROUP BY s.id, s.name, s.in_use_counter, s.released_folded, c.released"
        )
        return {name: [int(n), int(held)] for name, n, held in cur.fetchall() if n != held}


def seconds_until_expired(url: str) -> float:
    """How long until every held request with a TTL has expired (DB clock)."""
    with db.cursor(url) as cur:
        cur.execute(
            "SELECT TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), MAX(expires_at))"
            " FROM django_semaphore_permitrequest WHERE state = 'ACQUIRED'"
        )
        micros = cur.fetchone()[0]
    return 0.0 if micros is None else max(0.0, micros / 1e6)


class Keys:
    """What the clients' histories say about each key."""

    def __init__(self, histories: Iterable[Path]) -> None:
        self.demand: dict[str, dict[str, int]] = {}
        self.oks: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.first_ok: dict[str, float] = {}
        self.release_at: dict[str, float] = {}
        self.last_event: dict[str, float] = {}  # key -> last time its client was seen alive
        self.faults: list[dict[str, Any]] = []
        self.raw: list[dict[str, Any]] = []
        self.odd: list[dict[str, Any]] = []
        self.errors: Counter[str] = Counter()
        self.writes: list[dict[str, Any]] = []
        self.renews: Counter[int] = Counter()
        self.attempts = 0
        self.retried_db_errors: Counter[int] = Counter()
        self.final: dict[str, dict[str, Any]] = {}  # key -> last acquire answer
        for path in histories:
            self._read(path)

    def _read(self, path: Path) -> None:
        client_keys: list[str] = []
        last = 0.0
        for event in read(path):
            last = event["t"]
            kind, key = event["e"], event.get("k")
            if kind == "inv":
                self.attempts += 1
                self.demand.setdefault(key, event["d"])
            elif kind == "ok":
                if "d" in event:  # a task run under a regenerated key (<id>~2)
                    self.demand.setdefault(key, event["d"])
                self.oks[key].append(event)
                self.first_ok.setdefault(key, event["t"])
                self.final[key] = event
                client_keys.append(key)
            elif kind == "fail":
                self.errors[event["x"]] += 1
                self.final[key] = event
                if event.get("odd"):
                    self.odd.append(event)
            elif kind == "rel":
                self.release_at.setdefault(key, event["t"])
            elif kind == "raw":
                self.raw.append(event)
            elif kind == "fault":
                self.faults.append(event)
            elif kind == "write":
                self.writes.append(event)
            elif kind == "renew":
                self.renews[event["ok"]] += 1
            elif kind == "dberr":
                self.retried_db_errors[event["code"]] += 1
        for key in client_keys:
            self.last_event[key] = last


def check(url: str, histories: Iterable[Path], drift: dict[str, list[int]]) -> dict[str, Any]:
    """Every invariant, from the database and the clients' histories; ``drift``
    is ``counter_drift`` read before the sweep."""
    keys = Keys(histories)
    with db.cursor(url) as cur:
        cur.execute("SELECT id, name, capacity FROM django_semaphore_semaphore")
        semaphores = {row[0]: (row[1], row[2]) for row in cur.fetchall()}
        cur.execute(
            "SELECT id, tbl, op, row_id, request_id, semaphore_id, cnt, state, token, ext,"
            " reason, trx FROM faults_audit ORDER BY id"
        )
        audit = cur.fetchall()
        cur.execute(
            "SELECT r.id, r.external_id, r.state, r.release_reason,"
            " SUM(p.state = 'ACQUIRED'), COUNT(p.id)"
            " FROM django_semaphore_permitrequest r"
            " LEFT JOIN django_semaphore_permit p ON p.request_id = r.id GROUP BY r.id"
        )
        requests = {row[1]: row for row in cur.fetchall()}
        cur.execute("SELECT resource, token FROM faults_write ORDER BY id")
        writes = cur.fetchall()
    violations: dict[str, int] = Counter()
    examples: list[str] = []

    def violation(kind: str, detail: str) -> None:
        violations[kind] += 1
        if len(examples) < 20:
            examples.append(f"{kind}: {detail}")

    # --- the database's timeline -------------------------------------------
    in_use: dict[int, dict[int, int]] = defaultdict(dict)
    last_token: dict[int, int] = {}
    request_of_ext: dict[str, int] = {}
    ext_inserts: Counter[str] = Counter()
    request_trx: dict[int, str | None] = {}
    granted: dict[int, dict[str, int]] = defaultdict(dict)
    permit_trx: dict[int, set[str | None]] = defaultdict(set)
    tokens_of_request: dict[int, dict[str, int]] = defaultdict(dict)
    peak: dict[int, int] = Counter()
    for _id, tbl, op, row_id, request_id, sem, cnt, state, token, ext, _reason, trx in audit:
        if tbl == "R" and op == "I":
            ext_inserts[ext] += 1
            request_of_ext[ext] = row_id
            request_trx[row_id] = trx
        elif tbl == "P" and op == "I":
            name, capacity = semaphores[sem]
            if name in granted[request_id]:
                violation("duplicate grant", f"request {request_id} got two permits on {name}")
            granted[request_id][name] = cnt
            permit_trx[request_id].add(trx)
            tokens_of_request[request_id][name] = token
            if sem in last_token and token <= last_token[sem]:
                violation("non-monotonic token", f"{name}: {token} after {last_token[sem]}")
            last_token[sem] = max(token, last_token.get(sem, 0))
            if state == "ACQUIRED":
                in_use[sem][row_id] = cnt
                total = sum(in_use[sem].values())
                peak[sem] = max(peak[sem], total)
                if total > capacity:
                    violation("over-grant", f"{name}: {total} held, capacity {capacity}")
        elif tbl == "P" and op == "U" and state == "RELEASED":
            in_use[sem].pop(row_id, None)
    for ext, count in ext_inserts.items():
        if count > 1:
            violation("duplicate grant", f"key {ext} inserted {count} times")

    # --- all-or-nothing -----------------------------------------------------
    for ext, request_id in request_of_ext.items():
        asked = keys.demand.get(ext)
        got = granted.get(request_id, {})
        if not got:
            violation("half-grant", f"request {ext} has no permits")
        elif asked is not None and got != asked:
            violation("half-grant", f"request {ext} asked {asked}, got {got}")
        sessions = permit_trx[request_id] | {request_trx[request_id]}
        if len(sessions) != 1:
            violation("half-grant", f"request {ext} written by sessions {sorted(sessions)}")

    # --- what clients were told ---------------------------------------------
    for key, oks in keys.oks.items():
        if key not in request_of_ext:
            violation("lost acknowledged grant", f"{key} was granted to a client, not in the DB")
            continue
        request_id = request_of_ext[key]
        for ok in oks:
            if ok["id"] != request_id:
                violation("duplicate grant", f"{key}: told request {ok['id']}, DB has {request_id}")
            if ok["tok"] != tokens_of_request[request_id]:
                violation(
                    "token mismatch",
                    f"{key}: told {ok['tok']}, DB has {tokens_of_request[request_id]}",
                )
    lost_responses = [f for f in keys.faults if f["a"] == "lost-response"]
    recovered = 0
    for fault in lost_responses:
        final = keys.final.get(fault["k"])
        if final is not None and final["e"] == "ok":
            recovered += 1  # and checked against the DB just above
        elif fault["k"] in request_of_ext and not (
            final is not None and final.get("x") == "PermitAlreadyReleased"
        ):
            violation("lost response not recovered", f"{fault['k']}: final answer {final}")
    for event in keys.raw:
        violation("raw driver error", f"{event['x']}: {event.get('m', '')}")
    for event in keys.odd:
        if str(event.get("m", "")).startswith("Database error"):
            violation("unclassified driver error", event.get("m", ""))

    # --- the clients' timeline ----------------------------------------------
    reason = {row[1]: row[3] for row in requests.values()}
    ttl_overlaps = _client_overlaps(keys, semaphores, reason, violation)

    # --- fencing ---------------------------------------------------------------
    highest: dict[str, int] = {}
    for resource, token in writes:
        if token < highest.get(resource, 0):
            violation(
                "stale write accepted", f"{resource}: token {token} after {highest[resource]}"
            )
        highest[resource] = max(token, highest.get(resource, 0))

    # --- after the sweep --------------------------------------------------------
    leaked = 0
    for _rid, ext, state, _reason, acquired_permits, _permits in requests.values():
        acquired_permits = int(acquired_permits or 0)
        if state == "ACQUIRED" or acquired_permits:
            leaked += 1
            if len(examples) < 20:
                examples.append(f"leaked: {ext} state {state}, {acquired_permits} permits held")

    for name, (recorded, held_now) in drift.items():
        violation("in-use counter drift", f"{name}: counter {recorded}, permits held {held_now}")

    fired = Counter(f"{f['p']}:{f['a']}" for f in keys.faults)
    return {
        "attempts": keys.attempts,
        "grants": len(request_of_ext),
        "errors": dict(keys.errors),
        "retried_db_errors": {str(k): v for k, v in keys.retried_db_errors.items()},
        "faults_fired": sum(fired.values()),
        "fired": dict(fired),
        "violations": dict(violations),
        "violation_total": sum(violations.values()),
        "ttl_reclaimed_overlaps": ttl_overlaps,
        "lost_responses_recovered": recovered,
        "stale_writes_refused": sum(1 for w in keys.writes if w["ok"] == 0),
        "fenced_writes": sum(1 for w in keys.writes if w["ok"] == 1),
        "renewals_refused": keys.renews[0],
        "peak_held": {semaphores[s][0]: n for s, n in sorted(peak.items())},
        "leaked": leaked,
        "counter_drift": drift,
        "examples": examples,
    }


def _client_overlaps(
    keys: Keys,
    semaphores: dict[int, tuple[str, int]],
    reason: dict[str, str],
    violation: Any,
) -> int:
    """Sweep the clients' hold intervals [told granted, started releasing].

    Each lies inside the permit's real interval in the database (granted
    before the answer, released after the call), so more holders than
    capacity at one instant is an over-grant -- unless one of them had been
    reclaimed by its TTL (or a sweep) while its client still worked.
    """
    capacity = dict(semaphores.values())
    events: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
    for key, start in keys.first_ok.items():
        end = keys.release_at.get(key, keys.last_event.get(key, start))
        if end <= start:
            continue
        for name, count in keys.demand[key].items():
            events[name].append((start, count, key))
            events[name].append((end, -count, key))
    flagged = 0
    for name, timeline in events.items():
        timeline.sort(key=lambda e: (e[0], e[1]))  # ends before starts at a tie
        holders: dict[str, int] = {}
        for _t, delta, key in timeline:
            if delta < 0:
                holders.pop(key, None)
                continue
            holders[key] = delta
            if sum(holders.values()) > capacity[name]:
                if any(reason.get(k) in RECLAIMED for k in holders):
                    flagged += 1
                else:
                    violation("over-grant (client timeline)", f"{name}: {sorted(holders)}")
    return flagged
