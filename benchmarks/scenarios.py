"""The scenarios of issue 7, each a list of cells (one system, one load).

Every cell starts from empty tables plus exactly the data it needs, runs its
clients for the same fixed duration, and is stored with its figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks import cpu, db, systems
from benchmarks.fixtures import Data
from benchmarks.runner import ClientResult, Pool
from benchmarks.systems import ClientSpec

HOT_CAPACITY = 10
HOT_WAIT_TIMEOUT = 10.0
HOT_WAIT_HOLD = 0.01
# InnoDB refreshes information_schema.innodb_trx at most every 0.1 s.
MONITOR_EVERY = 0.02


@dataclass
class Options:
    url: str
    redis_url: str
    mode: str = "processes"  # or "threads"
    duration: float = 5.0
    clients: list[int] = field(default_factory=lambda: [1, 4, 16])
    mutex_clients: list[int] = field(default_factory=lambda: [1, 16])
    many: int = 16  # scenario 2: semaphores = clients
    multi_clients: int = 16
    history: int = 1_000_000
    held: int = 5_000
    waiting_threads: int = 64
    waiting_processes: int = 4
    repeat: int = 1  # runs per cell; the median (by cycles/s) is reported
    scenarios: list[str] = field(default_factory=list)

    @property
    def most_clients(self) -> int:
        return max([*self.clients, *self.mutex_clients, self.many, self.multi_clients])


@dataclass
class Cell:
    scenario: str
    system: str
    clients: int
    layout: str  # "16 processes", "1 process x 64 threads"
    capacity: int
    cycles: int = 0
    cycles_per_s: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    rejections: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    jain: float | None = None
    client_cpu_ms: float | None = None  # client CPU per completed cycle
    server_cpu_ms: float | None = None  # database server CPU per completed cycle
    round_trips: float | None = None  # statements sent per completed cycle (client-counted)
    extra: dict[str, Any] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def summarize(cell: Cell, results: list[ClientResult]) -> Cell:
    latencies = [x for r in results for x in r.latencies]
    elapsed = statistics.mean(r.elapsed for r in results) if results else 0.0
    cell.cycles = sum(r.cycles for r in results)
    cell.cycles_per_s = cell.cycles / elapsed if elapsed else 0.0
    if latencies:
        cell.p50_ms = percentile(latencies, 0.50) * 1000
        cell.p99_ms = percentile(latencies, 0.99) * 1000
        cell.max_ms = max(latencies) * 1000
    cell.rejections = sum(r.rejections for r in results)
    for r in results:
        for kind, n in r.errors.items():
            cell.error_kinds[kind] = cell.error_kinds.get(kind, 0) + n
    cell.errors = sum(cell.error_kinds.values())
    if cell.cycles:
        cell.client_cpu_ms = sum(r.cpu for r in results) / cell.cycles * 1000
        cell.round_trips = sum(r.round_trips for r in results) / cell.cycles
    per_client = [r.cycles for r in results]
    if sum(per_client):
        # Jain's fairness index: 1 = every client got the same share.
        cell.jain = sum(per_client) ** 2 / (len(per_client) * sum(x * x for x in per_client))
    return cell


class Bench:
    def __init__(self, options: Options, say: Callable[[str], None]) -> None:
        self.options = options
        self.say = say
        self.target = db.Target.parse(options.url)
        self.data = Data(self.target)
        self.cells: list[Cell] = []
        workers = 1 if options.mode == "threads" else options.most_clients
        if options.mode == "processes":
            workers = max(workers, options.waiting_processes)
        self.pool = Pool(options.url, workers)
        self.server_clock = cpu.ServerClock(self.target)
        self.available = self._available_systems()

    def _available_systems(self) -> set[str]:
        from django.conf import settings
        from django.db import connection

        from django_semaphore.engine.statements import routines

        found = {
            systems.LIMIT_HOT,
            systems.LIMIT_ROWS,
            systems.SEED,
            systems.APP,
            systems.APP_NO_PRELOCK,
        }
        try:
            import django_semaphore

            if hasattr(django_semaphore, "permit"):
                found.add(systems.APP_PERMIT)
        except ImportError:  # pragma: no cover
            pass
        if "db_mutex" in settings.INSTALLED_APPS:
            found.add(systems.DB_MUTEX)
        if self.target.vendor in {"mysql", "postgresql"}:
            found.add(systems.GET_LOCK)
        if routines.names_on(connection):
            found.add(systems.APP_SQL)
        try:
            import redis

            redis.Redis.from_url(self.options.redis_url, socket_connect_timeout=1).ping()
            found.add(systems.REDIS)
        except Exception:
            pass
        return found

    # --- one cell ---------------------------------------------------------

    def measure(
        self,
        scenario: str,
        system: str,
        clients: int,
        names_of: Callable[[int], list[str]],
        capacity: int,
        *,
        processes: int | None = None,
        hold: float = 0.0,
        timeout: float = 0.0,
        alongside: Callable[[float, float], dict[str, Any]] | None = None,
        duration: float | None = None,
    ) -> Cell | None:
        if system not in self.available:
            return None
        if processes is None:
            processes = 1 if self.options.mode == "threads" else clients
        specs = [
            ClientSpec(
                system=system,
                url=self.options.url,
                index=i,
                names=sorted(names_of(i)),
                hold=hold,
                timeout=timeout,
                redis_url=self.options.redis_url,
            )
            for i in range(clients)
        ]
        assignment: list[list[ClientSpec]] = [[] for _ in range(processes)]
        for i, spec in enumerate(specs):
            assignment[i % processes].append(spec)
        per = clients // processes
        layout = f"{clients} processes" if per == 1 else f"{processes} proc x {per} threads"
        runs = []
        for _ in range(self.options.repeat):
            results, extra = self.pool.run(
                assignment, duration or self.options.duration, alongside=self._timed(alongside)
            )
            run = summarize(Cell(scenario, system, clients, layout, capacity), results)
            server_cpu = extra.pop("server_cpu_per_s", None)
            if server_cpu is not None and run.cycles_per_s:
                run.server_cpu_ms = server_cpu / run.cycles_per_s * 1000
            run.extra.update(extra)
            runs.append(run)
        # The median run: neighbours on a shared machine make single runs noisy.
        cell = sorted(runs, key=lambda r: r.cycles_per_s)[len(runs) // 2]
        if len(runs) > 1:
            cell.extra["runs_cycles_per_s"] = [round(r.cycles_per_s) for r in runs]
            cell.errors = sum(r.errors for r in runs)
        self.cells.append(cell)
        self.say(_line(cell))
        return cell

    def _timed(
        self, alongside: Callable[[float, float], dict[str, Any]] | None
    ) -> Callable[[float, float], dict[str, Any]] | None:
        """``alongside``, plus the server's CPU time per second of the window.

        The last sample is taken a little before the end: clients close their
        connections at the end, and a PostgreSQL backend's time vanishes from
        ``/proc`` between its exit and the postmaster reaping it.
        """
        if not self.server_clock.available:
            return alongside

        def run(start: float, end: float) -> dict[str, Any]:
            time.sleep(max(0.0, start - time.time()))
            first, before = time.time(), self.server_clock.seconds()
            extra = alongside(start, end) if alongside is not None else {}
            time.sleep(max(0.0, end - min(0.25, (end - start) / 4) - time.time()))
            last, after = time.time(), self.server_clock.seconds()
            if before is not None and after is not None and last > first:
                extra["server_cpu_per_s"] = (after - before) / (last - first)
            return extra

        return run

    def fresh(self, names: list[str], capacity: int) -> None:
        self.data.reset()
        self.data.create_semaphores(names, capacity)

    def wanted(self, scenario: str) -> bool:
        return not self.options.scenarios or scenario in self.options.scenarios

    # --- the scenarios ----------------------------------------------------

    def run(self) -> list[Cell]:
        self.data.create_schema()
        for name, scenario in SCENARIOS.items():
            if self.wanted(name):
                self.say(f"-- {name}")
                scenario(self)
        return self.cells

    def hot(self) -> None:
        """(1) One hot semaphore, capacity 10, 1 / 4 / 16 clients; then
        ``hot_waiting`` (unless it runs on its own)."""
        for clients in self.options.clients:
            for system in [
                systems.LIMIT_HOT,
                systems.LIMIT_ROWS,
                systems.SEED,
                systems.APP,
                systems.APP_PERMIT,
                systems.APP_SQL,
            ]:
                self.fresh(["hot"], HOT_CAPACITY)
                self.measure("1 hot", system, clients, lambda i: ["hot"], HOT_CAPACITY)
        if not self.wanted("hot-waiting"):
            self.hot_waiting()

    def hot_waiting(self) -> None:
        """(1, waiting) The most clients of scenario 1 on a quarter of their
        number of permits, each holding its permit 10 ms and waiting
        (``timeout=``, in line) when there is no room, against the seed's SQL
        with the same holds, retrying at once when refused (what this
        machine's clients and server make of the ideal)."""
        most = max(self.options.clients)
        if most <= 1:
            return
        capacity = max(1, most // 4)
        for system in [systems.SEED, systems.APP]:
            self.fresh(["hot"], capacity)
            self.measure(
                "1 hot, waiting",
                system,
                most,
                lambda i: ["hot"],
                capacity,
                hold=HOT_WAIT_HOLD,
                timeout=HOT_WAIT_TIMEOUT,
            )

    def queued(self) -> None:
        """(7) Threads of one process waiting on a semaphore that stays full:
        the database statements they issue per second, with this process's
        one poller per semaphore and with every waiter polling ("lines off")."""
        from benchmarks.queued import measure_waiting

        seconds = max(self.options.duration, 1.0)
        for lines in [True, False]:
            self.fresh(["queued"], 1)
            threads = self.options.waiting_threads
            layout = f"1 proc x {threads} threads" + ("" if lines else ", lines off")
            cell = Cell("7 queued", systems.APP, threads, layout, 1)
            cell.extra.update(measure_waiting("queued", threads, seconds, lines=lines))
            cell.errors = len(cell.extra["errors"])
            self.cells.append(cell)
            self.say(_line(cell))

    def mutex(self) -> None:
        """Capacity 1: the app as a mutex against the mutex peers."""
        for clients in self.options.mutex_clients:
            for system in [
                systems.SEED,
                systems.APP,
                systems.APP_PERMIT,
                systems.DB_MUTEX,
                systems.GET_LOCK,
                systems.REDIS,
            ]:
                self.fresh(["mutex"], 1)
                self.measure("mutex", system, clients, lambda i: ["mutex"], 1)

    def many(self) -> None:
        """(2) As many semaphores as clients, each client on its own."""
        clients = self.options.many
        names = [f"sem-{i:02d}" for i in range(clients)]
        for system in [systems.LIMIT_ROWS, systems.SEED, systems.APP]:
            self.fresh(names, HOT_CAPACITY)
            self.measure("2 many", system, clients, lambda i: [names[i]], HOT_CAPACITY)

    def multi(self) -> None:
        """(3) Every acquire takes 3 semaphores at once."""
        names = ["multi-a", "multi-b", "multi-c"]
        for system in [systems.SEED, systems.APP]:
            self.fresh(names, HOT_CAPACITY)
            self.measure(
                "3 multi(3)", system, self.options.multi_clients, lambda i: names, HOT_CAPACITY
            )

    def held(self) -> None:
        """(4b) The hot scenario with many permits held (capacity raised to match)."""
        clients = max(self.options.clients)
        for system in [systems.SEED, systems.APP]:
            self.fresh(["hot"], HOT_CAPACITY)
            self.data.add_permits("hot", self.options.held, held=True, prefix="held")
            capacity = HOT_CAPACITY + self.options.held
            cell = self.measure(
                f"4 held {self.options.held:,}", system, clients, lambda i: ["hot"], capacity
            )
            if cell is not None:
                cell.extra["plan"] = self.data.plans("hot")[
                    "app" if system == systems.APP else "seed"
                ]
            assert cell is None or self.data.held_now("hot") == self.options.held

    def history(self) -> None:
        """(4a) The hot scenario over a long history of released requests, then
        (6) the same while the retention clean-up deletes that history."""
        clients = max(self.options.clients)
        self.fresh(["hot"], HOT_CAPACITY)
        started = time.monotonic()
        self.data.add_permits("hot", self.options.history, held=False, prefix="hist")
        self.say(f"   seeded {self.options.history:,} released requests ({_since(started)})")
        label = f"4 history {self.options.history:,}"
        for system in [systems.SEED, systems.APP]:
            cell = self.measure(label, system, clients, lambda i: ["hot"], HOT_CAPACITY)
            if cell is not None:
                cell.extra["plan"] = self.data.plans("hot")[
                    "app" if system == systems.APP else "seed"
                ]
        self.measure(
            "6 during clean-up",
            systems.APP,
            clients,
            lambda i: ["hot"],
            HOT_CAPACITY,
            alongside=self.cleanup_alongside,
        )

    def waiting(self) -> None:
        """(5) Many threads of one process waiting on a full semaphore with
        ``timeout=``: how many DB transactions wait on the row lock."""
        threads, capacity, hold, timeout = self.options.waiting_threads, 2, 0.01, 2.0
        layouts: list[tuple[str, int]] = [(systems.APP, 1), (systems.APP_NO_PRELOCK, 1)]
        if self.options.mode == "processes":
            layouts.append((systems.APP, self.options.waiting_processes))
        for system, processes in layouts:
            self.fresh(["wait"], capacity)
            self.measure(
                "5 waiting",
                system,
                threads,
                lambda i: ["wait"],
                capacity,
                processes=processes,
                hold=hold,
                timeout=timeout,
                alongside=self.monitor_alongside,
            )

    # --- what runs in the driver alongside the clients ---------------------

    def monitor_alongside(self, start: float, end: float) -> dict[str, Any]:
        """Sample the benchmark database's open and lock-waiting transactions."""
        if self.target.vendor == "sqlite":
            return {"lock_waits": "n/a on SQLite"}
        conn = db.connect(self.target, autocommit=True)
        cursor = conn.cursor()
        if self.target.vendor == "mysql":
            query = (
                "SELECT COALESCE(SUM(t.trx_state = 'LOCK WAIT'), 0), COUNT(*)"
                " FROM information_schema.innodb_trx t"
                " JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id"
                " WHERE p.db = %s AND p.id <> CONNECTION_ID()"
            )
        else:
            query = (
                "SELECT count(*) FILTER (WHERE wait_event_type = 'Lock'),"
                " count(*) FILTER (WHERE xact_start IS NOT NULL)"
                " FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"
            )
        waiting: list[int] = []
        open_: list[int] = []
        while time.time() < start:
            time.sleep(0.001)
        while time.time() < end:
            cursor.execute(query, [self.target.name])
            w, o = cursor.fetchone()
            waiting.append(int(w))
            open_.append(int(o))
            time.sleep(MONITOR_EVERY)
        conn.close()
        return {
            "samples": len(waiting),
            "max_lock_waiting": max(waiting, default=0),
            "mean_lock_waiting": round(statistics.mean(waiting), 2) if waiting else 0,
            "max_open_transactions": max(open_, default=0),
        }

    def cleanup_alongside(self, start: float, end: float) -> dict[str, Any]:
        """The retention clean-up (``sweep.clean_released``: batches of
        ``CLEANUP_BATCH_SIZE``, each its own short transaction) over the window."""
        from django.db import connections

        from django_semaphore.sweep import clean_released

        while time.time() < start:
            time.sleep(0.001)
        batch_times: list[float] = []
        last = time.perf_counter()

        def progress(_: object) -> None:
            nonlocal last
            now = time.perf_counter()
            batch_times.append(now - last)
            last = now

        try:
            report = clean_released(time_budget=max(0.0, end - time.time()), progress=progress)
        finally:
            connections.close_all()
        return {
            "cleanup_deleted_requests": report.deleted,
            "cleanup_deleted_permits": report.permits,
            "cleanup_batches": report.batches,
            "cleanup_slowest_batch_ms": round(max(batch_times, default=0) * 1000, 1),
        }


def _since(started: float) -> str:
    return f"{time.monotonic() - started:.1f}s"


def _line(cell: Cell) -> str:
    p50 = "-" if cell.p50_ms is None else f"{cell.p50_ms:.2f}"
    p99 = "-" if cell.p99_ms is None else f"{cell.p99_ms:.2f}"
    extra = f" {cell.extra}" if cell.extra else ""
    errors = f" errors={cell.errors} {list(cell.error_kinds)[:2]}" if cell.errors else ""
    return (
        f"   {cell.system:<28} {cell.layout:<22} {cell.cycles_per_s:>8.0f}/s"
        f" p50 {p50} p99 {p99} rej {cell.rejections}{errors}{extra}"
    )


SCENARIOS: dict[str, Callable[[Bench], None]] = {
    "hot": Bench.hot,
    "hot-waiting": Bench.hot_waiting,
    "mutex": Bench.mutex,
    "many": Bench.many,
    "multi": Bench.multi,
    "held": Bench.held,
    "history": Bench.history,
    "waiting": Bench.waiting,
    "queued": Bench.queued,
}
