"""Runs the scenarios: private servers, clients, faults, sweep, checker."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks.faults import checker, db
from benchmarks.faults.scenarios import SEMAPHORES, Scenario

REPO = Path(__file__).resolve().parents[2]
GRACE = 20.0  # seconds past the deadline a client may take to finish


def servers_module() -> ModuleType:
    """``scripts/servers.py`` (not a package), loaded by path."""
    spec = importlib.util.spec_from_file_location("semaphore_servers", REPO / "scripts/servers.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def own_runtime_dir() -> Path:
    """Where this suite's servers live: a runtime dir nested in the one
    ``scripts/servers.py`` owns, so ``servers.py stop`` (and the end of
    ``scripts/test``) stops them with the others."""
    return Path(servers_module().runtime_dir()) / "faults"


@dataclass
class Servers:
    """This suite's own MariaDB and Redis, never the test suite's."""

    runtime_dir: str
    mariadb_port: int
    redis_port: int
    module: ModuleType = field(default_factory=servers_module)

    @contextmanager
    def environ(self) -> Iterator[None]:
        """scripts/servers.py reads its ports from the environment: point it
        at ours for one call, then put back what was there (the test suite's)."""
        ours = {
            "SEMAPHORE_RUNTIME_DIR": self.runtime_dir,
            "SEMAPHORE_MARIADB_PORT": str(self.mariadb_port),
            "SEMAPHORE_REDIS_PORT": str(self.redis_port),
        }
        saved = {name: os.environ.get(name) for name in ours}
        os.environ.update(ours)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def start(self) -> None:
        with self.environ():
            self.module.start(["mariadb", "redis"])

    def restart_mariadb(self, hard: bool) -> None:
        with self.environ():
            self.module.restart_mariadb(hard)

    @property
    def url(self) -> str:
        return db.database_url(self.mariadb_port)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"


class Clients:
    """The client processes of one scenario, forked by a zygote; killed ones
    are replaced while the scenario runs."""

    def __init__(self, scenario: Scenario, env: dict[str, str], out: Path):
        self.scenario = scenario
        self.out = out
        self.go = out / "go"
        self.deadline = time.monotonic() + 3600.0  # set by go_when_ready()
        self.slots: list[int | None] = [None] * scenario.clients
        self.generation = [0] * scenario.clients
        self.histories: list[Path] = []
        self.exited: dict[int, int] = {}
        self.offsets: dict[Path, int] = {}
        self.counted = 0
        self.killed = 0
        self.crashed = 0
        self.lock = threading.Lock()
        self.zygote = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.faults.zygote"],
            env=env,
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.spawned: dict[int, int] = {}  # slot -> pid, as reported
        self.reported = threading.Condition()
        self.reader = threading.Thread(target=self._read_reports, daemon=True)
        self.reader.start()

    def _read_reports(self) -> None:
        assert self.zygote.stdout is not None
        for line in self.zygote.stdout:
            kind, first, second = line.split()
            with self.reported:
                if kind == "spawned":
                    self.spawned[int(first)] = int(second)
                else:
                    self.exited[int(first)] = int(second)
                self.reported.notify_all()

    def spawn(self, slot: int) -> None:
        self.generation[slot] += 1
        name = f"c{slot}.{self.generation[slot]}"
        history = self.out / f"{name}.jsonl"
        self.histories.append(history)
        config = {
            "slot": slot,
            "name": name,
            "history": str(history),
            "seed": random.randrange(2**32),
            "go": str(self.go),
            "fault": self.scenario.fault,
            "mix": self.scenario.mix,
            "hold": self.scenario.hold,
        }
        with self.reported:
            self.spawned.pop(slot, None)
            assert self.zygote.stdin is not None
            self.zygote.stdin.write(json.dumps(config) + "\n")
            self.zygote.stdin.flush()
            if not self.reported.wait_for(lambda: slot in self.spawned, timeout=30):
                raise RuntimeError("the zygote did not fork a client")
            self.slots[slot] = self.spawned[slot]

    def start(self) -> None:
        for slot in range(len(self.slots)):
            self.spawn(slot)

    def go_when_ready(self, seconds: float, timeout: float = 60.0) -> None:
        """Wait until every client has connected, then start them all together
        for ``seconds``."""
        limit = time.monotonic() + timeout
        while time.monotonic() < limit:
            ready = sum(1 for path in self.histories if path.exists() and path.stat().st_size > 0)
            if ready >= len(self.slots):
                break
            time.sleep(0.02)
        self.deadline = time.monotonic() + seconds
        tmp = self.go.with_suffix(".tmp")
        tmp.write_text(repr(self.deadline))
        tmp.rename(self.go)

    def attempts(self) -> int:
        """Acquire attempts so far, counted from the histories' new bytes."""
        for path in self.histories:
            offset = self.offsets.get(path, 0)
            try:
                with path.open("rb") as history:
                    history.seek(offset)
                    chunk = history.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n") + 1
            self.offsets[path] = offset + end
            self.counted += chunk[:end].count(b'"e":"inv"')
        return self.counted

    def stop_now(self) -> None:
        """Clients finish their operation in hand and leave."""
        self.go.with_name("stop").touch()
        self.deadline = min(self.deadline, time.monotonic())

    def _note_exit(self, pid: int) -> None:
        code = self.exited.get(pid)
        if code == -signal.SIGKILL:
            self.killed += 1
        elif code != 0:
            self.crashed += 1  # a client must survive every fault without restarting

    def supervise(self) -> None:
        """Replace clients that died (SIGKILL) while there is time left."""
        for slot, pid in enumerate(self.slots):
            if pid is not None and pid in self.exited:
                self._note_exit(pid)
                self.slots[slot] = None
                if time.monotonic() < self.deadline - 0.5:
                    self.spawn(slot)

    def live(self) -> list[int]:
        return [pid for pid in self.slots if pid is not None and pid not in self.exited]

    def arm(self) -> None:
        live = self.live()
        if live:
            with suppress(ProcessLookupError):
                os.kill(random.choice(live), signal.SIGUSR1)

    def continue_stopped(self, older_than: float, stopped_since: dict[int, float]) -> int:
        """SIGCONT clients stopped (by themselves) for ``older_than`` seconds."""
        resumed = 0
        now = time.monotonic()
        for pid in self.live():
            if process_state(pid) == "T":
                since = stopped_since.setdefault(pid, now)
                if now - since >= older_than:
                    os.kill(pid, signal.SIGCONT)
                    stopped_since.pop(pid, None)
                    resumed += 1
            else:
                stopped_since.pop(pid, None)
        return resumed

    def finish(self) -> int:
        """Wait for every client to leave; kill what is still there."""
        for pid in self.live():
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert self.zygote.stdin is not None
        self.zygote.stdin.close()
        leftover = 0
        try:
            self.zygote.wait(timeout=max(1.0, self.deadline + GRACE - time.monotonic()))
        except subprocess.TimeoutExpired:
            for pid in self.live():
                leftover += 1
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.zygote.wait(timeout=30)
        self.reader.join(timeout=5)
        for pid in self.slots:
            if pid is not None:
                self._note_exit(pid)
        return leftover


def process_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "?"


# --- nemeses -------------------------------------------------------------------


def hog_locks(url: str, stop: threading.Event, names: list[str], hold: float, faults: list[int]):
    """Hold the hot rows' locks longer than the clients' bounded lock wait."""
    conn = db.connect(url)
    cur = conn.cursor()
    while not stop.is_set():
        name = random.choice(names)
        try:
            cur.execute("BEGIN")
            cur.execute(
                "SELECT id FROM django_semaphore_semaphore WHERE name = %s FOR UPDATE", [name]
            )
            faults[0] += 1
            stop.wait(hold)
            cur.execute("COMMIT")
        except Exception:
            conn = db.connect(url)
            cur = conn.cursor()
        stop.wait(random.uniform(0.4, 1.2))
    conn.close()


def hog_deadlocks(url: str, stop: threading.Event, pairs: list[tuple[str, str]], faults: list[int]):
    """Lock hot rows in descending name order (the app locks ascending), after a
    write that makes this session the heavier one, so InnoDB picks the app's
    transaction as the deadlock victim."""
    conn = db.connect(url)
    cur = conn.cursor()
    while not stop.is_set():
        high, low = sorted(random.choice(pairs), reverse=True)
        try:
            cur.execute("BEGIN")
            cur.execute("UPDATE faults_hog SET n = n + 1 WHERE id = 1")
            cur.execute(
                "SELECT id FROM django_semaphore_semaphore WHERE name = %s FOR UPDATE", [high]
            )
            time.sleep(random.uniform(0.001, 0.01))
            cur.execute(
                "SELECT id FROM django_semaphore_semaphore WHERE name = %s FOR UPDATE", [low]
            )
            cur.execute("COMMIT")
        except Exception:
            try:
                cur.execute("ROLLBACK")
            except Exception:
                conn = db.connect(url)
                cur = conn.cursor()
        stop.wait(random.uniform(0.0, 0.02))
    conn.close()


# --- one scenario --------------------------------------------------------------


def run_scenario(
    scenario: Scenario, servers: Servers, out: Path, ci: bool, log: Any = print
) -> dict[str, Any]:
    if scenario.nemesis == "celery":
        from benchmarks.faults import celery_run

        return celery_run.run(scenario, servers, out, ci, log)
    out.mkdir(parents=True, exist_ok=True)
    url = servers.url
    db.reset(url, SEMAPHORES)
    env = db.env_for(url, FAULTS_REDIS_URL=servers.redis_url, **scenario.env)
    seconds, target, least = scenario.budget(ci)
    deadlocks_before = db.status(url, "Innodb_deadlocks")
    clients = Clients(scenario, env, out)
    clients.start()
    clients.go_when_ready(seconds)
    began = time.monotonic()
    stop = threading.Event()
    faults = [0]
    threads = []
    if scenario.nemesis == "lock-hog":
        for _ in range(1):
            threads.append(
                threading.Thread(
                    target=hog_locks, args=(url, stop, ["hot-1", "hot-2"], 1.6, faults)
                )
            )
    elif scenario.nemesis == "deadlock-hog":
        pairs = [("hot-1", "hot-3"), ("hot-2", "hot-3"), ("hot-1", "hot-2")]
        for _ in range(2):
            threads.append(threading.Thread(target=hog_deadlocks, args=(url, stop, pairs, faults)))
    for thread in threads:
        thread.start()
    stopped_since: dict[int, float] = {}
    next_arm = began + 0.3
    next_restart = began + scenario.every / 2
    restarts = resumed = 0
    next_count = began + 0.5
    try:
        while time.monotonic() < clients.deadline:
            now = time.monotonic()
            if now >= next_count:
                next_count = now + 0.5
                if now - began >= least and clients.attempts() >= target:
                    clients.stop_now()
                    break
            clients.supervise()
            if scenario.arm_every and now >= next_arm:
                clients.arm()
                next_arm = now + scenario.arm_every * random.uniform(0.5, 1.5)
            if scenario.nemesis.startswith("restart") and now >= next_restart:
                if clients.deadline - now > 4:
                    log(f"  {scenario.name}: restarting MariaDB")
                    servers.restart_mariadb(hard=scenario.nemesis == "restart-hard")
                    restarts += 1
                next_restart = time.monotonic() + scenario.every
            if scenario.fault.get("action") == "sigstop":
                resumed += clients.continue_stopped(2.5, stopped_since)
            time.sleep(0.02)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    leftover = clients.finish()
    elapsed = time.monotonic() - began
    # The server's counter starts again from 0 when it restarts.
    deadlocks = 0 if restarts else db.status(url, "Innodb_deadlocks") - deadlocks_before
    # Let every TTL run out, then one sweep: what is still held afterwards leaked.
    time.sleep(checker.seconds_until_expired(url) + 0.1)
    before_sweep = checker.held(url)
    # Before the sweep, whose verifier would correct (and count) a drift.
    drift = checker.counter_drift(url)
    swept = json.loads(
        subprocess.run(
            [sys.executable, "-m", "benchmarks.faults.sweep_once"],
            env=env,
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    result = checker.check(url, clients.histories, drift)
    if clients.crashed:
        result["violations"]["client crashed"] = clients.crashed
        result["violation_total"] += clients.crashed
    injected = {
        "armed faults fired": result.pop("faults_fired"),
        "clients SIGKILLed": clients.killed,
        "MariaDB restarts": restarts,
        "InnoDB deadlocks": deadlocks,
        "hog lock holds": faults[0] if scenario.nemesis == "lock-hog" else 0,
        "SIGCONT after pause": resumed,
    }
    result.update(
        scenario=scenario.name,
        what=scenario.what,
        seconds=round(elapsed, 1),
        clients=scenario.clients,
        faults={k: v for k, v in injected.items() if v},
        held_before_sweep=before_sweep,
        sweep=swept,
        leftover_clients=leftover,
    )
    return result
