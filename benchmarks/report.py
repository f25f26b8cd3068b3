"""One table, the ratios the issue asks for, and the figures checked against
its targets (reported, never asserted: timings belong in a report, not a test)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from benchmarks import systems
from benchmarks.scenarios import Cell


def find(cells: list[Cell], scenario: str, system: str, clients: int | None = None) -> Cell | None:
    for cell in cells:
        if (
            cell.scenario.startswith(scenario)
            and cell.system == system
            and (clients is None or cell.clients == clients)
        ):
            return cell
    return None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or not b:
        return None
    return a / b


def add_ratios(cells: list[Cell]) -> None:
    """Each cell's cycles/s over the seed design's and the raw limit's, in the
    same scenario with the same clients (the limit: the hot row of scenario 1)."""
    for cell in cells:
        seed = find(cells, cell.scenario, systems.SEED, cell.clients)
        limit = find(cells, cell.scenario, systems.LIMIT_ROWS, cell.clients)
        if limit is None or cell.scenario.startswith("1"):
            limit = find(cells, "1", systems.LIMIT_HOT, cell.clients)
        cell.extra["x_seed"] = _round(ratio(cell.cycles_per_s, seed and seed.cycles_per_s))
        # The costs as ratios too (above 1: the cell costs more than the seed).
        for key, field in SEED_RATIOS.items():
            theirs = None if seed is None else getattr(seed, field)
            cell.extra[key] = _round(ratio(getattr(cell, field), theirs))
        cell.extra["x_limit"] = _round(ratio(cell.cycles_per_s, limit and limit.cycles_per_s))


# extra's key -> the Cell field it divides by the seed's, in the same cell.
SEED_RATIOS = {
    "x_seed_p50": "p50_ms",
    "x_seed_p99": "p99_ms",
    "x_seed_client_cpu": "client_cpu_ms",
    "x_seed_server_cpu": "server_cpu_ms",
    "x_seed_round_trips": "round_trips",
}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def table(cells: list[Cell]) -> str:
    header = (
        f"{'scenario':<20} {'system':<28} {'clients':<22} {'cycles/s':>9} {'p50 ms':>7}"
        f" {'p99 ms':>7} {'max ms':>7} {'reject':>7} {'err':>4} {'x seed':>6} {'x limit':>7}"
        f" {'fair':>5} {'cpu ms client':>13} {'server':>6} {'trips':>5}"
        f" {'x seed: p99 client server trips':>31}"
    )
    lines = [header, "-" * len(header)]
    for c in cells:
        lines.append(
            f"{c.scenario:<20} {c.system:<28} {c.layout:<22} {c.cycles_per_s:>9.0f}"
            f" {_ms(c.p50_ms):>7} {_ms(c.p99_ms):>7} {_ms(c.max_ms):>7} {c.rejections:>7}"
            f" {c.errors:>4} {_x(c.extra.get('x_seed')):>6} {_x(c.extra.get('x_limit')):>7}"
            f" {_x(c.jain):>5} {_ms(c.client_cpu_ms):>13} {_ms(c.server_cpu_ms):>6}"
            f" {_x(c.round_trips):>5} {_x(c.extra.get('x_seed_p99')):>13}"
            f" {_x(c.extra.get('x_seed_client_cpu')):>6} {_x(c.extra.get('x_seed_server_cpu')):>6}"
            f" {_x(c.extra.get('x_seed_round_trips')):>5}"
        )
        notes = {k: v for k, v in c.extra.items() if not k.startswith("x_")}
        if notes:
            lines.append(f"{'':<20} {notes}")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def checks(cells: list[Cell], held: int, history: int) -> list[dict[str, Any]]:
    """The issue's figures to reach, each with its measured value."""
    out: list[dict[str, Any]] = []

    def check(what: str, value: float | None, target: str, ok: bool | None) -> None:
        out.append({"figure": what, "value": _round(value), "target": target, "met": ok})

    most = max((c.clients for c in cells if c.scenario.startswith("1")), default=None)
    # Issue 16's figures: cycles/s, and CPU per cycle on each side (on a
    # shared 2-core machine the sides compete, so each is judged on its own).
    for scenario, label, cycles, server in [
        ("1", f"scenario 1 at {most} clients", 1.0, 0.9),
        ("2", "scenario 2", 0.8, 1.0),
    ]:
        app = find(cells, scenario, systems.APP, most if scenario == "1" else None)
        seed = find(cells, scenario, systems.SEED, most if scenario == "1" else None)
        r = ratio(app and app.cycles_per_s, seed and seed.cycles_per_s)
        check(f"{label}: app / seed cycles", r, f">= {cycles}", _at_least(r, cycles))
        for side, most_allowed in (("server", server), ("client", 1.8)):
            r = ratio(_cpu_ms(app, side), _cpu_ms(seed, side))
            check(
                f"{label}: app / seed {side} CPU per cycle",
                r,
                f"<= {most_allowed}",
                None if r is None else r <= most_allowed,
            )
    app3, seed3 = find(cells, "3", systems.APP), find(cells, "3", systems.SEED)
    r = ratio(app3 and app3.cycles_per_s, seed3 and seed3.cycles_per_s)
    check("multi(3): app / seed cycles", r, ">= 1.0", _at_least(r, 1.0))
    if most is not None:
        app16, seed16 = find(cells, "1", systems.APP, most), find(cells, "1", systems.SEED, most)
        r = ratio(app16 and app16.p99_ms, seed16 and seed16.p99_ms)
        check(f"scenario 1 at {most}: app / seed p99", r, "<= 2", None if r is None else r <= 2)
    app1, seed1 = find(cells, "1", systems.APP, 1), find(cells, "1", systems.SEED, 1)
    r = ratio(app1 and app1.p50_ms, seed1 and seed1.p50_ms)
    check("1 client: app / seed acquire p50", r, "<= 1.4", None if r is None else r <= 1.4)
    base = find(cells, "1", systems.APP, most)
    grown = find(cells, "4 history", systems.APP)
    r = ratio(grown and grown.cycles_per_s, base and base.cycles_per_s)
    check(f"{history:,} released: app / empty", r, ">= 0.9", None if r is None else r >= 0.9)
    for system, target in [(systems.APP, 0.9), (systems.SEED, None)]:
        full = find(cells, "4 held", system)
        empty = find(cells, "1", system, most)
        r = ratio(full and full.cycles_per_s, empty and empty.cycles_per_s)
        check(
            f"{held:,} held: {system} / 10 held",
            r,
            f">= {target}" if target else "(seed: for reference)",
            None if r is None or target is None else r >= target,
        )
    mutex_most = max((c.clients for c in cells if c.scenario == "mutex"), default=None)
    app_m = find(cells, "mutex", systems.APP, mutex_most)
    peer = find(cells, "mutex", systems.DB_MUTEX, mutex_most)
    r = ratio(app_m and app_m.cycles_per_s, peer and peer.cycles_per_s)
    check(
        f"capacity 1 at {mutex_most}: app / django-db-mutex",
        r,
        ">= 3",
        None if r is None else r >= 3,
    )
    for cell in cells:
        if cell.scenario.startswith("5") and "max_lock_waiting" in cell.extra:
            processes = int(cell.layout.split()[0]) if "proc" in cell.layout else 1
            per = cell.extra["max_lock_waiting"] / processes
            check(
                f"waiting, {cell.system}, {cell.layout}: lock-waiting transactions / process",
                per,
                "<= 1 (with the pre-lock)",
                per <= 1 if cell.system == systems.APP else None,
            )
    during = find(cells, "6", systems.APP)
    quiet = find(cells, "4 history", systems.APP)
    r = ratio(during and during.max_ms, quiet and quiet.p99_ms)
    check("clean-up: worst acquire / p99 without", r, "<= 3", None if r is None else r <= 3)
    ours = [c for c in cells if c.system in systems.APP_SYSTEMS or c.system == systems.SEED]
    errors = sum(c.errors for c in ours)
    check("errors (app and seed, every scenario)", errors, "0", errors == 0)
    return out


