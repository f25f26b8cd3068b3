"""One fault-suite client process: acquire, hold, maybe renew or write, release.

Run as ``python -m benchmarks.faults.client '<json config>'`` by the runner.
Every acquire attempt, grant, renewal, fenced write, release and error goes to
the client's history. Faults that must land at a precise point are *armed* by
the runner (SIGUSR1) and fired by the client itself at the next occurrence of
that point:

- ``sigkill`` at a SQL point (``acquire.insert``: inside the general grant's
  transaction, rows locked, or before the one-trip grant's block is sent;
  ``release.request``: as release ends the request — between its two
  updates where it runs two, before its one statement or block on MariaDB)
  or while holding (``hold``): a real SIGKILL of this process;
- ``connkill`` at a SQL point: ``KILL <connection id>`` sent from a second
  connection, then the statement runs on the killed connection;
- ``lost-response`` after the grant's COMMIT (the general grant's commit, or
  the one-trip grant's call, which commits in the database): the connection
  is killed and the commit or call reports "lost connection", as if the
  answer never arrived;
- ``sigstop`` while holding: the process stops itself; the runner continues
  it (SIGCONT) after the permit's TTL has passed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.faults.history import Recorder, owner

# Which statement of the app is running, from its SQL (Django quotes with `).
POINTS = (
    ("SELECT", "FROM `django_semaphore_semaphore`", "FOR UPDATE", "acquire.lock"),
    ("INSERT INTO `django_semaphore_permit`", "", "", "acquire.insert"),
    ("UPDATE `django_semaphore_permit` SET `state`", "", "", "release.permits"),
    ("UPDATE `django_semaphore_permitrequest` SET `state`", "", "", "release.request"),
    # release(key) in one statement (request and permits together)
    ("UPDATE `django_semaphore_permitrequest` r LEFT JOIN", "", "", "release.request"),
    # The one-trip grant, and release(key) with the read of what it ended,
    # each one call (several names: a block): a fault fires before it is sent.
    ("CALL django_semaphore_grant", "", "", "acquire.insert"),  # any version
    ("CALL django_semaphore_release", "", "", "release.request"),
    ("BEGIN NOT ATOMIC", "INSERT INTO `django_semaphore_permit`", "", "acquire.insert"),
)
RETRYABLE_CODES = {1205, 1213, 1927, 2006, 2013}


# MariaDB statements may carry their own lock-wait bound as a prefix.
STATEMENT_PREFIX = re.compile(r"^SET STATEMENT .*? FOR ", re.S)


def point_of(sql: str, in_transaction: bool) -> str | None:
    sql = STATEMENT_PREFIX.sub("", sql, count=1)
    for start, middle, end, name in POINTS:
        if sql.startswith(start) and middle in sql and sql.rstrip().endswith(end):
            if name.startswith("release.") and in_transaction:
                return "acquire.reclaim"  # inline reclaim of expired permits
            return name
    return None


class Client:
    def __init__(self, config: dict[str, Any]) -> None:
        from django.db import connections

        self.config = config
        self.name: str = config["name"]
        self.record = Recorder(Path(config["history"]))
        self.owner = owner(self.name)
        self.random = random.Random(config["seed"])
        self.connection = connections["default"]
        self.deadline = self._wait_for_go(Path(config["go"]))
        self.stop = Path(config["go"]).with_name("stop")
        self.fault: dict[str, Any] = config.get("fault") or {}
        self.armed = 0
        self.key: str | None = None
        self.granting = False
        self.side: Any = None
        signal.signal(signal.SIGUSR1, self._arm)

    def _wait_for_go(self, go: Path) -> float:
        """Every client starts together, once all have booted: the runner
        writes the deadline into the go file."""
        from django.db import connection

        connection.ensure_connection()
        self.record("boot", pid=os.getpid())
        while not go.exists():
            time.sleep(0.01)
        return float(go.read_text())

    def _arm(self, signum: int, frame: Any) -> None:
        self.armed += 1

    # --- fault injection -----------------------------------------------------

    def _take_arm(self, point: str) -> bool:
        if self.armed and point in self.fault.get("points", ()):
            self.armed -= 1
            return True
        return False

    def _hook(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        in_transaction = self.connection.in_atomic_block
        point = point_of(sql, in_transaction)
        if point == "acquire.insert" and in_transaction:
            self.granting = True
        if point is not None and self._take_arm(point):
            self._fire(point)
        try:
            result = execute(sql, params, many, context)
            if point == "acquire.insert" and not in_transaction:
                self._lose_the_answer()  # the one-trip grant committed in its call
            return result
        except Exception as exc:
            code = getattr(exc, "args", [None])[0]
            if code in RETRYABLE_CODES:
                self.record("dberr", k=self.key, code=code, p=point)
            raise

    def _fire(self, point: str) -> None:
        action = self.fault["action"]
        self.record("fault", p=point, a=action, k=self.key)
        if action == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "connkill":
            self._kill_my_connection()
        elif action == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
            self.record("resume", k=self.key)

    def _kill_my_connection(self) -> None:
        """``KILL`` this client's session from a second connection: to the
        server it is an administrator's KILL, to the client a dropped link."""
        import MySQLdb

        raw = self.connection.connection
        if raw is None:
            return
        thread_id = raw.thread_id()
        for _ in range(2):
            try:
                if self.side is None:
                    settings = self.connection.settings_dict
                    self.side = MySQLdb.connect(
                        host=settings["HOST"],
                        port=int(settings["PORT"]),
                        user=settings["USER"],
                        password=settings["PASSWORD"],
                        connect_timeout=3,
                    )
                self.side.cursor().execute(f"KILL {int(thread_id)}")
                return
            except MySQLdb.OperationalError as exc:
                if exc.args and exc.args[0] == 1094:  # unknown thread: gone already
                    return
                self.side = None

    def _lose_the_answer(self) -> None:
        from django.db import OperationalError

        if self._take_arm("acquire.commit"):
            self.record("fault", p="acquire.commit", a="lost-response", k=self.key)
            self._kill_my_connection()
            raise OperationalError(
                2013, "Lost connection to server during query (injected after the call)"
            )

    def _install_commit_fault(self) -> None:
        from django.db import OperationalError

        real_commit = self.connection.commit

        def commit() -> None:
            granting, self.granting = self.granting, False
            real_commit()
            if granting and self._take_arm("acquire.commit"):
                self.record("fault", p="acquire.commit", a="lost-response", k=self.key)
                self._kill_my_connection()
                raise OperationalError(
                    2013, "Lost connection to server during query (injected after COMMIT)"
                )

        self.connection.commit = commit  # type: ignore[method-assign]

    # --- the work ---------------------------------------------------------------

    def run(self) -> None:
        self.record("start", pid=os.getpid(), owner=self.owner)
        self._install_commit_fault()
        with self.connection.execute_wrapper(self._hook):
            while time.monotonic() < self.deadline and not self.stop.exists():
                self.one_operation()
        self.record("end")

    def _demand(self) -> tuple[dict[str, int], dict[str, Any]]:
        mixes = self.config["mix"]
        mix = self.random.choices(mixes, weights=[m["weight"] for m in mixes])[0]
        names = self.random.sample(mix["names"], mix.get("take", 1))
        counts = mix.get("counts", [1])
        demand = {name: self.random.choice(counts) for name in names}
        return demand, mix

    def one_operation(self) -> None:
        from django_semaphore import acquire
        from django_semaphore.exceptions import (
            DatabaseUnavailable,
            LockContention,
            PermitAlreadyReleased,
            SemaphoreError,
            SemaphoreExhausted,
        )

        demand, mix = self._demand()
        # Opposite orders on purpose: the app must sort, callers need not.
        if mix.get("shuffle") and self.random.random() < 0.5:
            names: Any = list(reversed(list(demand)))
            names = {name: demand[name] for name in names}
        else:
            names = demand
        ttl = mix.get("ttl")
        self.key = key = uuid.uuid4().hex
        for attempt in range(1, 1000):
            self.record("inv", k=key, d=demand, ttl=ttl, a=attempt)
            try:
                request = acquire(names, external_id=key, owner=self.owner, ttl=ttl)
            except SemaphoreExhausted as exc:
                self.record("fail", k=key, x=type(exc).__name__)
                time.sleep(self.random.uniform(0, self.config.get("backoff", 0.002)))
                return
            except PermitAlreadyReleased as exc:
                # A retried key whose grant had already expired: it was granted.
                self.record("fail", k=key, x=type(exc).__name__, m=str(exc)[:200])
                return
            except (DatabaseUnavailable, LockContention) as exc:
                # Indeterminate: the grant may have committed. Retry the same
                # key until the answer is known; it must be the same request.
                self.record("fail", k=key, x=type(exc).__name__, m=str(exc)[:200], indet=1)
                if time.monotonic() > self.deadline + 10:
                    return
                time.sleep(self.random.uniform(0.05, 0.3))
                continue
            except SemaphoreError as exc:
                self.record("fail", k=key, x=type(exc).__name__, m=str(exc)[:300], odd=1)
                return
            except Exception as exc:  # a raw error surfaced: the checker counts it
                self.record("raw", k=key, x=type(exc).__name__, m=str(exc)[:300])
                return
            break
        else:
            return
        self.record(
            "ok",
            k=key,
            id=request.pk,
            tok=request.fencing_tokens,
            ca=request.created_at.isoformat(),
        )
        self.hold(request, mix)
        self.release(key)

    def hold(self, request: Any, mix: dict[str, Any]) -> None:
        low, high = self.config.get("hold", (0.0, 0.002))
        time.sleep(self.random.uniform(low, high))
        # A pause only means something where a TTL can lapse and a fence guards.
        pausing = self.fault.get("action") == "sigstop"
        if (mix.get("fence") or not pausing) and self._take_arm("hold"):
            self._fire("hold")
        if mix.get("fence"):
            self.fenced_write(request, mix["fence"])
        if mix.get("renew") and self.random.random() < mix["renew"]:
            self.renew(request)

    def fenced_write(self, request: Any, name: str) -> None:
        """A downstream write guarded by ``fencing.advance``, in one transaction."""
        from django.db import transaction

        from django_semaphore import fencing
        from django_semaphore.exceptions import SemaphoreError, StaleFencingToken

        token = request.fencing_tokens[name]
        try:
            with transaction.atomic():
                fencing.advance(f"resource-{name}", token)
                with self.connection.cursor() as cursor:
                    cursor.execute(
                        "INSERT INTO faults_write (resource, token, ext, client)"
                        " VALUES (%s, %s, %s, %s)",
                        [f"resource-{name}", token, request.external_id, self.name],
                    )
        except StaleFencingToken as exc:
            self.record("write", k=request.external_id, tok=token, ok=0, hi=exc.highest)
        except SemaphoreError as exc:
            self.record("write", k=request.external_id, tok=token, ok=-1, x=type(exc).__name__)
        except Exception as exc:
            # Raw errors from the guarded write itself (our own INSERT) are
            # the resource's business; from advance they are the app's.
            self.record("raw", k=request.external_id, x=type(exc).__name__, m=str(exc)[:300])
        else:
            self.record("write", k=request.external_id, tok=token, ok=1)

    def renew(self, request: Any) -> None:
        from django_semaphore import renew
        from django_semaphore.exceptions import PermitAlreadyReleased, SemaphoreError

        try:
            renew(request.external_id)
        except PermitAlreadyReleased as exc:
            self.record("renew", k=request.external_id, ok=0, x=type(exc).__name__)
        except SemaphoreError as exc:
            self.record("renew", k=request.external_id, ok=-1, x=type(exc).__name__)
        except Exception as exc:
            self.record("raw", k=request.external_id, x=type(exc).__name__, m=str(exc)[:300])
        else:
            self.record("renew", k=request.external_id, ok=1)

    def release(self, key: str) -> None:
        from django_semaphore import release
        from django_semaphore.exceptions import SemaphoreError

        for _ in range(100):
            self.record("rel", k=key)
            try:
                outcome = release(key)
            except SemaphoreError as exc:
                self.record("relfail", k=key, x=type(exc).__name__, m=str(exc)[:200])
                if time.monotonic() > self.deadline + 10:
                    return
                time.sleep(self.random.uniform(0.05, 0.3))
                continue
            except Exception as exc:
                self.record("raw", k=key, x=type(exc).__name__, m=str(exc)[:300])
                return
            self.record("relok", k=key, o=outcome.name)
            return


def main() -> None:
    config = json.loads(sys.argv[1])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.faults.settings")
    import django

    django.setup()
    try:
        Client(config).run()
    finally:
        from django.db import connections

        connections.close_all()


if __name__ == "__main__":
    main()
