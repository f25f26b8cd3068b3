"""Round trips to the server, counted by the client, per thread.

Every statement a client sends is a round trip: the app's (through Django)
and the seed's (its own DB-API cursor) are counted at the same place, the
driver, so transaction control that never passes through a cursor is
counted too (MySQLdb's ``commit()``, ``rollback()`` and an ``autocommit()``
that changes the mode; psycopg's implicit ``BEGIN``, ``COMMIT`` and
``ROLLBACK``). A psycopg statement prepared on the server counts its
``PREPARE`` once more, the run it is prepared. SQLite has no server: its
statements are counted all the same.

``install()`` patches the drivers' classes once per process; the cost is
one Python call per statement, the same for every system measured.
``record()`` also keeps each statement's text (for ``benchmarks.profile``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_local = threading.local()
_installed = False


def count() -> int:
    """Round trips sent by this thread so far."""
    return getattr(_local, "n", 0)


def _sent(text: Any) -> None:
    _local.n = getattr(_local, "n", 0) + 1
    log = getattr(_local, "log", None)
    if log is not None:
        if isinstance(text, bytes | bytearray):
            text = bytes(text).decode(errors="replace")
        log.append(" ".join(str(text).split()))


@contextmanager
def record() -> Iterator[list[str]]:
    """The statements this thread sends inside the block, in order."""
    log: list[str] = []
    _local.log = log
    try:
        yield log
    finally:
        _local.log = None


def install() -> None:
    """Count every round trip of this process's MySQLdb, psycopg and sqlite3."""
    global _installed
    if _installed:
        return
    _installed = True
    _install_mysqldb()
    _install_psycopg()
    _install_sqlite()


def _install_mysqldb() -> None:
    try:
        from MySQLdb import _mysql
        from MySQLdb.connections import Connection
    except ImportError:
        return
    query, autocommit = Connection.query, Connection.autocommit

    def counted_query(self: Any, sql: Any) -> Any:
        _sent(sql)
        return query(self, sql)

    def counted_autocommit(self: Any, on: Any) -> Any:
        if self.get_autocommit() != bool(on):  # MySQLdb sends nothing otherwise
            _sent(f"SET autocommit={int(bool(on))}")
        return autocommit(self, on)

    def control(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def counted(self: Any) -> Any:
            _sent(name)
            return method(self)

        return counted

    Connection.query = counted_query
    Connection.autocommit = counted_autocommit
    Connection.commit = control("COMMIT", _mysql.connection.commit)
    Connection.rollback = control("ROLLBACK", _mysql.connection.rollback)


def _install_psycopg() -> None:
    try:
        from psycopg._connection_base import BaseConnection
        from psycopg._cursor_base import BaseCursor
    except ImportError:
        return
    exec_command = BaseConnection._exec_command
    maybe_prepare = BaseCursor._maybe_prepare_gen

    # Each returns the original generator: no generator in between.
    def counted_command(self: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        _sent(command if isinstance(command, bytes | str) else repr(command))
        return exec_command(self, command, *args, **kwargs)

    def counted_statement(self: Any, pgq: Any, *args: Any, **kwargs: Any) -> Any:
        _sent(pgq.query)
        return maybe_prepare(self, pgq, *args, **kwargs)

    BaseConnection._exec_command = counted_command  # type: ignore[method-assign]
    BaseCursor._maybe_prepare_gen = counted_statement  # type: ignore[method-assign]


def _install_sqlite() -> None:
    # sqlite3's classes are C types: the raw clients count their own
    # statements (sent()); Django's are counted at its cursor wrapper.
    try:
        from django.db.backends.sqlite3 import base
    except ImportError:
        return
    execute = base.SQLiteCursorWrapper.execute
    executemany = base.SQLiteCursorWrapper.executemany

    def counted_execute(self: Any, query: Any, params: Any = None) -> Any:
        _sent(query)
        return execute(self, query, params)

    def counted_executemany(self: Any, query: Any, param_list: Any) -> Any:
        _sent(query)
        return executemany(self, query, param_list)

    base.SQLiteCursorWrapper.execute = counted_execute  # type: ignore[method-assign]
    base.SQLiteCursorWrapper.executemany = counted_executemany  # type: ignore[method-assign]


def sent(statement: str) -> None:
    """Count a statement sent outside the patched drivers (the raw SQLite clients)."""
    _sent(statement)
