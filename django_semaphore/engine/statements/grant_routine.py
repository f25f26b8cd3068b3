"""The grant routines' text: what the one-trip grant (``one_trip.py``) runs
in the database -- PostgreSQL's functions (for one name, for several),
MariaDB's procedure (one name) and block (several) -- made of the general
grant's own statements: its locking read, its request insert, counter
update and permits insert (``statements/__init__.py``), and the ticket
statements of the line (``tickets.py``).

The decision for one name (``GrantRoutine.decide``) is written once, in the
procedural SQL both servers share (``IF ... THEN ... END IF``), with each
server's spelling of an assignment, a loop, a sleep and an answer
(``_Server``); the room check of every routine is ``_short``: a request
fits where the permits held, plus its count, plus what the older tickets
that lacked room ask for, stay within the capacity -- the rule
``engine/line.py`` states in Python. The decision serves the line: a
waiter's refusal (its ticket taken), a grant behind a live queue; the first
waiter in line waits in it, at most ``HEAD_WAIT_MS``, for a release, the
next in line queued behind it -- in the names' queue on PostgreSQL, on the
row's lock on MariaDB -- each handed its turn by the database.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore.engine.statements import (
    MARKED_EVERY,
    SQL,
    built,
    placeholders,
    queue,
    statements,
    with_arguments,
)
from django_semaphore.engine.statements.rows import LOCKED_COLUMNS
from django_semaphore.engine.statements.tickets import ticket_statements

# The first waiter in the line of one name waits for a release in its
# call for at most HEAD_WAIT_MS milliseconds, reading the release total every
# HEAD_POLL_US microseconds, before it is refused; any other call that finds
# no room, with nobody ahead in the line, for at most BRIEF_WAIT_US: callers
# that retry at once then wait their turn asleep behind it, on the row's
# lock, instead of taking the processor from the holders that release, and
# a release meanwhile is handed over in the same call. Waits of callers
# that fail fast may stack (each thinks itself first): hence brief.
HEAD_WAIT_MS, HEAD_POLL_US, BRIEF_WAIT_US = 50, 500, 2000
# The one-name routine's answer, a row: granted, or refused (the last four,
# with the routine's clock as granted_at and the name, token and count).
ANSWER: tuple[str, ...] = ("granted_request", "granted_at", "granted_expires_at", "granted_name")
ANSWER += ("granted_token", "granted_in_use", "refused_id", "refused_capacity")
ANSWER += ("refused_rounds", "refused_ticket")


@dataclass(frozen=True)
class _Server:
    """How one server's procedural SQL spells what the routines do."""

    postgresql: bool
    clock: str  # the database's clock, read when evaluated
    bound: str = ""  # what bounds a write's lock wait (PostgreSQL: the transaction's setting)

    def let(self, to_sql: str, value_sql: str) -> str:
        return f"{to_sql} := {value_sql}" if self.postgresql else f"SET {to_sql} = {value_sql}"

    def after(self, moment: str, amount: str, unit: str) -> str:
        """``moment`` plus ``amount`` ``unit``s (SECOND, MICROSECOND); NULL if it is."""
        if self.postgresql:
            return f"{moment} + ({amount}) * interval '1 {unit.lower()}'"
        return f"{moment} + INTERVAL ({amount}) {unit}"

    def sleep(self, us: int) -> str:
        return f"PERFORM pg_sleep({us}e-6)" if self.postgresql else f"DO SLEEP({us}e-6)"

    def loop(self, condition: str, body: str) -> str:
        do, end = ("LOOP", "LOOP") if self.postgresql else ("DO", "WHILE")
        return f"WHILE {condition} {do} {body} END {end}"

    @property
    def div(self) -> str:
        return "/" if self.postgresql else "DIV"

    @property
    def read_committed(self) -> str:
        """Whether the session reads at READ COMMITTED: only there does a
        wait at the head see the releases committed meanwhile (at REPEATABLE
        READ it would see none, and MariaDB's SERIALIZABLE would make every
        release wait behind it)."""
        if self.postgresql:
            return "current_setting('transaction_isolation') = 'read committed'"
        return "@@tx_isolation = 'READ-COMMITTED'"

    def answer(self, values: tuple[str, ...], first: int = 0) -> str:
        """The one-name routine's answer, ``ANSWER``'s columns from the
        ``first`` on (NULL the others), committed; the routine ends."""
        given = dict(zip(ANSWER[first:], values, strict=False))
        if self.postgresql:
            return " ".join(f"{c} := {v};" for c, v in given.items()) + " RETURN NEXT; RETURN;"
        row = ", ".join(given.get(column, "NULL") for column in ANSWER)
        return f"COMMIT; SELECT {row}; LEAVE body;"

    @property
    def decline(self) -> str:
        """Not here: the general grant's turn, nothing written."""
        if self.postgresql:
            return "RETURN;"
        return f"ROLLBACK; SELECT {', '.join(['NULL'] * len(ANSWER))}; LEAVE body;"


