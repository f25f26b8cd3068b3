#!/usr/bin/env python3
"""Private, throw-away database servers for the test suite.

The suite needs a real MariaDB, PostgreSQL and Redis, but must never touch a
machine's own services: each server here runs on loopback, on its own port,
with its data, logs and pid files under one runtime directory that can be
deleted at any time.  Everything is idempotent, so the test command and CI can
simply call ``start`` every time.

    python3 scripts/servers.py start [mariadb] [postgres] [redis] [galera]   # default: all
    python3 scripts/servers.py stop     # every server under the runtime dir
    python3 scripts/servers.py env      # `export SEMAPHORE_*_URL=...` lines
    python3 scripts/servers.py leftovers RUN_ID   # fail if a process of the run lives

``start`` prints the same ``export`` lines as ``env`` (for the servers it
started), so ``eval "$(python3 scripts/servers.py start)"`` works.  Progress
and errors go to stderr.

Configuration (environment):
    SEMAPHORE_RUNTIME_DIR    default: <repo>/.runtime
    SEMAPHORE_MARIADB_PORT   default: 33061
    SEMAPHORE_POSTGRES_PORT  default: 54321
    SEMAPHORE_REDIS_PORT     default: 63791
    SEMAPHORE_GALERA_PORT    default: 33071 (SQL port of node 1; nodes 2, 3: +1, +2)
    SEMAPHORE_GALERA_GROUP_PORT  default: 45671 (group communication of node 1;
                             incremental state transfer +10, snapshot transfer +20)

``galera`` is a 3-node MariaDB Galera cluster (multi-primary) on loopback, data
under <runtime>/galera/node{1,2,3}; besides SEMAPHORE_GALERA_URL (node 1) it
exports SEMAPHORE_GALERA_URLS, the three nodes' URLs separated by commas.

A runtime dir may hold other runtime dirs one level down (the fault suite
keeps its own MariaDB and Redis in <runtime>/faults, since it kills them):
``stop`` stops those too, and then fails if any process still works in the
runtime dir, so nothing a test run started outlives it unnoticed.

Stdlib only: this runs before any virtualenv exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVERS = ("mariadb", "postgres", "redis", "galera")
DEFAULT_PORTS = {
    "mariadb": 33061,
    "postgres": 54321,
    "redis": 63791,
    "galera": 33071,
    "galera_group": 45671,
}
PACKAGES = {
    "mariadb": ("mariadb-server",),
    "postgres": ("postgresql",),
    "redis": ("redis-server",),
    # rsync is what the snapshot transfer to a joining node uses.
    # rsync is what a joining node receives its snapshot with.
    "galera": ("mariadb-server", "galera-4", "rsync"),
}
GALERA_NODES = (1, 2, 3)
GALERA_PROVIDERS = ("/usr/lib/galera/libgalera_smm.so", "/usr/lib/libgalera_smm.so")
START_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0
INITIALISED = ".initialised"  # written only once a data dir is fully set up

# Durability is off: the cluster is thrown away anyway, and tests run faster.
POSTGRES_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
}

MARIADB_SETUP_SQL = (
    """
CREATE USER IF NOT EXISTS 'root'@'127.0.0.1';
GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;
"""
    + "".join(
        f"""
CREATE USER IF NOT EXISTS 'semaphore'@'{host}' IDENTIFIED BY 'semaphore';
ALTER USER 'semaphore'@'{host}' IDENTIFIED BY 'semaphore';
GRANT ALL PRIVILEGES ON *.* TO 'semaphore'@'{host}' WITH GRANT OPTION;
"""
        for host in ("%", "localhost", "127.0.0.1")
    )
    + """
CREATE DATABASE IF NOT EXISTS semaphore;
"""
)


class ServerError(RuntimeError):
    """A server could not be provided; the message says why and what to do."""


# ---------------------------------------------------------------- configuration


def runtime_dir() -> Path:
    """Root of everything this script writes; read on each call so callers can
    point it elsewhere through the environment."""
    configured = os.environ.get("SEMAPHORE_RUNTIME_DIR")
    return Path(configured).resolve() if configured else REPO / ".runtime"


def port(name: str) -> int:
    """The loopback port for `name`, overridable so parallel checkouts can coexist."""
    variable = f"SEMAPHORE_{name.upper()}_PORT"
    value = os.environ.get(variable, str(DEFAULT_PORTS[name]))
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ServerError(f"{variable}={value!r} is not a port number")
    return int(value)


def urls() -> dict[str, str]:
    """Connection URLs of the servers, keyed by server name (Galera: node 1)."""
    return {
        "mariadb": f"mysql://semaphore:semaphore@127.0.0.1:{port('mariadb')}/semaphore",
        "postgres": f"postgres://semaphore@127.0.0.1:{port('postgres')}/semaphore",
        "redis": f"redis://127.0.0.1:{port('redis')}/0",
        "galera": galera_urls()[0],
    }


def galera_urls() -> list[str]:
    """One URL per Galera node, node 1 first."""
    return [
        f"mysql://semaphore:semaphore@127.0.0.1:{_galera_port(node)}/semaphore"
        for node in GALERA_NODES
    ]


def env_lines(server_urls: dict[str, str]) -> str:
    """Shell `export` lines for `server_urls`, in the form the test settings read."""
    lines = [f"export SEMAPHORE_{name.upper()}_URL={url}" for name, url in server_urls.items()]
    if "galera" in server_urls:
        lines.append(f"export SEMAPHORE_GALERA_URLS={','.join(galera_urls())}")
    return "\n".join(lines)


# ---------------------------------------------------------------- small helpers


def _say(message: str) -> None:
    """Progress goes to stderr: stdout is reserved for the `export` lines."""
    print(message, file=sys.stderr, flush=True)


def _run(
    cmd: Sequence[str | Path], *, cwd: Path | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a helper quietly; on failure raise with its output, which says why."""
    args = [str(part) for part in cmd]
    try:
        result = subprocess.run(
            args, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True
        )
    except FileNotFoundError:
        raise ServerError(f"{args[0]} not found; is it installed?") from None
    if check and result.returncode != 0:
        output = (result.stdout + result.stderr).strip()
        raise ServerError(f"`{shlex.join(args)}` failed (exit {result.returncode}):\n{output}")
    return result


