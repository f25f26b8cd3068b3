"""Rate limits (issue 27): what a windowed semaphore holds to, what it costs.

``python -m benchmarks.rates --database-url URL`` runs four figures, each
with ``--clients`` (16) client processes of ``python -m benchmarks``' pool
(each connected before the clock starts; CPU measured as there: each
client's own, and the database server's from ``/proc``):

1. **limit**: one semaphore of ``--rate`` (200) per second; the clients loop
   ``acquire(timeout=5)`` / ``release()`` for ``--duration`` (30) seconds.
   Then the grant log -- every grant's time, its request's ``created_at``
   (the database's clock) -- is checked: for every grant time t, the grants
   in [t, t + 1 s) must never exceed the rate ("windows over the limit",
   target 0), and the clients' cycles/s must reach 0.95 x the rate.
2. **celery**: the same limit through Celery's own ``rate_limit`` on a
   task that logs its start (``benchmarks/rates_app.py``): a backlog in the
   Redis broker, real ``celery worker`` processes for ``--duration``
   seconds, their starts checked as the grants above. Celery limits each
   worker (node) on its own: two nodes may start twice the rate. Layouts
   (``--celery``): ``2x1`` two nodes of one process (``--pool=solo``), ``1x2``
   one node of two (``--pool=prefork``).
3. **pair**: ``{plain: 1, windowed: 1}`` (a rate of 1,000,000/s: never
   refused) against ``{plain: 1, plain: 1}`` (capacity 100: never refused),
   ``--repeat`` (3) runs each, interleaved (A B, B A, ...), ``--cost-duration`` (5) seconds
   a run: cost per cycle as ratios -- wall time (the inverse of cycles/s),
   server CPU and client CPU per cycle -- of the medians; target <= 1.2.
4. **history**: ``--history`` (1,000,000) expired slots (released
   requests whose permits' slots ended minutes ago, bulk-inserted by raw
   SQL) on one windowed semaphore, none on its twin in the same tables;
   runs alternate between the two, ``--repeat`` each: first at a rate that
   never refuses (the grant's cost; target within 10 %), then both limited
   to ``--rate`` with waiting clients, as in figure 1 (the refusals', probes'
   and waits' cost). An empty-table run before the seeding is kept for
   reference.

The database is created if missing, migrated, and its semaphore tables are
emptied between cells (never point it at data you keep). ``--smoke`` runs
everything tiny (``tests/test_benchmark_smoke.py``); ``--markdown JSON``
prints a results file as the tables of benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from benchmarks import db, systems
from benchmarks.fixtures import CHUNK, Data
from benchmarks.scenarios import Bench, Cell, Options

ROOT = Path(__file__).resolve().parent.parent
LIMIT = "rate-limit"
# A rate that never refuses: what the window costs, not what it refuses.
WIDE = 1_000_000
PLAIN_CAPACITY = 100  # above any client count: never refused
WAIT = 5.0  # the limited clients' acquire(timeout=)
SECOND = 1_000_000  # microseconds
HISTORY_STEP = 5_000  # microseconds between two seeded grants (200/s)
T = TypeVar("T")
CELERY_LAYOUTS = {"2x1": (2, "solo", 1), "1x2": (1, "prefork", 2)}


# --- the checker ---------------------------------------------------------------------


def windows_over(times: list[int], limit: int, window: int = SECOND) -> dict[str, int]:
    """Slide ``window`` over every grant: for each grant time t (in
    microseconds), the grants in [t, t + window). Counted: the windows over
    ``limit`` and the most grants found in one window."""
    times = sorted(times)
    over = most = 0
    end = 0
    for i, t in enumerate(times):
        while end < len(times) and times[end] < t + window:
            end += 1
        most = max(most, end - i)
        over += end - i > limit
    return {"grants": len(times), "windows_over": over, "max_in_window": most}


def rate_of(times: list[int], since: int, until: int) -> float:
    """Grants per second in [since, until)."""
    span = (until - since) / SECOND
    return sum(since <= t < until for t in times) / span if span > 0 else 0.0


def _micros(moment: datetime) -> int:
    return (moment - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)


def grant_times(name: str) -> list[int]:
    """Every grant on ``name`` so far, as its request's ``created_at`` (the
    database's clock), in microseconds."""
    from django_semaphore.models import PermitRequest

    stamps = PermitRequest.objects.filter(permits__semaphore__name=name).values_list(
        "created_at", flat=True
    )
    return sorted(_micros(t) for t in stamps)


