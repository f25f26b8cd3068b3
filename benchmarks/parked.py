"""Tasks with the library's defaults (they park) against retries, with a
real prefork worker on Redis.

``python -m benchmarks.parked`` enqueues ``--tasks`` tasks that each hold one
permit of a capacity ``--capacity`` semaphore for ``--hold`` seconds, run by
``celery worker --pool=prefork``, once with the defaults (``default``: no
``park=``, no settings; they park), once with ``park=False`` (``retried``,
Celery's default 3 retries), and once without a semaphore on a worker of
``capacity`` processes (``unlimited``: what this machine's worker does at
that concurrency, the practical ideal), and reports for each:

- **drain**: from the first run's start, with every task already in the
  broker (a backlog), to the last run's end, against the ideal
  ``tasks x hold / capacity``;
- **messages per task**: every message published (first publishes, retries,
  wake-ups, the sweep's), over the tasks;
- **failed**: tasks that failed (for want of room: they do nothing else);
- **release to next start**: with the semaphore saturated, the i-th start
  (in start order) uses the permit freed by the (i - capacity)-th end: the
  gap between the two, p50 and p99 (an end is stamped just before the
  release, so this includes the release itself).

Celery's Django fix-up closes the worker's database connection before and
after every task, so each task opens a new one: on PostgreSQL a new server
process, which also compiles the app's routines again (docs/operations.md,
"Celery workers and their connections"). ``--reuse-connections`` runs the
worker as that section advises, keeping its connection from task to task.

The driver also plays beat, only when nothing has run for ``STALLED``
seconds: it then runs ``sweep.sweep_parked()`` and reports what it woke (a
wake-up the releases missed; it should stay 0). ``--smoke`` is small enough for the test suite.

The ``capped`` mode floods a semaphore held by the driver with ``--tasks``
tasks whose line is capped (``max_waiting=--max-waiting``): it samples the
parked rows until every task parked or failed, then releases, and reports
the most parked at once, the ``LineFull`` failures, and that the parked ones
all ran, once each, and nothing was lost.

The ``discard`` mode sends ``--tasks`` identical tasks of
``on_conflict="discard"`` (``PermitTask``) from ``--senders`` processes at
once, while a worker runs them for ``--discard-hold`` seconds each: it
reports how many ran (exactly one, when the sends end within a run), whether
every sender was told that one's id, and the send rate and latency.

The ``family`` mode measures what stand-by learns: ``--members`` members of
one family (capacity 1), each held by the driver, get a task each; every
refused task stands by or parks. It reports the **stand-by waits per worker
process** (each costs ``STANDBY_WAIT``; learned per family, at most one), the
time until all are parked, and then, the holders released, that all ran.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STALLED = 5.0
FAMILY = "bench-family:*"


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """``--database-url`` and ``--redis-url``, by default the private servers
    of ``scripts/servers.py`` (their ports from its environment)."""
    mariadb = os.environ.get("SEMAPHORE_MARIADB_PORT", "33061")
    redis_port = os.environ.get("SEMAPHORE_REDIS_PORT", "63791")
    parser.add_argument(
        "--database-url", default=f"mysql://semaphore:semaphore@127.0.0.1:{mariadb}/bench_parked"
    )
    parser.add_argument("--redis-url", default=f"redis://127.0.0.1:{redis_port}/5")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parked", description=__doc__)
    add_server_arguments(parser)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--hold", type=float, default=0.02)
    parser.add_argument("--capacity", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8, help="worker processes")
    parser.add_argument("--modes", default="unlimited,default,retried,family")
    parser.add_argument("--members", type=int, default=1000, help="of the family mode")
    parser.add_argument("--max-waiting", type=int, default=10, help="of the capped mode")
    parser.add_argument("--senders", type=int, default=16, help="of the discard mode")
    parser.add_argument("--discard-hold", type=float, default=20.0, help="of the discard mode")
    parser.add_argument(
        "--reuse-connections",
        action="store_true",
        help="the worker keeps its database connection from task to task "
        "(CELERY_DB_REUSE_MAX): Celery closes it around every task by default",
    )
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--smoke", action="store_true", help="40 tasks of 10 ms")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    # Stopped by a signal, still stop the worker (the with block's exit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.smoke:
        args.tasks, args.hold, args.concurrency, args.members = 40, 0.01, 6, 20
        args.senders, args.discard_hold = 4, 5.0

    from benchmarks.db import Target, ensure_database

    ensure_database(Target.parse(args.database_url))
    os.environ.update(
        BENCH_DATABASE_URL=args.database_url,
        BENCH_REDIS_URL=args.redis_url,
        BENCH_HOLD=str(args.hold),
        BENCH_QUEUE=f"bench-parked-{uuid.uuid4().hex[:8]}",
        BENCH_FAMILY=FAMILY,
        BENCH_MAX_WAITING=str(args.max_waiting),
        BENCH_DB_REUSE_MAX="1000" if args.reuse_connections else "",
    )
    from django.core.management import call_command

    from benchmarks import parked_app

    call_command("migrate", verbosity=0, interactive=False)
    results = []
    measures = {"family": run_family, "capped": run_capped, "discard": run_discard}
    for mode in args.modes.split(","):
        measure = measures.get(mode, run)
        results.append(measure(mode, args, parked_app))
        print(format_result(results[-1]), flush=True)
    if args.json:
        config = vars(args) | {"json": None}
        args.json.write_text(json.dumps({"config": config, "results": results}, indent=1))
    return 0


def run(mode: str, args: argparse.Namespace, parked_app: Any) -> dict[str, Any]:
    from django_semaphore import sweep
    from django_semaphore.models import ParkedTask, Semaphore

    counts = parked_app.counts
    _fresh(mode, parked_app, name=parked_app.NAME)
    Semaphore.objects.create(name=parked_app.NAME, capacity=args.capacity)
    task = getattr(parked_app, mode)
    log = ROOT / ".runtime" / "benchmarks" / f"parked-{mode}-worker.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # A backlog: every task is in the broker before the worker starts.
    before = time.time()
    for _ in range(args.tasks):
        task.delay()
    published_in = time.time() - before
    # Without a semaphore the worker has as many processes as the capacity.
    concurrency = args.capacity if mode == "unlimited" else args.concurrency
    with worker(concurrency, log, parked_app):
        started = time.time()
        swept = 0
        progress, last_progress = 0, time.monotonic()
        deadline = time.monotonic() + args.timeout
        while (done := _done(counts, parked_app)) < args.tasks:
            if time.monotonic() > deadline:
                raise SystemExit(f"{mode}: not drained after {args.timeout}s; see {log}")
            if done != progress:
                progress, last_progress = done, time.monotonic()
            elif mode == "default" and time.monotonic() - last_progress > STALLED:
                # Nothing ran for a while: a wake-up was missed. Beat's sweep
                # would catch it; count it, as it should never happen.
                swept += sweep.sweep_parked().woken
                last_progress = time.monotonic()
            time.sleep(0.05)
        time.sleep(1.0)  # what comes after the drain is a task run twice, or a leftover
        leftover = int(counts.llen(os.environ["BENCH_QUEUE"]))
    rows = [row.decode().split() for row in counts.lrange(parked_app.RUNS, 0, -1)]
    runs = sorted((float(start), float(end)) for start, end, _ in rows)
    starts = [start for start, _ in runs]
    ends = sorted(end for _, end in runs)
    gaps = [
        (start - ends[i - args.capacity]) * 1000
        for i, start in enumerate(starts)
        if i >= args.capacity and start >= ends[i - args.capacity]
    ]
    # From the first run's start: the worker may take tasks before it answers a ping.
    drained = ends[-1] - min(starts[0], started) if runs else float("nan")
    ideal = args.tasks * args.hold / args.capacity
    return {
        "mode": mode,
        "tasks": args.tasks,
        "ran": len(runs),
        # Runs of a task id that had run already: a task run twice.
        "ran_twice": len(rows) - len({task_id for *_, task_id in rows}),
        "failed": int(counts.get(parked_app.FAILED) or 0),
        "drain_s": round(drained, 2),
        "ideal_s": round(ideal, 2),
        "drain_over_ideal": round(drained / ideal, 2),
        "messages_per_task": round(int(counts.get(parked_app.PUBLISHED) or 0) / args.tasks, 2),
        "release_to_start_p50_ms": round(_quantile(gaps, 0.5), 1),
        "release_to_start_p99_ms": round(_quantile(gaps, 0.99), 1),
        "publish_s": round(published_in, 2),
        "woken_by_sweep": swept,
        "left_in_broker": leftover,
        "parked_left": ParkedTask.objects.count(),
    }


def run_family(mode: str, args: argparse.Namespace, parked_app: Any) -> dict[str, Any]:
    """``--members`` members of a family held by the driver, a task each: how
    many stand-by waits each worker process paid before they were all
    parked, then (the holders released) whether all ran."""
    from django_semaphore import acquire, release
    from django_semaphore.models import ParkedTask

    counts = parked_app.counts
    _fresh(mode, parked_app, family=FAMILY)
    members = [str(n) for n in range(args.members)]
    for member in members:  # created on first use, then held
        acquire(FAMILY.replace("*", member), external_id=f"holder-{member}")
    for member in members:
        parked_app.family.delay(member)
    log = ROOT / ".runtime" / "benchmarks" / f"parked-{mode}-worker.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with worker(args.concurrency, log, parked_app):
        started = time.monotonic()
        deadline = started + args.timeout
        while ParkedTask.objects.count() < args.members:
            if time.monotonic() > deadline:
                raise SystemExit(f"{mode}: not all parked after {args.timeout}s; see {log}")
            time.sleep(0.05)
        all_parked = time.monotonic() - started
        standbys = {pid: int(n) for pid, n in counts.hgetall(parked_app.STANDBYS).items()}
        for member in members:  # this process wakes them (PARK_TASKS, the default)
            release(f"holder-{member}")
        while _done(counts, parked_app) < args.members:
            if time.monotonic() > deadline:
                raise SystemExit(f"{mode}: not drained after {args.timeout}s; see {log}")
            time.sleep(0.05)
    return {
        "mode": mode,
        "tasks": args.members,
        "ran": int(counts.llen(parked_app.RUNS)),
        "failed": int(counts.get(parked_app.FAILED) or 0),
        "all_parked_s": round(all_parked, 2),
        "worker_processes": args.concurrency,
        "standby_waits": sum(standbys.values()),
        "standby_waits_per_process_max": max(standbys.values(), default=0),
        "messages_per_task": round(int(counts.get(parked_app.PUBLISHED) or 0) / args.members, 2),
    }


def run_capped(mode: str, args: argparse.Namespace, parked_app: Any) -> dict[str, Any]:
    """A flood on a held semaphore whose line is capped: the most parked at
    once (sampled), the refusals, then (released) that the parked all ran."""
    from django_semaphore import acquire, release
    from django_semaphore.models import ParkedTask, Semaphore

    counts = parked_app.counts
    _fresh(mode, parked_app, name=parked_app.NAME)
    Semaphore.objects.create(name=parked_app.NAME, capacity=args.capacity)
    acquire({parked_app.NAME: args.capacity}, external_id="held-by-the-driver")
    for _ in range(args.tasks):
        parked_app.capped.delay()
    log = ROOT / ".runtime" / "benchmarks" / f"parked-{mode}-worker.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    most_parked = 0
    with worker(args.concurrency, log, parked_app):
        started = time.monotonic()
        deadline = started + args.timeout
        while (parked := ParkedTask.objects.count()) + int(
            counts.get(parked_app.FAILED) or 0
        ) < args.tasks:
            most_parked = max(most_parked, parked)
            if time.monotonic() > deadline:
                raise SystemExit(f"{mode}: not all decided after {args.timeout}s; see {log}")
            time.sleep(0.05)
        decided = time.monotonic() - started
        most_parked = max(most_parked, parked)
        release("held-by-the-driver")
        while _done(counts, parked_app) < args.tasks:
            if time.monotonic() > deadline:
                raise SystemExit(f"{mode}: not drained after {args.timeout}s; see {log}")
            time.sleep(0.05)
        time.sleep(1.0)  # what comes after is a task run twice
    rows = [row.decode().split() for row in counts.lrange(parked_app.RUNS, 0, -1)]
    failed = int(counts.get(parked_app.FAILED) or 0)
    return {
        "mode": mode,
        "tasks": args.tasks,
        "max_waiting": args.max_waiting,
        "most_parked": most_parked,
        "parked_when_decided": parked,
        "line_full": int(counts.get(parked_app.LINE_FULL) or 0),
        "failed": failed,
        "ran": len(rows),
        "ran_twice": len(rows) - len({task_id for *_, task_id in rows}),
        "lost": args.tasks - failed - len({task_id for *_, task_id in rows}),
        "decided_s": round(decided, 2),
        "parked_left": ParkedTask.objects.count(),
    }


def run_discard(mode: str, args: argparse.Namespace, parked_app: Any) -> dict[str, Any]:
    """``--tasks`` identical sends from ``--senders`` processes at once,
    under ``on_conflict="discard"``, while a worker runs what is sent."""
    from django_semaphore.models import ParkedTask, Semaphore

    counts = parked_app.counts
    _fresh(mode, parked_app, name=parked_app.NAME)
    Semaphore.objects.create(name=parked_app.NAME, capacity=1)
    log = ROOT / ".runtime" / "benchmarks" / f"parked-{mode}-worker.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    ready = context.Barrier(args.senders + 1)
    each = [
        args.tasks // args.senders + (n < args.tasks % args.senders) for n in range(args.senders)
    ]
    with worker(args.concurrency, log, parked_app):
        senders = [
            context.Process(target=_send, args=(n, args.discard_hold, ready), daemon=True)
            for n in each
        ]
        for sender in senders:
            sender.start()
        ready.wait(timeout=args.timeout)
        started = time.monotonic()
        for sender in senders:
            sender.join(timeout=args.timeout)
        if any(sender.exitcode != 0 for sender in senders):
            raise SystemExit(f"{mode}: a sender failed: {[s.exitcode for s in senders]}")
        sent_in = time.monotonic() - started
        deadline = time.monotonic() + args.timeout
        while counts.llen(parked_app.RUNS) < 1 or ParkedTask.objects.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"{mode}: nothing ran after {args.timeout}s; see {log}")
            time.sleep(0.1)
        time.sleep(args.discard_hold + 1.0)  # what comes after is a second run
    rows = [row.decode().split() for row in counts.lrange(parked_app.RUNS, 0, -1)]
    told = [row.decode().split() for row in counts.lrange(TOLD, 0, -1)]
    latencies = sorted(float(seconds) for _, seconds in told)
    return {
        "mode": mode,
        "tasks": args.tasks,
        "senders": args.senders,
        "ran": len(rows),
        "told_ids": len({task_id for task_id, _ in told}),
        "told_the_run": all(task_id == rows[0][-1] for task_id, _ in told) if rows else False,
        "sends_s": round(sent_in, 2),
        "sends_per_s": round(args.tasks / sent_in),
        "send_p50_ms": round(_quantile(latencies, 0.5) * 1000, 1),
        "send_p99_ms": round(_quantile(latencies, 0.99) * 1000, 1),
        "failed": int(counts.get(parked_app.FAILED) or 0),
    }


TOLD = "bench-parked:told"  # "<task id told> <seconds the send took>", per send


def _send(tasks: int, hold: float, ready: Any) -> None:
    """A sender process of the discard mode: its sends, once all are ready."""
    from benchmarks import parked_app

    ready.wait(timeout=600)
    for _ in range(tasks):
        started = time.monotonic()
        task_id = parked_app.once.delay(hold).id
        parked_app.counts.rpush(TOLD, f"{task_id} {time.monotonic() - started}")


def _fresh(mode: str, parked_app: Any, **semaphores: str) -> None:
    """A queue of this run's own, its counters emptied, and a wholesale reset
    of the benchmark's database: every request and parked row, and the
    semaphores ``semaphores`` filters."""
    from django_semaphore.guards import engine_writes
    from django_semaphore.models import ParkedTask, PermitRequest, Semaphore

    os.environ["BENCH_QUEUE"] = f"bench-parked-{mode}-{uuid.uuid4().hex[:8]}"
    parked_app.app.conf.task_default_queue = os.environ["BENCH_QUEUE"]
    counters = ("PUBLISHED", "RUNS", "FAILED", "STANDBYS", "LINE_FULL")
    parked_app.counts.delete(TOLD, *(getattr(parked_app, counter) for counter in counters))
    with engine_writes():
        ParkedTask.objects.all().delete()
        PermitRequest.objects.all().delete()
        Semaphore.objects.filter(**semaphores).delete()


def _done(counts: Any, parked_app: Any) -> int:
    return int(counts.llen(parked_app.RUNS)) + int(counts.get(parked_app.FAILED) or 0)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


class worker:
    """``celery worker --pool=prefork`` on the benchmark's queue, while in use."""

    def __init__(self, concurrency: int, log: Path, parked_app: Any) -> None:
        self.concurrency, self.log, self.app = concurrency, log, parked_app.app

    def __enter__(self) -> None:
        queue = os.environ["BENCH_QUEUE"]
        self.nodename = f"{queue}@{os.uname().nodename}"
        command = [
            sys.executable, "-m", "celery", "-A", "benchmarks.parked_app", "worker",
            "--pool=prefork", f"--concurrency={self.concurrency}", f"--queues={queue}",
            f"--hostname={self.nodename}", "--without-gossip", "--without-mingle",
            "--loglevel=WARNING",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "C_FORCE_ROOT": "1"}
        with self.log.open("wb") as output:
            self.process = subprocess.Popen(command, env=env, stdout=output, stderr=output)
        deadline = time.monotonic() + 60
        while not self.app.control.ping(destination=[self.nodename], timeout=0.5):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"The worker did not start; see {self.log}")

    def __exit__(self, *exc: object) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def format_result(r: dict[str, Any]) -> str:
    if r["mode"] == "discard":
        return (
            f"discard  {r['tasks']} identical sends from {r['senders']} processes in "
            f"{r['sends_s']}s ({r['sends_per_s']}/s, p50 {r['send_p50_ms']} ms, p99 "
            f"{r['send_p99_ms']} ms): {r['ran']} ran, {r['told_ids']} id(s) told, every "
            f"sender told the run's id: {r['told_the_run']}; {r['failed']} failed"
        )
    if r["mode"] == "capped":
        return (
            f"capped   {r['tasks']} tasks, max_waiting {r['max_waiting']}: at most "
            f"{r['most_parked']} parked (sampled), {r['line_full']} refused with LineFull "
            f"({r['failed']} failed), decided in {r['decided_s']}s; then {r['ran']} ran "
            f"({r['ran_twice']} twice), {r['lost']} lost, {r['parked_left']} left parked"
        )
    if r["mode"] == "family":
        return (
            f"family   {r['tasks']} members held: all parked in {r['all_parked_s']}s; "
            f"stand-by waits {r['standby_waits']} over {r['worker_processes']} processes "
            f"(at most {r['standby_waits_per_process_max']} a process); then "
            f"{r['ran']}/{r['tasks']} ran, {r['failed']} failed, "
            f"{r['messages_per_task']} messages/task"
        )
    return (
        f"{r['mode']:8} {r['ran']}/{r['tasks']} ran ({r['ran_twice']} twice), "
        f"{r['failed']} failed; "
        f"drain {r['drain_s']}s ({r['drain_over_ideal']}x ideal {r['ideal_s']}s); "
        f"{r['messages_per_task']} messages/task; release->start p50 "
        f"{r['release_to_start_p50_ms']} ms p99 {r['release_to_start_p99_ms']} ms; "
        f"stalls woken by the sweep {r['woken_by_sweep']}; left: {r['left_in_broker']} messages, "
        f"{r['parked_left']} parked"
    )


if __name__ == "__main__":
    raise SystemExit(main())