def _succeeds(cmd: Sequence[str | Path]) -> bool:
    """True when `cmd` exits 0; for probes whose failure is an answer, not an error."""
    return _run(cmd, check=False).returncode == 0


def _alive(pid: int) -> bool:
    """Whether any thread of process `pid` still runs.  Reads /proc rather than
    using kill(pid, 0) because a dead server stays a zombie until its parent
    reaps it, which may be never.  Threads matter: after SIGKILL the main thread
    turns zombie first, while the others still hold the port and the files."""
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):
            if stat.read_text().rpartition(")")[2].split()[0] != "Z":
                return True
    return False


def _read_pid(pid_file: Path) -> int | None:
    """The pid in `pid_file`, or None if it is missing or garbled."""
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _live_pid(pid_file: Path, is_ours: Callable[[int], bool]) -> int | None:
    """The pid in `pid_file` if that process is alive and ours; otherwise the file
    is stale (a crash, a reboot, a recycled pid) and is removed."""
    pid = _read_pid(pid_file)
    if pid is not None and _alive(pid) and is_ours(pid):
        return pid
    pid_file.unlink(missing_ok=True)
    return None


def _port_in_use(number: int) -> bool:
    """Whether something already listens on 127.0.0.1:`number`."""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", number)) == 0


def _require_free(name: str) -> None:
    """Refuse to start on a port someone else owns, rather than fail obscurely later."""
    if _port_in_use(port(name)):
        raise ServerError(
            f"port {port(name)} is in use by a process that is not our {name}; stop it "
            f"or choose another port with SEMAPHORE_{name.upper()}_PORT"
        )


def _log_tail(log: Path, lines: int = 30) -> str:
    """The end of a log, to put the server's own explanation into our error."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log written)"


def _wait_until_ready(
    name: str,
    ready: Callable[[], bool],
    log: Path,
    died: Callable[[], bool] = lambda: False,
) -> None:
    """Poll `ready` until it holds; fail at once if the server died, else on timeout."""
    deadline = time.monotonic() + START_TIMEOUT
    while not ready():
        if died():
            raise ServerError(f"{name} exited during start-up; end of {log}:\n{_log_tail(log)}")
        if time.monotonic() > deadline:
            raise ServerError(
                f"{name} did not answer within {START_TIMEOUT:.0f}s; "
                f"end of {log}:\n{_log_tail(log)}"
            )
        time.sleep(0.1)


def _wait_gone(pid: int, timeout: float) -> bool:
    """Wait for `pid` to exit, so its port and data dir are free again."""
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _shut_down(name: str, pid: int, polite: Sequence[str | Path]) -> None:
    """Ask the server to shut down; if it will not, signal it, and finally kill it.
    A clean shutdown keeps the next start fast (no crash recovery)."""
    if not _succeeds(polite) and _alive(pid):
        os.kill(pid, signal.SIGTERM)
    if not _wait_gone(pid, STOP_TIMEOUT):
        _say(f"{name}: no clean shutdown after {STOP_TIMEOUT:.0f}s, killing pid {pid}")
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, 10)


def _spawn_detached(cmd: Sequence[str | Path], log: Path) -> int:
    """Start a server that outlives us: own session, no stdin, output to its log.
    A daemon thread waits on it, which reaps it if it dies while we still run
    and keeps Popen from warning that it was dropped while the child lives."""
    with log.open("ab") as output:
        process = subprocess.Popen(
            [str(part) for part in cmd],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            start_new_session=True,
        )
    threading.Thread(target=process.wait, daemon=True).start()
    return process.pid


def _fresh_data_dir(home: Path, data: Path, initialise: Callable[[], None]) -> bool:
    """Initialise `data` unless a previous run completed that; a half-made data dir
    (an interrupted init) is wiped first.  Returns whether it initialised."""
    marker = home / INITIALISED
    if marker.exists() and data.is_dir():
        return False
    shutil.rmtree(data, ignore_errors=True)
    initialise()
    marker.touch()
    return True


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Serialise start/stop: the test command and CI may call us concurrently."""
    root = runtime_dir()
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# ---------------------------------------------------------------- installation