def _cpu_ms(cell: Cell | None, side: str) -> float | None:
    return None if cell is None else getattr(cell, f"{side}_cpu_ms")


def _at_least(value: float | None, target: float) -> bool | None:
    return None if value is None else value >= target


def checks_text(results: list[dict[str, Any]]) -> str:
    marks = {True: "met", False: "NOT MET", None: ""}
    return "\n".join(
        f"{marks[r['met']]:>8}  {r['figure']}: {_x(r['value'])} (target {r['target']})"
        for r in results
    )


def markdown(results: dict[str, Any]) -> str:
    """A results file as the Markdown tables of benchmarks/README.md."""
    meta = results.get("meta", {})
    lines = []
    if meta.get("commit_settings") is not None:
        lines += [
            f"Commits: {meta.get('commit_mode', 'server')} {meta['commit_settings']}"
            f" ({meta.get('database', '')}). The x seed columns divide by the seed's"
            " figure in the same scenario with the same clients.",
            "",
        ]
    lines += [
        "| scenario | system | clients | cycles/s | p50 ms | p99 ms | max ms | rejected"
        " | errors | client CPU ms | server CPU ms | round trips | x seed cycles/s"
        " | x seed p50 | x seed p99 | x seed client CPU | x seed server CPU | x seed round trips"
        " | x limit |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for c in results["cells"]:
        extra = c["extra"]
        seed = " | ".join(_x(extra.get(key)) for key in ("x_seed", *SEED_RATIOS))
        lines.append(
            f"| {c['scenario']} | {c['system']} | {c['layout']} | {c['cycles_per_s']:,.0f}"
            f" | {_ms(c['p50_ms'])} | {_ms(c['p99_ms'])} | {_ms(c['max_ms'])}"
            f" | {c['rejections']:,} | {c['errors']} | {_ms(c.get('client_cpu_ms'))}"
            f" | {_ms(c.get('server_cpu_ms'))} | {_x(c.get('round_trips'))} | {seed}"
            f" | {_x(extra.get('x_limit'))} |"
        )
    lines += ["", "| figure | measured | target | met |", "|---|--:|---|---|"]
    marks = {True: "yes", False: "**no**", None: ""}
    for r in results["checks"]:
        lines.append(f"| {r['figure']} | {_x(r['value'])} | {r['target']} | {marks[r['met']]} |")
    return "\n".join(lines)


def as_json(cells: list[Cell]) -> list[dict[str, Any]]:
    return [asdict(c) for c in cells]