@dataclass(frozen=True)
class _Row:
    """How a routine names a locked semaphore's columns, its release total
    as last read, its permits held, and the count asked of it."""

    id: str
    in_use_counter: str
    released_folded: str
    capacity: str
    released: str
    held: str
    count: str
    name: str = ""
    fencing_counter: str = ""
    queued_until: str = ""

    @classmethod
    def named(cls, template: str) -> _Row:
        """Every value a variable named by ``template`` from its field's name."""
        return cls(**{field: template.format(field) for field in cls.__dataclass_fields__})


def _short(row: _Row, kept: str = "") -> str:
    """Whether the count does not fit beside the permits held and what ``kept``."""
    return f"{row.held} + {row.count}{f' + {kept}' if kept else ''} > {row.capacity}"


class GrantRoutine(SQL):
    """The grant routines' text, for one connection."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        super().__init__(connection)
        self.general = statements(connection)
        self.key_taken_sql = f"EXISTS ({with_arguments(self.key_sql, 'p_key')})"
        # MariaDB's blocks: by number of names, then by lock-wait bound.
        self.blocks: dict[tuple[int, int], str] = {}

    # --- the decision and the writes, once for both servers --------------------

    def decide(self, server: _Server, row: _Row) -> str:
        """The decision on one name, once its row is locked and its permits
        held read (``row``): granted, it goes on to the writes; refused, it
        answers; declined, the general grant's turn. Behind a live queue it
        fits only beside what the older tickets that lacked room ask for. A
        caller that finds no room with nobody ahead waits here for a
        release (``HEAD_WAIT_MS`` for a waiter, ``BRIEF_WAIT_US`` for a
        caller that fails fast); a waiter is refused with its ticket taken,
        a caller that fails fast plainly. A taken key's request and a
        reclaim of expired permits are left to the general grant
        (``one_trip.py`` says why).

        It runs the line's statements (``tickets.py``) on the row, in a
        routine whose key, owner, priority (and its head start, seconds),
        clock and deadline are ``p_key``, ``p_owner``, ``p_priority``,
        ``p_head_start``, ``v_now`` and ``v_deadline``; the writes that may
        wait for a lock bounded."""
        let, tickets, bound = server.let, ticket_statements(self.connection), server.bound
        # The line's statements on the row: the older tickets that lack room;
        # the key's ticket taken (lacking room until v_deadline, its expiry),
        # the queue live until then at least; the key's ticket deleted; the
        # queue over where no live ticket lacks room.
        older_sql = with_arguments(
            tickets.older_sql[True].format(ids="%s"), row.id, "TRUE", "v_now", "p_key", "p_key"
        )
        ahead_sql = (
            "SELECT COUNT(*), COALESCE(SUM(o.permits), 0) INTO v_ahead, v_reserved"
            f" FROM ({older_sql}) o"
        )
        ranked = server.after("v_now", "-ROUND(p_head_start * 1000000)", "MICROSECOND")
        # Without a share key: a waiter with one takes its first tickets in
        # the general grant, which reads its key's turn (``one_trip.py``).
        take_sql = bound + with_arguments(
            tickets.insert_sql[True].format(rows=f"({placeholders(11)})"),
            *(row.id, "p_key", "p_owner", row.count, "v_now", "v_deadline", "TRUE"),
            *("p_priority", ranked, "''", "NULL"),
        )
        queue_until_sql = with_arguments(
            tickets.queued_until_sql.format(ids="%s"), "v_deadline", row.id, "v_deadline"
        )
        delete_sql = bound + with_arguments(tickets.delete_sql.format(ids="%s"), "p_key", row.id)
        over_sql = with_arguments(tickets.queue_over_sql.format(ids="%s"), row.id, "TRUE", "v_now")
        expired_sql = self.general.expired_sql.format(ids=row.id, now="v_now")
        in_line = "p_life IS NOT NULL"
        head_wait = f"CASE WHEN {in_line} THEN {HEAD_WAIT_MS * 1000} ELSE {BRIEF_WAIT_US} END"
        life = "ROUND(p_life * 1000000)"
        catch_up = (
            f"{server.sleep(HEAD_POLL_US)}; {self._read_released(row)};"
            f" {self._held(server, row)}; {let('v_now', server.clock)};"
        )
        rounds = f"(v_reserved + {row.count} - 1) {server.div} GREATEST({row.capacity}, 1)"
        # Refused: its clock in the grant's (a ticket it took ranks from it).
        refused = (
            "v_now",
            "NULL",
            row.name,
            row.fencing_counter,
            row.held,
            row.id,
            row.capacity,
            rounds,
            "v_ticket",
        )
        return (
            f" {let('v_now', server.clock)};"
            f" IF {row.queued_until} > v_now OR p_ticketed OR {_short(row)} THEN"
            f" {let('v_live', f'COALESCE({row.queued_until} > v_now, FALSE)')};"
            # What the older tickets that lacked room ask for stays theirs.
            f" IF v_live THEN {ahead_sql}; END IF;"
            f" IF {_short(row, 'v_reserved')} THEN"
            f" IF {self.key_taken_sql} THEN {server.decline} END IF;"
            # Where its ticket, if it takes one, expires: a lease (the
            # waiter renews it), at most its deadline; no wait runs past it.
            f" {let('v_deadline', server.after('v_now', life, 'MICROSECOND'))};"
            # First in line: it waits for a release here, the next in line behind it.
            f" IF v_reserved = 0 AND {server.read_committed} THEN"
            f" {let('v_until', server.after('v_now', head_wait, 'MICROSECOND'))};"
            f" IF v_deadline < v_until THEN {let('v_until', 'v_deadline')}; END IF;"
            f" {server.loop(f'{_short(row)} AND v_now < v_until', catch_up)};"
            " END IF;"
            f" IF {_short(row, 'v_reserved')} THEN"
            # Read last: MariaDB reads it locking the holders' requests,
            # which their releases would wait for all through the wait.
            f" IF {_short(row)} AND {expired_sql} THEN {server.decline} END IF;"
            f" {let('v_ticket', f'{in_line} AND NOT (p_ticketed AND p_lacked)')};"
            f" IF v_ticket THEN {take_sql}; {queue_until_sql}; END IF;"
            f" {server.answer(refused, first=1)}"
            " END IF;"
            " END IF;"
            # Granted: its tickets stop holding back others; a queue that
            # held nobody back any more is over.
            f" IF p_ticketed OR v_live THEN {delete_sql};"
            f" IF v_live AND v_ahead = 0 AND NOT p_ticketed THEN {over_sql}; END IF;"
            " END IF;"
            " END IF;"
        )

    def insert_request(self, server: _Server) -> str:
        """The general grant's insert of the request (``p_key``, ``p_owner``,
        ``p_ttl``) stamped ``v_now``, its id into ``v_request``; a taken key
        fails on the unique index as it does there."""
        sql = with_arguments(
            self.general.insert_request_sql.format(expires="v_expires", now="v_now"),
            *("p_key", "p_owner", f"'{self.acquired}'", "p_ttl"),
        )
        expires_sql = server.let("v_expires", server.after("v_now", "p_ttl", "SECOND"))
        if server.postgresql:
            return f" {expires_sql}; {sql} RETURNING {self.q('id')} INTO v_request;"
        return f" {expires_sql}; {server.bound}{sql}; SET v_request = LAST_INSERT_ID();"

    def count_grant(self, row: _Row, fold_sql: str) -> str:
        """The general grant's update of the row's counters and fencing token."""
        sum_sql, ids = f"{row.held} + {row.count}", row.id
        sql = self.general.grant_sql.format(counted=sum_sql, folded=fold_sql, slots="0", ids=ids)
        stale = f"v_now - INTERVAL '{MARKED_EVERY.total_seconds():.0f}' SECOND"
        return f" {with_arguments(sql, stale, 'v_now')};"

    def insert_permits(self, rows_sql: str) -> str:
        """The general grant's insert of the permits, its rows ``rows_sql``:
        in semaphore id order, as a release by key reaches the release
        counters through them (release.py)."""
        return f" {self.general.insert_permits_sql.format(rows=rows_sql)};"

    def grant_one(self, server: _Server, row: _Row) -> str:
        """The writes of a grant on one name, and its answer."""
        token_sql = f"{row.fencing_counter} + 1"
        permits = f"VALUES ({row.id}, v_request, {row.count}, {token_sql}, NULL, '{self.acquired}')"
        sum_sql = f"{row.held} + {row.count}"
        granted = ("v_request", "v_now", "v_expires", row.name, token_sql, sum_sql)
        return (
            f"{self.insert_request(server)}{self.count_grant(row, _folded(row))}"
            f"{self.insert_permits(permits)} {server.answer(granted)}"
        )

    def _not_refused(self, ids_sql: str) -> str:
        """Whether a call that lacks room on several names (``ids_sql``) is
        left to the general grant: it waits (refused there, measured faster:
        ``one_trip.py``), its key is taken, or expired holders are there to
        reclaim. A call that fails fast is refused in the routine."""
        expired = self.general.expired_sql.format(ids=ids_sql, now="v_now")
        return f"NOT p_fail_fast OR {self.key_taken_sql} OR {expired}"

    def _held(self, server: _Server, row: _Row) -> str:
        """The row's permits held (``rows.held``), into ``row.held``."""
        return server.let(
            row.held,
            f"GREATEST({row.in_use_counter}"
            f" - GREATEST(COALESCE({row.released}, 0) - {row.released_folded}, 0), 0)",
        )

    def _read_released(self, row: _Row) -> str:
        return (
            f"SELECT c.{self.q('released')} INTO {row.released} FROM {self.counter} c"
            f" WHERE c.{self.q('semaphore_id')} = {row.id}"
        )

    def lock_into(self, count: int, targets: str = "") -> str:
        """The manager's locking read of ``count`` semaphores by name (as the
        general path compiles it), its columns read into ``targets``, if given."""
        sql = self.general.lock_sql(count)
        if not targets:
            return sql
        source = f" FROM {self.semaphore} WHERE "
        return self.replaced_once(sql, source, f" INTO {targets}{source}")

    # --- PostgreSQL -------------------------------------------------------------

    def function_body(self) -> str:
        """PostgreSQL's function for several names (``routines.py`` renders it)."""
        q, server = self.q, _Server(postgresql=True, clock=self.now)
        locking = self._locking_read_of("= ANY(p_names)")
        row = _Row(
            "v_ids[i]",
            "v_counted[i]",
            "v_folded[i]",
            "v_capacities[i]",
            "v_released",
            "v_held[i]",
            "v_counts[i]",
        )
        return (
            "\nDECLARE s record; i integer; v_count integer; v_released bigint;"
            " v_ids bigint[] := '{}'; v_names text[] := '{}'; v_counts integer[] := '{}';"
            " v_capacities bigint[] := '{}'; v_counted bigint[] := '{}';"
            " v_folded bigint[] := '{}'; v_tokens bigint[] := '{}'; v_held bigint[] := '{}';"
            " v_now timestamptz; v_expires timestamptz; v_request bigint;"
            " v_short integer[] := '{}';\n"
            f"BEGIN\n{queue.waits_sql('p_names', 'p_lock_wait')}"
            f" FOR s IN {locking} LOOP\n"
            "  v_count := p_counts[array_position(p_names, s.name::text)];\n"
            f"  IF v_count IS NULL OR s.{q('window')} IS NOT NULL"
            " OR COALESCE(s.queue_live, false) OR v_count > s.capacity THEN RETURN; END IF;\n"
            "  v_ids := v_ids || s.id::bigint; v_names := v_names || s.name::text;"
            " v_counts := v_counts || v_count; v_capacities := v_capacities || s.capacity::bigint;"
            " v_counted := v_counted || s.in_use_counter::bigint;"
            " v_folded := v_folded || s.released_folded::bigint;"
            " v_tokens := v_tokens || (s.fencing_counter + 1)::bigint;\n"
            " END LOOP;\n"
            " IF cardinality(v_ids) <> cardinality(p_names) THEN RETURN; END IF;\n"
            # A statement of its own, so read once the locks are held: the
            # releases committed during the wait count.
            f" FOR i IN 1 .. cardinality(v_ids) LOOP {self._read_released(row)};"
            f" {self._held(server, row)}; IF {_short(row)} THEN v_short := v_short || i; END IF;"
            f" v_folded[i] := GREATEST(COALESCE(v_released, 0), v_folded[i]); END LOOP;\n"
            f" v_now := {server.clock};\n"
            f" IF cardinality(v_short) > 0 THEN IF {self._not_refused('SELECT unnest(v_ids)')}"
            " THEN RETURN; END IF;\n"
            "  RETURN QUERY SELECT NULL::bigint, NULL::timestamptz, NULL::timestamptz, v_names[k],"
            " v_tokens[k] - 1, v_held[k], v_ids[k], v_capacities[k] FROM unnest(v_short) AS k;"
            " RETURN;\n"
            f" END IF;{self.insert_request(server)}\n"
            f" FOR i IN 1 .. cardinality(v_ids) LOOP{self.count_grant(row, row.released_folded)}"
            " END LOOP;\n"
            + self.insert_permits(
                f"SELECT g.id, v_request, g.n, g.token, NULL, '{self.acquired}'"
                " FROM unnest(v_ids, v_counts, v_tokens) AS g(id, n, token) ORDER BY g.id"
            )
            + "\n RETURN QUERY SELECT v_request, v_now, v_expires, g.name, g.token, g.held + g.n,"
            " NULL::bigint, NULL::bigint"
            " FROM unnest(v_names, v_tokens, v_held, v_counts) AS g(name, token, held, n);\n"
            "END\n"
        )

    def one_name_function_body(self) -> str:
        """PostgreSQL's function for one name (``routines.py`` renders it):
        the general function's steps on one row read into a record, and the
        decision (``decide``)."""
        server = _Server(postgresql=True, clock=self.now)
        row = replace(_Row.named("s.{}"), released="v_released", held="v_held", count="p_count")
        return (
            "\nDECLARE s record; v_released bigint; v_held bigint; v_request bigint;"
            " v_now timestamptz; v_expires timestamptz; v_until timestamptz;"
            " v_deadline timestamptz; v_live boolean := false; v_ticket boolean;"
            " v_ahead bigint := 0; v_reserved bigint := 0;\n"
            f"BEGIN\n{queue.waits_for_one_sql('p_name', 'p_lock_wait')}"
            f" {self._locking_read_of('= p_name', 's')};\n"
            # Names are exact, as Python compares them (not as a collation may).
            f" IF NOT FOUND OR s.name::text <> p_name OR s.{self.q('window')} IS NOT NULL"
            " OR p_count > s.capacity THEN RETURN; END IF;\n"
            f" {self._read_released(row)}; {self._held(server, row)};\n"
            f"{self.decide(server, row)}\n{self.grant_one(server, row)}\nEND\n"
        )

    def _locking_read_of(self, names_sql: str, targets: str = "") -> str:
        """The manager's locking read of one name, its condition on the name
        made ``names_sql`` (a PostgreSQL function's parameters)."""
        return self.replaced_once(self.lock_into(1, targets), "IN (%s)", names_sql)

    # --- MariaDB ----------------------------------------------------------------

    def procedure_body(self) -> str:
        """MariaDB's procedure for one name (``routines.py`` renders it): the
        locking read into variables, and the decision (``decide``)."""
        wait = "SET STATEMENT innodb_lock_wait_timeout = p_wait FOR "
        server = _Server(postgresql=False, clock=self.now, bound=wait)
        row = _Row.named("v_{}_1")
        locking = with_arguments(self.lock_into(1, _mariadb_targets(1)), "p_name")
        return (
            f"body: BEGIN {self._mariadb_declarations(1)}"
            " DECLARE v_request BIGINT; DECLARE v_now, v_expires, v_until, v_deadline DATETIME(6);"
            " DECLARE v_live, v_ticket BOOL DEFAULT FALSE;"
            " DECLARE v_ahead, v_reserved BIGINT DEFAULT 0;"
            " DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;"
            f" START TRANSACTION; {wait}{locking};"
            # Names are exact, as Python compares them (not as the collation does).
            f" SET {row.count} = CASE CAST({row.name} AS BINARY)"
            " WHEN CAST(p_name AS BINARY) THEN p_count END; "
            f"{self._held(server, row)};"
            f" IF {row.count} IS NULL OR v_window_1 IS NOT NULL OR {row.count} > {row.capacity}"
            f" THEN {server.decline} END IF;"
            f"{self.decide(server, row)}{self.grant_one(server, row)} END"
        )

    def block(self, count: int, wait: int) -> str:
        """MariaDB's block for ``count`` names (two or more), its lock-wait
        bound ``wait`` seconds, built once. Its parameters: key, owner, ttl,
        whether the call fails fast, the names, then every (name, count)
        pair for each locked row. The
        rows are read by a cursor over the locking read, opened under the
        lock-wait bound (which ``SET STATEMENT`` cannot wrap)."""
        if (count, wait) not in self.blocks:
            self.blocks[count, wait] = self._mariadb_block(count, wait)
        return self.blocks[count, wait]

    def _mariadb_block(self, count: int, wait: int) -> str:
        bound = f"SET STATEMENT innodb_lock_wait_timeout = {wait} FOR "
        server = _Server(postgresql=False, clock=self.now, bound=bound)
        q, rows = self.q, [_Row.named(f"v_{{}}_{i}") for i in range(1, count + 1)]
        column = f"{self.request}.{q('external_id')}"
        # Names are exact, as Python compares them (not as the collation does).
        exact_sql = " ".join(["WHEN CAST(%s AS BINARY) THEN %s"] * count)
        checks_sql = "".join(
            f" SET {row.count} = CASE CAST({row.name} AS BINARY) {exact_sql} END;"
            f" {self._held(server, row)};"
            for row in rows
        )
        declined_sql = " OR ".join(
            f"{row.count} IS NULL OR v_window_{i} IS NOT NULL"
            f" OR COALESCE(v_queue_live_{i}, 0) OR {row.count} > {row.capacity}"
            for i, row in enumerate(rows, 1)
        )
        short_sql = " OR ".join(_short(row) for row in rows)
        # The release totals read with the locks may predate the wait for a
        # later row: read again before saying no.
        again_sql = "".join(
            f" {self._read_released(row)}; {self._held(server, row)};" for row in rows
        )
        refused_sql = " UNION ALL ".join(
            f"SELECT NULL, NULL, NULL, {row.name}, {row.fencing_counter}, {row.held}, {row.id},"
            f" {row.capacity} FROM DUAL WHERE {_short(row)}"
            for row in rows
        )
        decline_sql = f"ROLLBACK; SELECT {', '.join(['NULL'] * 6)};"
        permits_sql = " UNION ALL ".join(
            f"SELECT {row.id} AS id, {row.count} AS n, {row.fencing_counter} + 1 AS token"
            for row in rows
        )
        granted_sql = " UNION ALL ".join(
            f"SELECT v_request, v_now, v_expires, {row.name}, {row.fencing_counter} + 1,"
            f" {row.held} + {row.count}"
            for row in rows
        )
        return (
            f"BEGIN NOT ATOMIC DECLARE p_key TYPE OF {column} DEFAULT %s;"
            f" DECLARE p_owner TYPE OF {self.request}.{q('owner')} DEFAULT %s;"
            f" DECLARE p_ttl INT DEFAULT %s; DECLARE p_fail_fast BOOL DEFAULT %s;"
            f" {self._mariadb_declarations(count)}"
            " DECLARE v_request BIGINT; DECLARE v_now, v_expires DATETIME(6);"
            " DECLARE v_waited BIGINT; DECLARE v_done BOOL DEFAULT FALSE;"
            f" DECLARE c CURSOR FOR {self.lock_into(count)};"
            " DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_done = TRUE;"
            " DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK;"
            " IF v_waited IS NOT NULL THEN"
            " SET SESSION innodb_lock_wait_timeout = v_waited; END IF; RESIGNAL; END;"
            " SET v_waited = @@innodb_lock_wait_timeout;"
            f" START TRANSACTION; SET SESSION innodb_lock_wait_timeout = {wait};"
            " OPEN c; SET SESSION innodb_lock_wait_timeout = v_waited; SET v_waited = NULL;"
            + "".join(f" FETCH c INTO {_mariadb_targets(i)};" for i in range(1, count + 1))
            + f" CLOSE c;{checks_sql}"
            f" IF v_done OR {declined_sql} THEN {decline_sql}"
            f" ELSE IF {short_sql} THEN{again_sql} END IF; SET v_now = {server.clock};"
            f" IF {short_sql} THEN IF {self._not_refused(', '.join(row.id for row in rows))}"
            f" THEN {decline_sql} ELSE ROLLBACK; {refused_sql}; END IF;"
            f" ELSE{self.insert_request(server)}"
            + "".join(self.count_grant(row, _folded(row)) for row in rows)
            + self.insert_permits(
                f"SELECT g.id, v_request, g.n, g.token, NULL, '{self.acquired}'"
                f" FROM ({permits_sql}) AS g ORDER BY g.id"
            )
            + f" COMMIT; {granted_sql}; END IF; END IF; END"
        )

    def _mariadb_declarations(self, count: int) -> str:
        """The variables of ``count`` locked rows. Numbers signed: a counter
        written behind the engine's back may make their differences
        negative, which unsigned columns' types would refuse."""
        numbers = {"id", "capacity", "in_use_counter", "released_folded", "fencing_counter"}
        typed = (
            f"DECLARE v_{column}_{i} "
            + ("BIGINT" if column in numbers else f"TYPE OF {self.semaphore}.{self.q(column)}")
            + ";"
            for i in range(1, count + 1)
            for column in LOCKED_COLUMNS
            if column != "queue_live"
        )
        return " ".join(typed) + "".join(
            f" DECLARE v_queue_live_{i} BOOL; DECLARE v_released_{i}, v_held_{i} BIGINT;"
            f" DECLARE v_count_{i} INT;"
            for i in range(1, count + 1)
        )


def _mariadb_targets(i: int) -> str:
    """MariaDB: the variables the locking read of row ``i`` reads into."""
    return ", ".join(f"v_{column}_{i}" for column in (*LOCKED_COLUMNS, "released"))


def _folded(row: _Row) -> str:
    """The release total folded into the counter as the grant writes it."""
    return f"GREATEST(COALESCE({row.released}, 0), {row.released_folded})"


def grant_routine(connection: BaseDatabaseWrapper) -> GrantRoutine:
    """This connection's grant routine text."""
    return built(GrantRoutine, connection)