def _mariadbd() -> Path | None:
    """The MariaDB server binary, which lives in sbin (often not on PATH)."""
    found = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
    return Path(found) if Path(found).exists() else None


def _postgres_bin() -> Path | None:
    """The bin dir of the newest installed PostgreSQL.  Debian keeps the server
    tools in /usr/lib/postgresql/<version>/bin, out of PATH."""
    versions = [d for d in Path("/usr/lib/postgresql").glob("*/bin") if (d / "postgres").exists()]
    versions.sort(key=lambda d: [int(p) for p in d.parent.name.split(".") if p.isdigit()])
    return versions[-1] if versions else None


def _installed(name: str) -> bool:
    """Whether the server `name` and its command-line tools are present."""
    if name == "mariadb":
        return _mariadbd() is not None and shutil.which("mariadb-admin") is not None
    if name == "postgres":
        return _postgres_bin() is not None
    if name == "galera":
        return (
            _installed("mariadb")
            and _galera_provider() is not None
            and shutil.which("rsync") is not None
        )
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


@contextlib.contextmanager
def _services_not_autostarted() -> Iterator[None]:
    """Keep apt from starting the system-wide services it installs: we only want
    the binaries, and the system daemons would just take memory and ports."""
    policy = Path("/usr/sbin/policy-rc.d")
    if policy.exists():
        yield
        return
    policy.write_text("#!/bin/sh\n# temporary, written by scripts/servers.py\nexit 101\n")
    policy.chmod(0o755)
    try:
        yield
    finally:
        policy.unlink(missing_ok=True)


