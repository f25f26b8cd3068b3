"""Run the test passes of one tox environment side by side.

    python scripts/passes.py [--jobs N] [--tag TAG] DATABASE:MARKERS ... [-- PYTEST ARGS]

Each pass is ``pytest -m MARKERS`` on one database: ``sqlite`` (a file under
``.runtime/tests``), or a server whose URL is in ``SEMAPHORE_<DATABASE>_URL``
(``scripts/servers.py start`` prints them). Why side by side: much of a
pass is waiting (lease expiries, lock-wait bounds, Celery workers starting,
child processes setting Django up), and the passes share nothing but the
servers: each pass has a database of its own, named after ``--tag`` (the
tox environment) and its place in the list, so the passes of two
environments run at once too; every Celery worker has its own queue, every
test its own semaphore names. At most ``--jobs`` passes run at
once; each one's output is kept and printed whole as soon as it ends, so the
log reads pass by pass. The exit status is 1 if any pass failed; a pass
that the caller's pytest arguments (``-k fencing``) leave without a test
has not failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

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

    def environment(self, name: str) -> dict[str, str]:
        """The environment of this pass's pytest: DATABASE_URL naming the
        database ``name`` (its test database is pytest-django's ``test_``
        name), a URL no server answers when the server was not started (the
        pass fails)."""
        env = dict(os.environ)
        if self.database == "sqlite":
            (RUNTIME / "tests").mkdir(parents=True, exist_ok=True)
            env["DATABASE_URL"] = f"sqlite:///{RUNTIME / 'tests' / name}.sqlite3"
            return env
        url = os.environ.get(f"SEMAPHORE_{self.database.upper()}_URL")
        if url is None:
            env["DATABASE_URL"] = f"{self.database}-not-started"
        else:
            env["DATABASE_URL"] = urlsplit(url)._replace(path=f"/{name}").geturl()
        return env


def run(one: Pass, name: str, pytest_args: list[str]) -> tuple[int, str]:
    """Run one pass on the database ``name`` with its output in a file; its
    exit status and output."""
    command = [sys.executable, "-m", "pytest", "-m", one.markers, *pytest_args]
    RUNTIME.mkdir(exist_ok=True)
    began = time.monotonic()
    with tempfile.TemporaryFile(mode="w+", dir=RUNTIME) as output:
        status = subprocess.call(
            command, env=one.environment(name), stdout=output, stderr=subprocess.STDOUT
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
    parser.add_argument("--tag", default="pass", help="names the passes' databases")
    parser.add_argument("passes", nargs="+", type=Pass.parse, metavar="DATABASE:MARKERS")
    args = parser.parse_args(own)
    tag = re.sub(r"\W", "_", args.tag)
    failed = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {
            pool.submit(run, one, f"semaphore_{tag}_{place}", pytest_args): one
            for place, one in enumerate(args.passes, 1)
        }
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
