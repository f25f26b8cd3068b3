"""Run the test passes of one tox environment side by side.

    python scripts/passes.py [--jobs N] DATABASE:MARKERS ... [-- PYTEST ARGS]

Each pass is ``pytest -m MARKERS`` on one database: ``sqlite`` (the default
file), or a server whose URL is in ``SEMAPHORE_<DATABASE>_URL``
(``scripts/servers.py start`` prints them). Why side by side: much of a
pass is waiting (lease expiries, lock-wait bounds, Celery workers starting,
child processes setting Django up), and the passes share nothing but the
servers: each database has its own test database, every Celery worker its own
queue, every test its own semaphore names. At most ``--jobs`` passes run at
once; each one's output is kept and printed whole as soon as it ends, so the
log reads pass by pass. The exit status is 1 if any pass failed; a pass
that the caller's pytest arguments (``-k fencing``) leave without a test
has not failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parent.parent / ".runtime"


@dataclass(frozen=True)
class Pass:
    database: str
    markers: str

    @classmethod
    def parse(cls, spec: str) -> Pass:
        database, separator, markers = spec.partition(":")
        if not separator or not markers:
            raise argparse.ArgumentTypeError(f"{spec!r}: expected DATABASE:MARKERS")
        return cls(database, markers)

    def environment(self) -> dict[str, str]:
        """The environment of this pass's pytest: DATABASE_URL for a server,
        a URL no server answers when it was not started (the pass fails)."""
        env = {key: value for key, value in os.environ.items() if key != "DATABASE_URL"}
        if self.database != "sqlite":
            variable = f"SEMAPHORE_{self.database.upper()}_URL"
            env["DATABASE_URL"] = os.environ.get(variable, f"{self.database}-not-started")
        return env


def run(one: Pass, pytest_args: list[str]) -> tuple[int, str]:
    """Run one pass with its output in a file; its exit status and output."""
    command = [sys.executable, "-m", "pytest", "-m", one.markers, *pytest_args]
    RUNTIME.mkdir(exist_ok=True)
    began = time.monotonic()
    with tempfile.TemporaryFile(mode="w+", dir=RUNTIME) as output:
        status = subprocess.call(
            command, env=one.environment(), stdout=output, stderr=subprocess.STDOUT
        )
        if status == pytest.ExitCode.NO_TESTS_COLLECTED and pytest_args:
            # Narrowed by the caller (-k fencing): this pass has none of them.
            status = pytest.ExitCode.OK
        output.seek(0)
        text = output.read()
    seconds = time.monotonic() - began
    header = f"--- pass {one.database} -m {one.markers!r}: exit {status}, {seconds:.0f}s"
    return status, f"{header}\n{text}{header}\n"


def main(argv: list[str]) -> int:
    own, pytest_args = argv, []
    if "--" in argv:
        at = argv.index("--")
        own, pytest_args = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(prog="scripts/passes.py", description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="passes at once (default 2)")
    parser.add_argument("passes", nargs="+", type=Pass.parse, metavar="DATABASE:MARKERS")
    args = parser.parse_args(own)
    failed = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run, one, pytest_args): one for one in args.passes}
        for future in as_completed(futures):
            status, text = future.result()
            print(text, flush=True)
            if status:
                failed.append(futures[future].database)
    if failed:
        print(f"--- failed passes: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