# --- figures 1, 3 and 4: the app ---------------------------------------------------------


def _limited(name: str, capacity: int) -> None:
    from django_semaphore import set_capacity, set_window

    set_capacity(name, capacity)
    set_window(name, 1)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def limiter(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """Figure 1: ``--rate``/s, ``--clients`` waiting clients, the grant log checked."""
    bench.fresh([LIMIT], args.rate)
    _limited(LIMIT, args.rate)
    load = _load()
    cell = _measure(bench, f"1 limit {args.rate}/s", args, [LIMIT], args.rate, args.duration, WAIT)
    times = grant_times(LIMIT)
    last = times[-1] if times else 0
    return {
        "rate": args.rate,
        "clients": args.clients,
        "duration_s": args.duration,
        **windows_over(times, args.rate),
        # How bursty within the window: a sliding limit lets a window's
        # grants come at once (each slot frees a window after its grant).
        "max_in_100ms": windows_over(times, args.rate, SECOND // 10)["max_in_window"],
        "cycles_per_s": round(cell.cycles_per_s, 1),
        "throughput_over_rate": round(cell.cycles_per_s / args.rate, 3),
        # From the log: the last duration's grants (the warm-up's burst left out).
        "logged_per_s": round(rate_of(times, last - int(args.duration * SECOND), last + 1), 1),
        "timeouts": cell.rejections,
        "errors": cell.errors,
        "server_cpu_ms_per_grant": _round(cell.server_cpu_ms),
        "client_cpu_ms_per_grant": _round(cell.client_cpu_ms),
        "load_before": load,
        "load_after": _load(),
        "cell": asdict(cell),
    }


def pair(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """Figure 3: a windowed and a plain semaphore together against two plain
    ones, interleaved runs."""
    shapes = {
        "plain multi(2)": ["pair-a", "pair-b"],
        "plain + windowed": ["pair-a", "pair-w"],
    }
    runs: dict[str, list[Cell]] = {shape: [] for shape in shapes}
    load = _load()
    for round_ in range(args.repeat):
        for shape, names in _in_turn(list(shapes.items()), round_):
            bench.fresh(names, PLAIN_CAPACITY)
            if "pair-w" in names:
                _limited("pair-w", WIDE)
            runs[shape].append(
                _measure(bench, f"3 pair: {shape}", args, names, PLAIN_CAPACITY, args.cost_duration)
            )
    return {
        "load_before": load,
        "load_after": _load(),
        **_compare(runs["plain + windowed"], runs["plain multi(2)"]),
    }


def history(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """Figure 4: a windowed semaphore over ``--history`` expired slots
    against its twin with none, both at a rate that never refuses, then both
    limited to ``--rate`` with waiting clients."""
    fresh, full = "history-none", "history-full"
    bench.fresh([fresh, full], WIDE)
    for name in (fresh, full):
        _limited(name, WIDE)
    result: dict[str, Any] = {"history": args.history, "load_before": _load()}
    empty = [
        _measure(bench, "4 empty tables", args, [fresh], WIDE, args.cost_duration)
        for _ in range(args.repeat)
    ]
    result["empty_tables"] = _medians(empty)
    started = time.monotonic()
    result["seeded"] = seed_expired_slots(bench.data, full, args.history)
    result["seeded"]["seconds"] = round(time.monotonic() - started, 1)
    bench.say(f"   seeded {args.history:,} expired slots in {result['seeded']['seconds']}s")
    wide: dict[str, list[Cell]] = {fresh: [], full: []}
    for round_ in range(args.repeat):
        for name in _in_turn(list(wide), round_):
            label = f"4 history {args.history:,}" if name == full else "4 history none"
            wide[name].append(_measure(bench, label, args, [name], WIDE, args.cost_duration))
    result["wide"] = _compare(wide[full], wide[fresh])
    result["wide"]["full_over_empty_tables"] = _compare(wide[full], empty)["cost"]
    # The same two as rate limits, with waiting clients: refusals, probes, waits.
    for name in (fresh, full):
        _limited(name, args.rate)
    time.sleep(1.1)  # the wide runs' slots end
    limited: dict[str, list[Cell]] = {fresh: [], full: []}
    # Two windows at least: the first one's grants come at once, in the warm-up.
    limited_for = max(args.cost_duration, 2.0)
    since = {name: _micros(datetime.now(UTC)) for name in limited}
    for round_ in range(args.repeat):
        for name in _in_turn(list(limited), round_):
            label = f"4 limited, history {args.history:,}" if name == full else "4 limited, none"
            limited[name].append(_measure(bench, label, args, [name], args.rate, limited_for, WAIT))
    result["limited"] = _compare(limited[full], limited[fresh])
    result["limited"]["windows"] = {
        name: windows_over([t for t in grant_times(name) if t >= since[name]], args.rate)
        for name in limited
    }
    result["load_after"] = _load()
    return result


def _in_turn(sides: list[T], round_: int) -> list[T]:
    """A B, then B A, ...: a load that drifts during a round weighs on
    neither side more than the other."""
    return sides if round_ % 2 == 0 else sides[::-1]


def seed_expired_slots(data: Data, name: str, count: int) -> dict[str, Any]:
    """``count`` released requests on the windowed semaphore ``name``, a
    grant every ``HISTORY_STEP`` microseconds (at 200/s) up to two minutes
    ago, each with its permit and the end of its slot a second after it: by
    raw INSERT ... SELECT in chunks. The semaphore is left as its grants
    would have left it: its fencing counter past their tokens, its slots
    closed up to the last one's end."""
    vendor = data.target.vendor
    semaphore_id = data.scalar("SELECT id FROM django_semaphore_semaphore WHERE name = %s", [name])
    prefix = f"slot-{uuid.uuid4().hex[:8]}"
    last_end = datetime.now(UTC) - timedelta(minutes=2)
    base = last_end - timedelta(seconds=1, microseconds=HISTORY_STEP * count)
    at, base_param, ends = {
        "mysql": (
            f"TIMESTAMPADD(MICROSECOND, n * {HISTORY_STEP}, %s)",
            base.replace(tzinfo=None),
            "created_at + INTERVAL 1 SECOND",
        ),
        "postgresql": (
            f"(%s + n * INTERVAL '{HISTORY_STEP} microseconds')",
            base,
            "created_at + INTERVAL '1 second'",
        ),
        "sqlite": (
            f"strftime('%Y-%m-%d %H:%M:%f', %s, '+' || (n * {HISTORY_STEP} / 1e6) || ' seconds')",
            base.strftime("%Y-%m-%d %H:%M:%S.%f"),
            "strftime('%Y-%m-%d %H:%M:%f', created_at, '+1 seconds')",
        ),
    }[vendor]
    key = db.concat(data.target, f"'{prefix}-'", "n")
    for first in range(1, count + 1, CHUNK):
        nums = db.numbers(data.target, first, min(first + CHUNK - 1, count))
        data.execute(
            "INSERT INTO django_semaphore_permitrequest (external_id, owner, state, ttl,"
            " expires_at, created_at, updated_at, released_at, release_reason)"
            f" SELECT {key}, 'bench', 'RELEASED', NULL, NULL, t, t, t, 'released'"
            f" FROM (SELECT n, {at} AS t FROM {nums}) slots",
            [base_param],
        )
    # Fencing tokens are unique per semaphore: the request id is.
    data.execute(
        "INSERT INTO django_semaphore_permit (semaphore_id, request_id, count, state,"
        f" fencing_token, slot_ends) SELECT %s, id, 1, 'RELEASED', id, {ends}"
        " FROM django_semaphore_permitrequest WHERE external_id LIKE %s",
        [semaphore_id, f"{prefix}-%"],
    )
    data.execute(
        "UPDATE django_semaphore_semaphore SET"
        " fencing_counter = (SELECT MAX(fencing_token) FROM django_semaphore_permit"
        " WHERE semaphore_id = %s),"
        " slots_closed_until = (SELECT MAX(slot_ends) FROM django_semaphore_permit"
        " WHERE semaphore_id = %s) WHERE id = %s",
        [semaphore_id, semaphore_id, semaphore_id],
    )
    data.analyze()
    return {
        "slots": int(
            data.scalar(
                "SELECT COUNT(*) FROM django_semaphore_permit"
                " WHERE semaphore_id = %s AND slot_ends IS NOT NULL",
                [semaphore_id],
            )
        ),
        "first_grant": base.isoformat(),
        "last_slot_ends": last_end.isoformat(),
    }


def _measure(
    bench: Bench,
    scenario: str,
    args: argparse.Namespace,
    names: list[str],
    capacity: int,
    duration: float,
    timeout: float = 0.0,
) -> Cell:
    cell = bench.measure(
        scenario,
        systems.APP,
        args.clients,
        lambda i: names,
        capacity,
        timeout=timeout,
        duration=duration,
    )
    assert cell is not None  # the app is always measured
    cell.extra["load"] = _load()
    return cell


def _medians(cells: list[Cell]) -> dict[str, Any]:
    """Each figure's median over the runs (each figure on its own: one run
    slowed by a neighbour moves every median by one place at most)."""

    def median(get: Callable[[Cell], float | None]) -> float | None:
        values = [v for v in map(get, cells) if v is not None]
        return round(statistics.median(values), 4) if values else None

    return {
        "runs": len(cells),
        "cycles_per_s": median(lambda c: c.cycles_per_s),
        "runs_cycles_per_s": [round(c.cycles_per_s) for c in cells],
        "server_cpu_ms": median(lambda c: c.server_cpu_ms),
        "runs_server_cpu_ms": [_round(c.server_cpu_ms) for c in cells],
        "client_cpu_ms": median(lambda c: c.client_cpu_ms),
        "runs_client_cpu_ms": [_round(c.client_cpu_ms) for c in cells],
        "p50_ms": median(lambda c: c.p50_ms),
        "p99_ms": median(lambda c: c.p99_ms),
        "rejections": sum(c.rejections for c in cells),
        "errors": sum(c.errors for c in cells),
        "loads": [c.extra.get("load") for c in cells],
    }


def _compare(mine: list[Cell], base: list[Cell]) -> dict[str, Any]:
    """Medians of both sides and what a cycle of ``mine`` costs over one of
    ``base``: wall time (the inverse of cycles/s), server and client CPU."""
    a, b = _medians(mine), _medians(base)
    return {
        "mine": a,
        "base": b,
        "cost": {
            "wall": _round(_ratio(b["cycles_per_s"], a["cycles_per_s"])),
            "server_cpu": _round(_ratio(a["server_cpu_ms"], b["server_cpu_ms"])),
            "client_cpu": _round(_ratio(a["client_cpu_ms"], b["client_cpu_ms"])),
        },
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


# --- figure 2: Celery's rate_limit ---------------------------------------------------


def celery_figure(args: argparse.Namespace, layout: str) -> dict[str, Any]:
    """A backlog of ``tick`` tasks, then ``layout``'s workers for
    ``--duration`` seconds (and a little more, so that all of them run
    through the span counted); every start logged and checked."""
    import redis

    nodes, pool, concurrency = CELERY_LAYOUTS[layout]
    run_id = uuid.uuid4().hex[:8]
    queue, starts = f"bench-rates-{run_id}", f"bench-rates:{run_id}:starts"
    os.environ.update(
        BENCH_REDIS_URL=args.redis_url,
        BENCH_RATE=str(args.rate),
        BENCH_QUEUE=queue,
        BENCH_STARTS=starts,
    )
    from benchmarks import rates_app

    broker = redis.Redis.from_url(args.redis_url)
    # Enough for every node at the rate, and more: the workers never run dry.
    backlog = args.celery_backlog or int(args.rate * nodes * (args.duration + 10) * 1.2)
    log = ROOT / ".runtime" / "benchmarks" / f"rates-celery-{layout}-{run_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        published = time.monotonic()
        with rates_app.app.producer_or_acquire() as producer:
            for _ in range(backlog):
                rates_app.tick.apply_async(queue=queue, producer=producer)
        published_s = time.monotonic() - published
        load = _load()
        with CeleryWorkers(
            nodes, pool, concurrency, args.celery_prefetch, queue, log, rates_app.app
        ):
            # Every node answered a ping: each runs through the span counted.
            time.sleep(args.duration + 1.0)
            stopped = _micros(datetime.now(UTC))
        times = sorted(round(float(t) * SECOND) for t in broker.lrange(starts, 0, -1))
    finally:
        # The queue, its bindings (kombu's) and the log: nothing left in Redis.
        broker.delete(queue, starts, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
        broker.close()
    counted_from = stopped - int(args.duration * SECOND)
    return {
        "layout": f"{nodes} node(s) x {concurrency} process(es), --pool={pool}"
        f" --prefetch-multiplier={args.celery_prefetch}",
        "rate_limit": f"{args.rate}/s",
        "backlog": backlog,
        "publish_s": round(published_s, 1),
        **windows_over(times, args.rate),
        "max_in_100ms": windows_over(times, args.rate, SECOND // 10)["max_in_window"],
        "starts_per_s": round(rate_of(times, counted_from, stopped), 1),
        "throughput_over_rate": round(rate_of(times, counted_from, stopped) / args.rate, 3),
        "load_before": load,
        "load_after": _load(),
    }


class CeleryWorkers:
    """``nodes`` ``celery worker`` processes on ``queue``, stopped on exit
    (SIGTERM, then SIGKILL after 30 s)."""

    def __init__(
        self,
        nodes: int,
        pool: str,
        concurrency: int,
        prefetch: int,
        queue: str,
        log: Path,
        app: Any,
    ) -> None:
        self.nodes, self.pool, self.concurrency = nodes, pool, concurrency
        self.prefetch = prefetch
        self.queue, self.log, self.app = queue, log, app
        self.processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "C_FORCE_ROOT": "1"}
        names = [f"{self.queue}-{n}@{os.uname().nodename}" for n in range(self.nodes)]
        try:
            with self.log.open("ab") as output:
                for name in names:
                    command = [
                        sys.executable, "-m", "celery", "-A", "benchmarks.rates_app", "worker",
                        f"--pool={self.pool}", f"--concurrency={self.concurrency}",
                        f"--queues={self.queue}", f"--hostname={name}", "--without-gossip",
                        "--without-mingle", "--without-heartbeat", "--loglevel=WARNING",
                        f"--prefetch-multiplier={self.prefetch}",
                    ]  # fmt: skip
                    self.processes.append(
                        subprocess.Popen(command, env=env, stdout=output, stderr=output)
                    )
            deadline = time.monotonic() + 60
            for name in names:
                while not self.app.control.ping(destination=[name], timeout=0.5):
                    if time.monotonic() > deadline or any(
                        p.poll() is not None for p in self.processes
                    ):
                        raise SystemExit(f"A Celery worker did not start; see {self.log}")
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# --- the figures against their targets ----------------------------------------------------


def checks(figures: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def check(figure: str, value: float | None, target: str, met: bool | None) -> None:
        out.append({"figure": figure, "value": value, "target": target, "met": met})

    if "limit" in figures:
        f = figures["limit"]
        check(
            f"{f['rate']}/s limiter: 1 s windows over the limit", f["windows_over"], "0",
            f["windows_over"] == 0,
        )  # fmt: skip
        check(
            f"{f['rate']}/s limiter: most grants in a 1 s window", f["max_in_window"],
            f"<= {f['rate']}", f["max_in_window"] <= f["rate"],
        )  # fmt: skip
        check(
            f"{f['rate']}/s limiter: throughput / rate", f["throughput_over_rate"], ">= 0.95",
            f["throughput_over_rate"] >= 0.95,
        )  # fmt: skip
        check(
            f"{f['rate']}/s limiter: most grants in 100 ms", f.get("max_in_100ms"),
            "(for reference)", None,
        )  # fmt: skip
    for run in figures.get("celery", []):
        check(
            f"Celery rate_limit, {run['layout']}: 1 s windows over the limit",
            run["windows_over"], "(for reference)", None,
        )  # fmt: skip
        check(
            f"Celery rate_limit, {run['layout']}: most starts in a 1 s window",
            run["max_in_window"], "(for reference)", None,
        )  # fmt: skip
        check(
            f"Celery rate_limit, {run['layout']}: starts per second / rate",
            run["throughput_over_rate"], "(for reference)", None,
        )  # fmt: skip
    if "pair" in figures:
        for side, cost in figures["pair"]["cost"].items():
            check(
                f"windowed + plain / plain multi(2): {side} per cycle", cost, "<= 1.2",
                None if cost is None else cost <= 1.2,
            )  # fmt: skip
    if "history" in figures:
        h = figures["history"]
        for side, cost in h["wide"]["cost"].items():
            check(
                f"{h['history']:,} expired slots / none: {side} per grant", cost, "<= 1.1",
                None if cost is None else cost <= 1.1,
            )  # fmt: skip
        for side, cost in h["limited"]["cost"].items():
            check(
                f"{h['history']:,} expired slots / none, limited and waiting: {side} per grant",
                cost, "(for reference)", None,
            )  # fmt: skip
        for name, counted in h["limited"]["windows"].items():
            check(
                f"limited {name}: 1 s windows over the limit", counted["windows_over"], "0",
                counted["windows_over"] == 0,
            )  # fmt: skip
    return out


def checks_text(results: list[dict[str, Any]]) -> str:
    marks = {True: "met", False: "NOT MET", None: ""}
    return "\n".join(
        f"{marks[r['met']]:>8}  {r['figure']}: {r['value']} (target {r['target']})" for r in results
    )


def markdown(results: dict[str, Any]) -> str:
    """A results file as the tables of benchmarks/README.md."""
    meta, figures = results["meta"], results["figures"]
    lines = [f"{meta['database']}, {meta['clients']} client processes, commit {meta['commit']}", ""]
    lines += ["| figure | measured | target | met | load (1/5/15 min) |", "|---|--:|---|---|---|"]
    loads = {
        "limiter": figures.get("limit", {}).get("load_before"),
        "Celery": None,
        "windowed + plain": figures.get("pair", {}).get("load_before"),
        "expired slots": figures.get("history", {}).get("load_before"),
    }
    marks = {True: "yes", False: "**no**", None: ""}
    for r in results["checks"]:
        load = next((v for k, v in loads.items() if k in r["figure"]), None)
        if "Celery" in r["figure"]:
            run = next(c for c in figures["celery"] if c["layout"] in r["figure"])
            load = run["load_before"]
        value = r["value"]
        shown = f"{value:,}" if isinstance(value, int) else f"{value}"
        lines.append(
            f"| {r['figure']} | {shown} | {r['target']} | {marks[r['met']]}"
            f" | {' / '.join(map(str, load or []))} |"
        )
    lines += [
        "",
        "| cells (medians) | cycles/s | runs | p50 ms | p99 ms | client CPU ms | server CPU ms"
        " | timeouts |",
        "|---|--:|---|--:|--:|--:|--:|--:|",
    ]

    def row(label: str, m: dict[str, Any]) -> None:
        lines.append(
            f"| {label} | {m['cycles_per_s']:,.0f} | {m['runs_cycles_per_s']}"
            f" | {_show(m['p50_ms'])} | {_show(m['p99_ms'])} | {_show(m['client_cpu_ms'])}"
            f" | {_show(m['server_cpu_ms'])} | {m['rejections']} |"
        )

    if "limit" in figures:
        f = figures["limit"]
        c = f["cell"]
        row(
            f"1: {f['rate']}/s limiter, {f['duration_s']:g} s",
            {
                "cycles_per_s": c["cycles_per_s"],
                "runs_cycles_per_s": [round(c["cycles_per_s"])],
                "p50_ms": c["p50_ms"],
                "p99_ms": c["p99_ms"],
                "client_cpu_ms": c["client_cpu_ms"],
                "server_cpu_ms": c["server_cpu_ms"],
                "rejections": c["rejections"],
            },
        )
    if "pair" in figures:
        row("3: plain multi(2)", figures["pair"]["base"])
        row("3: plain + windowed", figures["pair"]["mine"])
    if "history" in figures:
        h = figures["history"]
        row("4: windowed, empty tables (before seeding)", h["empty_tables"])
        row("4: windowed, no history (twin)", h["wide"]["base"])
        row(f"4: windowed, {h['history']:,} expired slots", h["wide"]["mine"])
        row("4: limited, no history (twin)", h["limited"]["base"])
        row(f"4: limited, {h['history']:,} expired slots", h["limited"]["mine"])
    return "\n".join(lines)


def _show(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# --- the command -------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rates", description=__doc__)
    parser.add_argument("--database-url", help="required unless --markdown")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("SEMAPHORE_REDIS_URL", "redis://127.0.0.1:63791/0"),
        help="the Celery figure's broker",
    )
    parser.add_argument("--figures", default="limit,pair,history,celery")
    parser.add_argument("--rate", type=int, default=200, help="grants per second")
    parser.add_argument("--clients", type=int, default=16, help="client processes")
    parser.add_argument("--duration", type=float, default=30.0, help="figures 1 and 2, seconds")
    parser.add_argument("--cost-duration", type=float, default=5.0, help="a run of 3 or 4")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side (3, 4)")
    parser.add_argument("--history", type=int, default=1_000_000, help="expired slots (4)")
    parser.add_argument(
        "--celery", default="2x1,1x2", help=f"Celery layouts: {','.join(CELERY_LAYOUTS)}"
    )
    parser.add_argument(
        "--celery-backlog", type=int, default=0, help="tasks (default: more than ever run)"
    )
    parser.add_argument(
        "--celery-prefetch", type=int, default=4, help="worker_prefetch_multiplier (Celery's 4)"
    )
    parser.add_argument("--smoke", action="store_true", help="everything tiny")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--label", default="")
    parser.add_argument("--markdown", type=Path, metavar="JSON", help="print a results file")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rate, args.clients, args.duration = 50, 2, 2.0
        # 1 s a cost cell: on a loaded machine 0.3 s once measured no cycle at all.
        args.cost_duration, args.repeat, args.history = 1.0, 1, 2_000
        args.celery = "2x1"
    if not args.markdown and not args.database_url:
        parser.error("--database-url is required")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    # Stopped by a signal, still stop the workers and the pool (finally blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wanted = [f for f in args.figures.split(",") if f]
    target = db.Target.parse(args.database_url)
    db.ensure_database(target)
    os.environ["BENCH_DATABASE_URL"] = args.database_url
    os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.settings"
    import django

    django.setup()

    def say(line: str) -> None:
        print(line, flush=True)

    say(f"rate limits on {db.server_version(target)}, {args.clients} client processes")
    started = time.monotonic()
    figures: dict[str, Any] = {}
    app_figures = {"limit": limiter, "pair": pair, "history": history}
    if any(f in app_figures for f in wanted):
        options = Options(
            url=args.database_url,
            redis_url=args.redis_url,
            duration=args.cost_duration,
            clients=[args.clients],
            mutex_clients=[args.clients],
            many=args.clients,
            multi_clients=args.clients,
            waiting_processes=1,
        )
        bench = Bench(options, say)
        try:
            bench.data.create_schema()
            for name, figure in app_figures.items():
                if name in wanted:
                    say(f"-- {name} (load {_load()})")
                    figures[name] = figure(bench, args)
        finally:
            bench.pool.close()
            bench.data.close()
    if "celery" in wanted:
        figures["celery"] = []
        for layout in args.celery.split(","):
            say(f"-- celery {layout} (load {_load()})")
            figures["celery"].append(celery_figure(args, layout))
            say(f"   {figures['celery'][-1]}")
    checked = checks(figures)
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "database": db.server_version(target),
        "vendor": target.vendor,
        "clients": args.clients,
        "args": {k: str(v) for k, v in vars(args).items() if k not in {"json", "markdown"}},
        "commit": _git_commit(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "uptime": _uptime(),
        "seconds": round(time.monotonic() - started, 1),
    }
    results = {"meta": meta, "figures": figures, "checks": checked}
    print()
    print(checks_text(checked))
    print(f"\n{meta['uptime']}; {meta['seconds']}s in all")
    path = args.json or ROOT / ".runtime" / "benchmarks" / f"rates-{target.vendor}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str))
    print(f"results: {path}")
    return 0


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("BENCH_COMMIT", "")


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