def _install(names: Sequence[str]) -> None:
    """Install whatever Debian packages are missing for `names`.  Missing servers
    are an error, never a reason to skip: a skipped backend is an untested one."""
    missing = [name for name in names if not _installed(name)]
    if not missing:
        return
    packages = sorted({package for name in missing for package in PACKAGES[name]})
    command = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    if os.geteuid() != 0:
        raise ServerError(
            f"{', '.join(missing)} not installed; run as root, or: sudo {shlex.join(command)}"
        )
    _say(f"installing {' '.join(packages)} ...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with _services_not_autostarted():
        for step in (["apt-get", "update"], command):
            # apt's chatter goes to stderr so that stdout stays eval-able.
            done = subprocess.run(step, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr)
            if done.returncode != 0:
                raise ServerError(
                    f"`{shlex.join(step)}` failed; cannot install {', '.join(packages)}"
                )
    still_missing = [name for name in missing if not _installed(name)]
    if still_missing:
        raise ServerError(
            f"{', '.join(still_missing)} still missing after installing {' '.join(packages)}"
        )


# ---------------------------------------------------------------- MariaDB


def _mariadb_home() -> Path:
    return runtime_dir() / "mariadb"


def _mariadb_pid() -> int | None:
    """Pid of the mariadbd serving our data dir, if one runs."""
    marker = f"--datadir={_mariadb_home() / 'data'}"
    return _live_pid(_mariadb_home() / "mariadbd.pid", lambda pid: marker in _cmdline(pid))


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")


def _mariadb_client(program: str, *args: str) -> list[str]:
    """A MariaDB client command run as root over our socket, ignoring any my.cnf."""
    socket_path = _mariadb_home() / "mysqld.sock"
    return [program, "--no-defaults", "-uroot", f"--socket={socket_path}", *args]


def _mariadb_answers() -> bool:
    """mariadb-admin ping exits 0 whenever the server answers, even if it then
    denies access, so this only tests liveness on our port."""
    return _succeeds(
        [
            "mariadb-admin",
            "--no-defaults",
            "--connect-timeout=2",
            "-uroot",
            "-h127.0.0.1",
            f"-P{port('mariadb')}",
            "ping",
        ]
    )


def _as_root_flag() -> list[str]:
    """mariadbd refuses to run as root unless told to; for anyone else, no flag."""
    return ["--user=root"] if os.geteuid() == 0 else []


def _mariadb_initialise(data: Path) -> None:
    """Create the system tables; root gets a password-less 'normal' login (not
    unix-socket auth) so that tooling can connect over TCP."""
    _say("mariadb: initialising data dir")
    _run(
        [
            "mariadb-install-db",
            "--no-defaults",
            f"--datadir={data}",
            "--skip-test-db",
            "--auth-root-authentication-method=normal",
            *_as_root_flag(),
        ]
    )


def _mariadb_launch() -> None:
    """Start mariadbd on the existing data dir and wait until it answers."""
    home = _mariadb_home()
    log = home / "mariadbd.log"
    mariadbd = _mariadbd()
    if mariadbd is None:
        raise ServerError("MariaDB is not installed")
    pid = _spawn_detached(
        [
            mariadbd,
            "--no-defaults",
            f"--datadir={home / 'data'}",
            f"--socket={home / 'mysqld.sock'}",
            f"--port={port('mariadb')}",
            "--bind-address=127.0.0.1",
            *_as_root_flag(),
            f"--pid-file={home / 'mariadbd.pid'}",
            f"--log-error={log}",
            "--skip-name-resolve",
            "--innodb-buffer-pool-size=128M",
            "--innodb-flush-log-at-trx-commit=2",
            "--max-connections=500",
            "--character-set-server=utf8mb4",
            "--collation-server=utf8mb4_unicode_ci",
        ],
        log,
    )
    _wait_until_ready("mariadb", _mariadb_answers, log, died=lambda: not _alive(pid))


def _mariadb_setup() -> None:
    """Ensure the `semaphore` user and database.  The user gets every privilege,
    since tests create and drop test_* databases and fault tests KILL sessions;
    run on every start, so an interrupted setup heals itself."""
    _run(_mariadb_client("mariadb", "-e", MARIADB_SETUP_SQL))


def _start_mariadb() -> str:
    home = _mariadb_home()
    home.mkdir(parents=True, exist_ok=True)
    pid = _mariadb_pid()
    if pid is not None and _mariadb_answers():
        _mariadb_setup()
        return "reused"
    if pid is not None:  # ours, but not answering on this port: start it afresh
        _stop_mariadb()
    _require_free("mariadb")
    _fresh_data_dir(home, home / "data", lambda: _mariadb_initialise(home / "data"))
    _mariadb_launch()
    _mariadb_setup()
    return "started"


def _stop_mariadb() -> bool:
    pid = _mariadb_pid()
    if pid is None:
        return False
    _shut_down("mariadb", pid, _mariadb_client("mariadb-admin", "shutdown"))
    return True


# ---------------------------------------------------------------- PostgreSQL


def _postgres_link() -> Path:
    return runtime_dir() / "postgres"


def _postgres_tool(tool: str) -> Path:
    bindir = _postgres_bin()
    if bindir is None:
        raise ServerError("PostgreSQL is not installed")
    return bindir / tool


def _as_postgres(cmd: Sequence[str | Path]) -> list[str | Path]:
    """PostgreSQL refuses to run as root, so as root its tools run as `postgres`."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else list(cmd)


def _ensure_system_user(name: str) -> None:
    """Debian's packages create `postgres` and `mysql`; a bare machine may lack them."""
    if os.geteuid() != 0:
        return
    try:
        pwd.getpwnam(name)
    except KeyError:
        _run(["useradd", "--system", "--user-group", "--no-create-home", name])


def _user_can_reach(user: str, path: Path) -> bool:
    """Whether `user` can traverse down to `path` (think /root/...)."""
    if os.geteuid() != 0:
        return True
    _ensure_system_user(user)
    return _succeeds(["runuser", "-u", user, "--", "test", "-x", path])


def _postgres_home() -> Path:
    """The directory holding the cluster, owned by whoever runs the server.

    Normally it is <runtime>/postgres.  When the `postgres` user cannot reach the
    runtime dir, the cluster lives in /tmp instead and <runtime>/postgres is a
    symlink to it, so the choice is made once and every path still starts at
    the runtime dir."""
    link = _postgres_link()
    if not link.is_symlink() and not link.exists():
        if _user_can_reach("postgres", link.parent):
            link.mkdir()
        else:
            digest = hashlib.sha256(str(link).encode()).hexdigest()[:12]
            link.symlink_to(Path(tempfile.gettempdir()) / f"semaphore-postgres-{digest}")
    home = link.resolve()
    home.mkdir(exist_ok=True)
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(home, user.pw_uid, user.pw_gid)
    return home


def _pg_ctl(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """pg_ctl as the server's user; run from `home` because postgres cannot
    necessarily read the caller's cwd (e.g. /root)."""
    command = _as_postgres([_postgres_tool("pg_ctl"), "-D", home / "data", *args])
    return _run(command, cwd=home, check=check)


def _postgres_running(home: Path) -> bool:
    """pg_ctl status also sees through a stale postmaster.pid."""
    if not (home / "data").is_dir():
        return False
    return _pg_ctl(home, "status", check=False).returncode == 0


def _postgres_dsn(database: str) -> str:
    return f"postgres://semaphore@127.0.0.1:{port('postgres')}/{database}"


def _postgres_answers() -> bool:
    pg_isready = _postgres_tool("pg_isready")
    return _succeeds([pg_isready, "-q", "-t", "2", "-d", _postgres_dsn("postgres")])


def _postgres_initialise(home: Path) -> None:
    """initdb with `semaphore` as the bootstrap superuser, so tests may create
    databases, and trust auth, since only loopback can connect."""
    _say("postgres: initialising data dir")
    _run(
        _as_postgres(
            [
                _postgres_tool("initdb"),
                "-D",
                home / "data",
                "-U",
                "semaphore",
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C.UTF-8",
                "--no-sync",
            ]
        ),
        cwd=home,
    )


def _postgres_launch(home: Path) -> None:
    """Start the cluster on our port, with its socket in `home`, and wait for it."""
    settings = [
        part for name, value in POSTGRES_SETTINGS.items() for part in ("-c", f"{name}={value}")
    ]
    options = shlex.join(["-p", str(port("postgres")), "-k", str(home), *settings])
    log = home / "postgres.log"
    timeout = str(int(START_TIMEOUT))
    try:
        _pg_ctl(home, "-l", str(log), "-o", options, "-w", "-t", timeout, "start")
    except ServerError as error:
        raise ServerError(f"{error}\nend of {log}:\n{_log_tail(log)}") from None


def _postgres_setup() -> None:
    """Create the `semaphore` database unless it exists (Postgres has no
    CREATE DATABASE IF NOT EXISTS)."""
    psql = [str(_postgres_tool("psql")), "-X", "-q", "-tA", "-v", "ON_ERROR_STOP=1"]
    psql += ["-d", _postgres_dsn("postgres"), "-c"]
    exists = _run([*psql, "SELECT 1 FROM pg_database WHERE datname = 'semaphore'"])
    if exists.stdout.strip() != "1":
        _run([*psql, "CREATE DATABASE semaphore OWNER semaphore"])


def _start_postgres() -> str:
    _ensure_system_user("postgres")
    home = _postgres_home()
    running = _postgres_running(home)
    if running and _postgres_answers():
        _postgres_setup()
        return "reused"
    if running:  # ours, but not answering on this port: start it afresh
        _stop_postgres()
    _require_free("postgres")
    _fresh_data_dir(home, home / "data", lambda: _postgres_initialise(home))
    _postgres_launch(home)
    _postgres_setup()
    return "started"


def _stop_postgres() -> bool:
    if not _postgres_link().exists():
        return False
    home = _postgres_link().resolve()
    if not _postgres_running(home):
        return False
    _pg_ctl(home, "stop", "-m", "fast", "-w", "-t", str(int(STOP_TIMEOUT)))
    return True


# ---------------------------------------------------------------- Redis


def _redis_home() -> Path:
    return runtime_dir() / "redis"


def _redis_pid() -> int | None:
    """Pid of our redis-server.  Redis rewrites its command line, but it chdirs
    into --dir, so its cwd tells whether it is ours."""
    home = _redis_home()

    def is_ours(pid: int) -> bool:
        with contextlib.suppress(OSError):
            return Path(os.readlink(f"/proc/{pid}/cwd")) == home.resolve()
        return False

    return _live_pid(home / "redis.pid", is_ours)


def _redis_answers() -> bool:
    result = _run(["redis-cli", "-h", "127.0.0.1", "-p", str(port("redis")), "ping"], check=False)
    return result.stdout.strip() == "PONG"


def _start_redis() -> str:
    home = _redis_home()
    home.mkdir(parents=True, exist_ok=True)
    pid = _redis_pid()
    if pid is not None and _redis_answers():
        return "reused"
    if pid is not None:  # ours, but not answering on this port: start it afresh
        _stop_redis()
    _require_free("redis")
    pid_file, log = home / "redis.pid", home / "redis.log"
    options = {
        "port": str(port("redis")),
        "bind": "127.0.0.1",
        "save": "",  # no snapshots, and no append-only file: nothing to persist
        "appendonly": "no",
        "daemonize": "yes",
        "pidfile": str(pid_file),
        "logfile": str(log),
        "dir": str(home),
    }
    flags = [part for name, value in options.items() for part in (f"--{name}", value)]
    _run(["redis-server", *flags])

    def died() -> bool:
        pid = _read_pid(pid_file)
        return pid is not None and not _alive(pid)

    _wait_until_ready("redis", _redis_answers, log, died=died)
    return "started"


def _stop_redis() -> bool:
    pid = _redis_pid()
    if pid is None:
        return False
    # SIGTERM is Redis's graceful shutdown (nothing to save here), and unlike
    # `redis-cli -p` it cannot reach another runtime dir's Redis on this port.
    _shut_down("redis", pid, ["kill", "-TERM", str(pid)])
    return True


# ---------------------------------------------------------------- Galera
# Three mariadbd processes with the Galera provider, each its own data dir and
# ports, forming one multi-primary cluster: node 1 bootstraps it, nodes 2 and 3
# join.  What the tests need from it is that row locks are local to a node
# while writes are certified cluster-wide, so it must be a real cluster, not
# one server under three names.
#
# Joiners receive node 1's data by rsync.  The nodes run as the `mysql` user,
# never root: the transfer's rsync daemon, started as root, would switch to
# `nobody`, who may not write the data dir.  If a joiner cannot catch up, the
# throw-away cluster is made afresh.


def _galera_provider() -> Path | None:
    """The Galera library (Debian's galera-4 puts it in /usr/lib/galera)."""
    return next((Path(p) for p in GALERA_PROVIDERS if Path(p).exists()), None)


def _galera_port(node: int) -> int:
    return port("galera") + node - 1


def _galera_group_port(node: int, offset: int = 0) -> int:
    """Group communication (offset 0), incremental (10) and snapshot (20) transfer."""
    return port("galera_group") + offset + node - 1


def _galera_home(node: int) -> Path:
    # Resolved: the `mysql` user may not traverse the runtime dir to follow
    # _galera_root()'s symlink (a checkout under /root).
    return (runtime_dir() / "galera").resolve() / f"node{node}"


def _galera_pid(node: int) -> int | None:
    marker = f"--datadir={_galera_home(node) / 'data'}"
    return _live_pid(_galera_home(node) / "mariadbd.pid", lambda pid: marker in _cmdline(pid))


def _galera_client(node: int, program: str, *args: str) -> list[str]:
    socket_path = _galera_home(node) / "mysqld.sock"
    return [program, "--no-defaults", "-uroot", f"--socket={socket_path}", *args]


def _galera_synced(node: int) -> bool:
    """Whether `node` answers, belongs to the primary component and has caught up:
    only then does it accept and certify writes like its peers."""
    if _galera_pid(node) is None:
        return False
    query = (
        "SHOW GLOBAL STATUS WHERE Variable_name IN"
        " ('wsrep_local_state_comment', 'wsrep_cluster_status', 'wsrep_ready')"
    )
    result = _run(_galera_client(node, "mariadb", "-N", "-B", "-e", query), check=False)
    status = dict(line.split("\t", 1) for line in result.stdout.splitlines() if "\t" in line)
    return (
        result.returncode == 0
        and status.get("wsrep_local_state_comment") == "Synced"
        and status.get("wsrep_cluster_status") == "Primary"
        and status.get("wsrep_ready") == "ON"
    )


def _galera_launch(node: int, *, new_cluster: bool) -> None:
    """Start one node, bootstrapping a new cluster or joining the running one,
    and wait until it is synced (a joiner first receives its snapshot)."""
    home = _galera_home(node)
    log = home / "mariadbd.log"
    mariadbd, provider = _mariadbd(), _galera_provider()
    if mariadbd is None or provider is None:
        raise ServerError("MariaDB with Galera (galera-4) is not installed")
    for needed in (_galera_port(node), *(_galera_group_port(node, o) for o in (0, 10, 20))):
        if _port_in_use(needed):
            raise ServerError(
                f"port {needed} (galera node {node}) is in use; choose other ports with "
                "SEMAPHORE_GALERA_PORT / SEMAPHORE_GALERA_GROUP_PORT"
            )
    members = ",".join(f"127.0.0.1:{_galera_group_port(n)}" for n in GALERA_NODES)
    provider_options = ";".join(
        [
            f"gmcast.listen_addr=tcp://127.0.0.1:{_galera_group_port(node)}",
            f"ist.recv_addr=127.0.0.1:{_galera_group_port(node, 10)}",
            "gcache.size=64M",
        ]
    )
    pid = _spawn_detached(
        [
            mariadbd,
            "--no-defaults",
            f"--datadir={home / 'data'}",
            f"--socket={home / 'mysqld.sock'}",
            f"--port={_galera_port(node)}",
            "--bind-address=127.0.0.1",
            *(["--user=mysql"] if os.geteuid() == 0 else []),
            f"--pid-file={home / 'mariadbd.pid'}",
            f"--log-error={log}",
            "--skip-name-resolve",
            "--innodb-buffer-pool-size=64M",
            "--innodb-flush-log-at-trx-commit=2",
            # Galera's advice (docs/clusters.md): a replicated write waiting
            # behind a local lock stalls the whole cluster for this long.
            "--innodb-lock-wait-timeout=5",
            "--max-connections=300",
            "--character-set-server=utf8mb4",
            "--collation-server=utf8mb4_unicode_ci",
            # What Galera requires: row-based replication, interleaved auto-increments.
            "--binlog-format=ROW",
            "--innodb-autoinc-lock-mode=2",
            "--wsrep-on=ON",
            f"--wsrep-provider={provider}",
            "--wsrep-cluster-name=django-semaphore-tests",
            f"--wsrep-node-name=node{node}",
            f"--wsrep-node-address=127.0.0.1:{_galera_group_port(node)}",
            f"--wsrep-cluster-address=gcomm://{members}",
            f"--wsrep-provider-options={provider_options}",
            "--wsrep-sst-method=rsync",
            f"--wsrep-sst-receive-address=127.0.0.1:{_galera_group_port(node, 20)}",
            *(["--wsrep-new-cluster"] if new_cluster else []),
        ],
        log,
    )
    _wait_until_ready(
        f"galera node {node}", lambda: _galera_synced(node), log, died=lambda: not _alive(pid)
    )


def _galera_initialise() -> None:
    """Node 1's system tables; joiners start empty and receive node 1's data."""
    for node in GALERA_NODES:
        shutil.rmtree(_galera_home(node) / "data", ignore_errors=True)
        (_galera_home(node) / "data").mkdir(parents=True)
    _mariadb_initialise(_galera_home(1) / "data")
    _give_to_mysql(_galera_root())


def _galera_root() -> Path:
    """<runtime>/galera, or a symlink from there into /tmp when the `mysql`
    user cannot reach the runtime dir (a checkout under /root)."""
    link = runtime_dir() / "galera"
    if not link.is_symlink() and not link.exists():
        if _user_can_reach("mysql", link.parent):
            link.mkdir()
        else:
            digest = hashlib.sha256(str(link).encode()).hexdigest()[:12]
            link.symlink_to(Path(tempfile.gettempdir()) / f"semaphore-galera-{digest}")
    root = link.resolve()
    root.mkdir(exist_ok=True)
    return root


def _give_to_mysql(path: Path) -> None:
    if os.geteuid() == 0:
        _ensure_system_user("mysql")
        _run(["chown", "-R", "mysql:mysql", path])


def _galera_bootstrap() -> None:
    """Start a new cluster from node 1.  After a clean stop node 1 is the last
    to leave and may bootstrap; after a crash Galera refuses until told that
    this node is safe, which for a throw-away cluster it always is."""
    _fresh_data_dir(_galera_root(), _galera_home(1) / "data", _galera_initialise)
    state = _galera_home(1) / "data" / "grastate.dat"
    if state.exists():
        lines = state.read_text().splitlines()
        state.write_text(
            "\n".join(
                "safe_to_bootstrap: 1" if line.startswith("safe_to_bootstrap:") else line
                for line in lines
            )
            + "\n"
        )
    _galera_launch(1, new_cluster=True)


def _galera_assemble() -> None:
    """Bootstrap if no node is in a primary component, then join the others."""
    if not any(_galera_synced(node) for node in GALERA_NODES):
        _stop_galera()  # whatever is left runs cut off from any cluster
        _galera_bootstrap()
    for node in GALERA_NODES:
        if not _galera_synced(node):
            _stop_galera_node(node)  # running but cut off from the cluster
            _galera_launch(node, new_cluster=False)


def _start_galera() -> str:
    root = _galera_root()
    if all(_galera_synced(node) for node in GALERA_NODES):
        _run(_galera_client(1, "mariadb", "-e", MARIADB_SETUP_SQL))
        return "reused"
    try:
        _galera_assemble()
    except ServerError as error:
        # A joiner too far behind for an incremental transfer, or a node's data
        # from another cluster: nothing here is worth keeping, start afresh.
        _say(f"galera: {str(error).splitlines()[0]}; re-creating the cluster")
        _stop_galera()
        (root / INITIALISED).unlink(missing_ok=True)
        _galera_assemble()
    # Users and databases are replicated: creating them on one node is enough.
    _run(_galera_client(1, "mariadb", "-e", MARIADB_SETUP_SQL))
    return "started"


def _stop_galera_node(node: int) -> bool:
    pid = _galera_pid(node)
    if pid is None:
        return False
    _shut_down(f"galera node {node}", pid, _galera_client(node, "mariadb-admin", "shutdown"))
    return True


def _stop_galera() -> bool:
    # Node 1 last: the last node to leave is the one allowed to bootstrap again.
    stopped = [_stop_galera_node(node) for node in reversed(GALERA_NODES)]
    return any(stopped)


# ---------------------------------------------------------------- public API

STARTERS: dict[str, Callable[[], str]] = {
    "mariadb": _start_mariadb,
    "postgres": _start_postgres,
    "redis": _start_redis,
    "galera": _start_galera,
}
STOPPERS: dict[str, Callable[[], bool]] = {
    "mariadb": _stop_mariadb,
    "postgres": _stop_postgres,
    "redis": _stop_redis,
    "galera": _stop_galera,
}


def _canonical(names: Sequence[str]) -> list[str]:
    """`names` validated, deduplicated and in a stable order; empty means all."""
    unknown = sorted(set(names) - set(SERVERS))
    if unknown:
        raise ServerError(
            f"unknown server(s) {', '.join(unknown)}; choose from {', '.join(SERVERS)}"
        )
    return [name for name in SERVERS if name in names or not names]


def start(names: Sequence[str] = SERVERS) -> dict[str, str]:
    """Start (or reuse) the named servers and return their URLs, keyed by name."""
    chosen = _canonical(names)
    _install(chosen)
    with _locked():
        for name in chosen:
            began = time.monotonic()
            outcome = STARTERS[name]()
            _say(
                f"{name:<9} {outcome:<8} 127.0.0.1:{port(name):<6} "
                f"{time.monotonic() - began:5.1f}s  {runtime_dir() / name}"
            )
    return {name: urls()[name] for name in chosen}


def stop(names: Sequence[str] = SERVERS) -> None:
    """Stop the named servers gracefully, here and in the runtime dirs nested one
    level down; servers that are not running are fine.  Stopping them all (no
    names) then checks that no process is left working in the runtime dir."""
    chosen = _canonical(names)
    root = runtime_dir()
    if not root.exists():
        return
    for home in [root, *_nested_runtime_dirs(root)]:
        with _runtime_dir_set(home), _locked():
            for name in chosen:
                stopped = STOPPERS[name]()
                where = "" if home == root else f"  ({home.name})"
                _say(f"{name:<9} {'stopped' if stopped else 'not running'}{where}")
    left = leftover_processes(root) if set(chosen) == set(SERVERS) else {}
    if left:
        listing = "\n".join(f"  pid {pid}: {command}" for pid, command in sorted(left.items()))
        raise ServerError(f"processes still run in {root} after stopping every server:\n{listing}")


def _nested_runtime_dirs(root: Path) -> list[Path]:
    """Runtime dirs inside `root` (another suite's own servers): every runtime dir
    that was ever used holds the `.lock` that start and stop take."""
    return sorted(
        child
        for child in root.iterdir()
        if child.is_dir() and not child.is_symlink() and (child / ".lock").exists()
    )


@contextlib.contextmanager
def _runtime_dir_set(path: Path) -> Iterator[None]:
    """Point every helper here at `path` for a while (they read the environment)."""
    saved = os.environ.get("SEMAPHORE_RUNTIME_DIR")
    os.environ["SEMAPHORE_RUNTIME_DIR"] = str(path)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("SEMAPHORE_RUNTIME_DIR", None)
        else:
            os.environ["SEMAPHORE_RUNTIME_DIR"] = saved


def leftover_processes(root: Path) -> dict[int, str]:
    """Live processes working in `root` or in a directory one of its symlinks
    points to (a cluster kept in /tmp), pid -> command line.  Every server here
    chdirs into its data dir, and a server's helpers run in it too, so this is
    what proves that nothing started under `root` still runs; the demo's
    processes, which only name files in it, work in the checkout."""
    links = [*root.glob("*"), *root.glob("*/*")]  # <runtime>[/<nested>]/postgres, /galera
    roots = [root.resolve(), *(link.resolve() for link in links if link.is_symlink())]
    left = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not _alive(int(entry.name)):
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:  # gone meanwhile, or not ours to look at
            continue
        if any(cwd.is_relative_to(where) for where in roots):
            left[int(entry.name)] = " ".join(_cmdline(int(entry.name))).strip()
    return left


RUN_MARKER = "SEMAPHORE_RUN_ID"


def processes_of_run(run_id: str, grace: float = 10.0) -> dict[int, str]:
    """Live processes that inherited ``SEMAPHORE_RUN_ID=<run_id>`` (pid -> command
    line), apart from this one and its ancestors, after waiting up to `grace`
    seconds for stragglers to exit.  The test command exports the marker
    first, so every process it starts carries it, wherever it runs and even
    when it left its parent's session (a server, a daemonized Redis, a Celery
    worker): what is still alive at the end was leaked."""
    marker = f"{RUN_MARKER}={run_id}".encode()
    ours = {os.getpid()}
    pid = os.getppid()
    while pid > 1 and pid not in ours:  # the command that asked, and its callers
        ours.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            break
    deadline = time.monotonic() + grace
    while True:
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in ours:
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile, or not ours to read
                continue
            if marker in environ and _alive(int(entry.name)):
                found[int(entry.name)] = " ".join(_cmdline(int(entry.name))).strip()
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def restart_mariadb(hard: bool) -> None:
    """Restart MariaDB on the same data dir, for the fault suite.  `hard` SIGKILLs
    mariadbd (a crash: the next start runs InnoDB recovery); otherwise it shuts
    down cleanly.  Either way clients see their connections drop."""
    with _locked():
        pid = _mariadb_pid()
        if pid is not None and hard:
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 10)
        elif pid is not None:
            _stop_mariadb()
        _start_mariadb()


# ---------------------------------------------------------------- command line


def main(argv: Sequence[str]) -> int:
    usage = (
        "usage: servers.py start [mariadb] [postgres] [redis] [galera] | stop | env"
        " | leftovers RUN_ID"
    )
    valid = {"start": None, "stop": None, "env": 0, "leftovers": 1}
    if not argv or argv[0] not in valid or valid[argv[0]] not in (None, len(argv) - 1):
        _say(usage)
        return 2
    command, names = argv[0], list(argv[1:])
    try:
        if command == "start":
            print(env_lines(start(names)))
        elif command == "stop":
            stop(names)
        elif command == "leftovers":
            left = processes_of_run(names[0])
            listing = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in sorted(left.items()))
            if left:
                raise ServerError(f"processes of run {names[0]} outlived it:\n{listing}")
        else:
            print(env_lines(urls()))
    except ServerError as error:
        _say(f"servers.py: error: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
