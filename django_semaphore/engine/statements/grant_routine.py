"""The grant routine's text: what the one-trip grant (``one_trip.py``) runs
in the database, rendered from the grant's own statements -- PostgreSQL's
functions (for one name, for several), MariaDB's procedure (one name) and
block (several). ``routines.py`` renders the routines.

For one name it serves a fair line too (``engine/fairness.py``'s rule, the
ticket statements' own text): a waiter's refusal (its ticket taken) and a
grant behind a live queue, and the first waiter in line waits in it, at
most ``HEAD_WAIT_MS``, for a release, the next in line queued behind it --
in the names' queue on PostgreSQL, on the row's lock on MariaDB -- each
handed its turn by the database.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db.backends.base.base import BaseDatabaseWrapper

from django_semaphore.engine.statements import SQL, built, queue, statements, with_arguments
from django_semaphore.engine.statements.rows import LOCKED_COLUMNS
from django_semaphore.engine.statements.tickets import ticket_statements

# The first waiter in a fair line of one name waits for a release in its
# call for at most HEAD_WAIT_MS milliseconds, reading the release total every
# HEAD_POLL_US microseconds, before it is refused; any other call that finds
# no room, with nobody ahead in the line, for at most BRIEF_WAIT_US: callers
# that retry at once then wait their turn asleep behind it, on the row's
# lock, instead of taking the processor from the holders that release, and
# a release meanwhile is handed over in the same call. Waits of callers
# outside a fair line may stack (each thinks itself first): hence brief.
HEAD_WAIT_MS, HEAD_POLL_US, BRIEF_WAIT_US = 50, 500, 2000
# The block's parameters as the MariaDB procedure names them, in order.
PROCEDURE_ARGUMENTS = ("p_name", "p_name", "p_count", "p_ttl", "p_ttl", "p_key", "p_owner", "p_ttl")


@dataclass(frozen=True)
class LineStatements:
    """A fair line's statements (``tickets.py``, the grant's reads) as a
    routine runs them on one semaphore, its values named."""

    ahead_sql: str  # the older tickets that lacked room into (v_ahead, v_reserved)
    key_taken_sql: str  # EXISTS: a request has the key
    expired_sql: str  # EXISTS: an expired request holds the semaphore
    take_sql: str  # the key's ticket, lacking room until the deadline
    queue_until_sql: str  # the queue live until the deadline at least
    delete_sql: str  # the key's ticket
    over_sql: str  # the queue over, where no live ticket lacks room


class GrantRoutine(SQL):
    """The grant routine's text, for one connection."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        super().__init__(connection)
        # MariaDB's blocks: by number of names, then by lock-wait bound.
        self.blocks: dict[tuple[int, int], str] = {}

    def lock_into(self, count: int, targets: str = "") -> str:
        """The manager's locking read of ``count`` semaphores by name (as the
        general path compiles it), its columns read into ``targets``, if given."""
        sql = statements(self.connection).lock_sql(count)
        if not targets:
            return sql
        source = f" FROM {self.semaphore} WHERE "
        if sql.count(source) != 1:  # pragma: no cover - a Django change would show here
            raise AssertionError(f"Unexpected locking read: {sql!r}")
        return sql.replace(source, f" INTO {targets}{source}")

    def block(self, count: int, wait: int) -> str:
        """MariaDB's block for ``count`` names, its lock-wait bound ``wait``
        seconds, built once."""
        block = self.blocks.get((count, wait))
        if block is None:
            block = f"BEGIN NOT ATOMIC {self._mariadb_program(count, str(wait))} END"
            self.blocks[count, wait] = block
        return block

    def procedure_body(self) -> str:
        """The MariaDB procedure's body: the block's program for one name
        and a fair line's steps, its parameters named (``routines.py``
        renders it)."""
        program = self._mariadb_program(1, "p_wait", fair_line=True)
        return f"BEGIN {with_arguments(program, *PROCEDURE_ARGUMENTS)} END"

    def _mariadb_program(self, count: int, wait_sql: str, fair_line: bool = False) -> str:
        """The grant of ``count`` names, the body of a MariaDB block or
        procedure, its lock-wait bound ``wait_sql`` (seconds). Its
        parameters, in order: the names; for each locked row, every (name,
        count) pair; ttl (twice), key, owner, ttl. With ``fair_line`` (one
        name: the procedure), a fair line's steps too, as PostgreSQL's
        function for one name takes them (``one_name_function_body``),
        named ``p_ticketed``, ``p_lacked``, ``p_fair`` and ``p_life``.

        One name is read into its variables by the locking read itself;
        more, by a cursor over it (opened under the lock-wait bound, which
        ``SET STATEMENT`` cannot wrap)."""
        q, now = self.q, self.now
        semaphore, request, permit = self.semaphore, self.request, self.permit
        columns = [*LOCKED_COLUMNS, "released"]
        rows = range(1, count + 1)
        targets_sql = {i: ", ".join(f"v_{column}_{i}" for column in columns) for i in rows}
        # Signed: a counter written behind the engine's back may make their
        # differences negative, which unsigned columns' types would refuse.
        numbers = {"id", "capacity", "in_use_counter", "released_folded", "fencing_counter"}
        declarations = " ".join(
            f"DECLARE v_{column}_{i} "
            + ("BIGINT" if column in numbers else f"TYPE OF {semaphore}.{q(column)}")
            + ";"
            for i in rows
            for column in columns
            if column not in ("queue_live", "released")
        ) + " ".join(
            f" DECLARE v_queue_live_{i} BOOL; DECLARE v_released_{i}, v_held_{i} BIGINT;"
            f" DECLARE v_count_{i} INT;"
            for i in rows
        )
        bound = f"SET STATEMENT innodb_lock_wait_timeout = {wait_sql} FOR "
        if count == 1:
            cursor_sql = ""
            locking = f" START TRANSACTION; {bound}{self.lock_into(1, targets_sql[1])};"
        else:
            lock_sql = self.lock_into(count)
            cursor_sql = (
                " DECLARE v_done BOOL DEFAULT FALSE;"
                f" DECLARE c CURSOR FOR {lock_sql};"
                " DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_done = TRUE;"
            )
            locking = (
                " SET v_waited = @@innodb_lock_wait_timeout;"
                f" START TRANSACTION; SET SESSION innodb_lock_wait_timeout = {wait_sql};"
                " OPEN c; SET SESSION innodb_lock_wait_timeout = v_waited; SET v_waited = NULL;"
                + "".join(f" FETCH c INTO {targets_sql[i]};" for i in rows)
                + " CLOSE c;"
            )
        # Names are exact, as Python compares them (not as the collation does).
        exact_sql = " ".join(["WHEN CAST(%s AS BINARY) THEN %s"] * count)
        held_sql = {i: _mariadb_held(i) for i in rows}
        checks_sql = "".join(
            f" SET v_count_{i} = CASE CAST(v_name_{i} AS BINARY) {exact_sql} END; {held_sql[i]};"
            for i in rows
        )
        declined_sql = " OR ".join(
            f"v_count_{i} IS NULL OR v_window_{i} IS NOT NULL"
            f" OR IFNULL(v_queue_live_{i}, 0) OR v_count_{i} > v_capacity_{i}"
            f" OR v_held_{i} + v_count_{i} > v_capacity_{i}"
            for i in rows
        )
        counters_sql = "".join(
            f" UPDATE {semaphore} SET {q('fencing_counter')} = {q('fencing_counter')} + 1,"
            f" {q('in_use_counter')} = v_held_{i} + v_count_{i},"
            f" {q('released_folded')} = GREATEST(IFNULL(v_released_{i}, 0),"
            f" v_released_folded_{i}), {q('updated_at')} = v_now WHERE {q('id')} = v_id_{i};"
            for i in rows
        )
        permits_sql = " UNION ALL ".join(
            f"SELECT v_id_{i} AS id, v_count_{i} AS n, v_fencing_counter_{i} + 1 AS token"
            for i in rows
        )
        # The procedure answers a refusal in four more columns.
        refusal_sql = ", NULL, NULL, NULL, NULL" if fair_line else ""
        granted_sql = " UNION ALL ".join(
            f"SELECT v_request, v_now, v_expires, v_name_{i}, v_fencing_counter_{i} + 1,"
            f" v_held_{i} + v_count_{i}{refusal_sql}"
            for i in rows
        )
        decide_sql = (
            f" IF {'v_done OR ' if count > 1 else ''}{declined_sql} THEN"
            f" ROLLBACK; SELECT NULL, NULL, NULL, NULL, NULL, NULL{refusal_sql};"
            f" ELSE SET v_now = {now};"
        )
        if fair_line:
            decide_sql = self._mariadb_line(wait_sql)
        return (
            f"{declarations}"
            " DECLARE v_request BIGINT; DECLARE v_now, v_expires DATETIME(6);"
            f" DECLARE v_waited BIGINT;{cursor_sql}"
            " DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK;"
            " IF v_waited IS NOT NULL THEN"
            " SET SESSION innodb_lock_wait_timeout = v_waited; END IF; RESIGNAL; END;"
            f"{locking}{checks_sql}{decide_sql}"
            " SET v_expires = IF(%s IS NULL, NULL, TIMESTAMPADD(SECOND, %s, v_now));"
            f" {bound}INSERT INTO {request} ({q('external_id')}, {q('owner')}, {q('state')},"
            f" {q('ttl')}, {q('expires_at')}, {q('created_at')}, {q('updated_at')},"
            f" {q('released_at')}, {q('release_reason')})"
            f" VALUES (%s, %s, '{self.acquired}', %s, v_expires, v_now, v_now, NULL, '');"
            f" SET v_request = LAST_INSERT_ID();{counters_sql}"
            # In semaphore id order: a release by key reaches the release
            # counters through the permits in id order (release.py).
            f" INSERT INTO {permit} ({q('semaphore_id')}, {q('request_id')}, {q('count')},"
            f" {q('fencing_token')}, {q('slot_ends')}, {q('state')})"
            f" SELECT g.id, v_request, g.n, g.token, NULL, '{self.acquired}'"
            f" FROM ({permits_sql}) AS g ORDER BY g.id;"
            f" COMMIT; {granted_sql};" + (" END decide;" if fair_line else " END IF;")
        )

    def _mariadb_line(self, wait_sql: str) -> str:
        """The procedure's decision on its one name, which opens the block
        ``decide`` that the grant closes: a fair line's steps, as
        PostgreSQL's function for one name takes them; declined (the
        general grant's turn), it rolls back and leaves the block."""
        bound = f"SET STATEMENT innodb_lock_wait_timeout = {wait_sql} FOR "
        steps = self._line_statements("v_id_1", "v_count_1", bound)
        held_sql = _mariadb_held(1)
        declined_sql = "ROLLBACK; SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL"
        return (
            " decide: BEGIN"
            " DECLARE v_deadline, v_until DATETIME(6); DECLARE v_live, v_ticket BOOL;"
            " DECLARE v_ahead, v_reserved BIGINT DEFAULT 0;"
            # Names are exact, as Python compares them (not as the collation does).
            " IF v_count_1 IS NULL OR v_window_1 IS NOT NULL OR v_count_1 > v_capacity_1 THEN"
            f" {declined_sql}; LEAVE decide; END IF;"
            f" SET v_now = {self.now};"
            " IF v_queued_until_1 > v_now OR p_ticketed OR v_held_1 + v_count_1 > v_capacity_1"
            " THEN"
            " SET v_live = IFNULL(v_queued_until_1 > v_now, FALSE);"
            # What the older tickets that lacked room ask for stays theirs.
            f" IF v_live THEN {steps.ahead_sql}; END IF;"
            " IF v_held_1 + v_count_1 + v_reserved > v_capacity_1 THEN"
            " IF p_life IS NOT NULL AND NOT (v_live OR p_ticketed OR p_fair OR v_fair_1)"
            f" OR {steps.key_taken_sql}"
            f" OR (v_held_1 + v_count_1 > v_capacity_1 AND {steps.expired_sql}) THEN"
            f" {declined_sql}; LEAVE decide; END IF;"
            " SET v_deadline = TIMESTAMPADD(MICROSECOND, ROUND(p_life * 1000000), v_now);"
            # First in line: it waits for a release here, the next in line
            # behind it on the row's lock (BRIEF_WAIT_US outside a fair line).
            " IF v_reserved = 0 THEN"
            " SET v_until = v_now + INTERVAL IF(p_life IS NOT NULL AND (p_fair OR v_fair_1),"
            f" {int(HEAD_WAIT_MS) * 1000}, {int(BRIEF_WAIT_US)}) MICROSECOND;"
            " IF v_deadline < v_until THEN SET v_until = v_deadline; END IF;"
            " WHILE v_held_1 + v_count_1 > v_capacity_1 AND v_now < v_until DO"
            f" DO SLEEP({int(HEAD_POLL_US)} / 1000000);"
            f" SELECT {self.q('released')} INTO v_released_1 FROM {self.counter}"
            f" WHERE {self.q('semaphore_id')} = v_id_1;"
            f" {held_sql}; SET v_now = {self.now};"
            " END WHILE;"
            " END IF;"
            " IF v_held_1 + v_count_1 + v_reserved > v_capacity_1 THEN"
            " SET v_ticket = p_life IS NOT NULL AND (p_fair OR v_fair_1)"
            " AND NOT (p_ticketed AND p_lacked);"
            f" IF v_ticket THEN {steps.take_sql}; {steps.queue_until_sql}; END IF;"
            " COMMIT; SELECT NULL, NULL, NULL, v_name_1, v_fencing_counter_1, v_held_1,"
            " v_id_1, v_capacity_1, (v_reserved + v_count_1 - 1) DIV GREATEST(v_capacity_1, 1),"
            " v_ticket;"
            " LEAVE decide;"
            " END IF;"
            " END IF;"
            # Granted: its tickets stop holding back others; a queue that
            # held nobody back any more is over.
            f" IF p_ticketed OR v_live THEN {steps.delete_sql};"
            f" IF v_live AND v_ahead = 0 AND NOT p_ticketed THEN {steps.over_sql}; END IF;"
            " END IF;"
            " END IF;"
        )

    def _line_statements(self, id_sql: str, count_sql: str, bound: str = "") -> LineStatements:
        """The fair line's statements on the semaphore ``id_sql`` for
        ``count_sql`` permits, in a routine whose key, owner, clock and
        deadline are ``p_key``, ``p_owner``, ``v_now`` and ``v_deadline``;
        the writes that may wait for a lock prefixed with ``bound``."""
        sql, tickets = statements(self.connection), ticket_statements(self.connection)
        older_sql = with_arguments(
            tickets.older_sql.format(ids="%s"), id_sql, "TRUE", "v_now", "p_key", "p_key"
        )
        key_sql = with_arguments(self.key_sql, "p_key")
        take_sql = with_arguments(
            tickets.insert_sql.format(rows="(%s, %s, %s, %s, %s, %s, %s)"),
            *(id_sql, "p_key", "p_owner", count_sql, "v_now", "v_deadline", "TRUE"),
        )
        delete_sql = with_arguments(tickets.delete_sql.format(ids="%s"), "p_key", id_sql)
        return LineStatements(
            ahead_sql="SELECT COUNT(*), COALESCE(SUM(o.permits), 0) INTO v_ahead, v_reserved"
            f" FROM ({older_sql}) o",
            key_taken_sql=f"EXISTS ({key_sql})",
            expired_sql=sql.expired_sql.format(ids=id_sql, now="v_now"),
            take_sql=bound + take_sql,
            queue_until_sql=with_arguments(
                tickets.queued_until_sql.format(ids="%s"), "v_deadline", id_sql, "v_deadline"
            ),
            delete_sql=bound + delete_sql,
            over_sql=with_arguments(
                tickets.queue_over_sql.format(ids="%s"), id_sql, "TRUE", "v_now"
            ),
        )

    def _locking_read_of(self, names_sql: str, targets: str = "") -> str:
        """The manager's locking read of one name, its condition on the name
        made ``names_sql`` (a PostgreSQL function's parameters)."""
        one_name = "IN (%s)"
        locking = self.lock_into(1, targets)
        if locking.count(one_name) != 1:  # pragma: no cover - a Django change would show here
            raise AssertionError(f"Unexpected locking read: {locking!r}")
        return locking.replace(one_name, names_sql)

    def function_body(self) -> str:
        """The PostgreSQL function's body (``routines.py`` renders it)."""
        q = self.q
        locking = self._locking_read_of("= ANY(p_names)")
        waits_sql = queue.waits_sql("p_names", "p_lock_wait")
        return (
            "\nDECLARE s record; i integer; v_count integer; v_released bigint;"
            " v_ids bigint[] := '{}'; v_names text[] := '{}'; v_counts integer[] := '{}';"
            " v_capacities bigint[] := '{}'; v_counted bigint[] := '{}';"
            " v_folded bigint[] := '{}'; v_tokens bigint[] := '{}'; v_held bigint[] := '{}';"
            " v_now timestamptz; v_expires timestamptz; v_request bigint;\n"
            "BEGIN\n"
            f"{waits_sql}"
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
            " FOR i IN 1 .. cardinality(v_ids) LOOP\n"
            # A statement of its own, so read once the locks are held: the
            # releases committed during the wait count.
            f"  SELECT c.{q('released')} INTO v_released FROM {self.counter} c"
            f" WHERE c.{q('semaphore_id')} = v_ids[i];\n"
            "  v_held := v_held || GREATEST(v_counted[i]"
            " - GREATEST(COALESCE(v_released, 0) - v_folded[i], 0), 0);\n"
            "  IF v_held[i] + v_counts[i] > v_capacities[i] THEN RETURN; END IF;\n"
            "  v_folded[i] := GREATEST(COALESCE(v_released, 0), v_folded[i]);\n"
            " END LOOP;\n"
            " v_now := clock_timestamp();\n"
            " v_expires := v_now + make_interval(secs => p_ttl);\n"
            f" INSERT INTO {self.request} ({q('external_id')}, {q('owner')}, {q('state')},"
            f" {q('ttl')}, {q('expires_at')}, {q('created_at')}, {q('updated_at')},"
            f" {q('released_at')}, {q('release_reason')})"
            f" VALUES (p_key, p_owner, '{self.acquired}', p_ttl, v_expires, v_now, v_now,"
            f" NULL, '') RETURNING {q('id')} INTO v_request;\n"
            " FOR i IN 1 .. cardinality(v_ids) LOOP\n"
            f"  UPDATE {self.semaphore} SET {q('fencing_counter')} = {q('fencing_counter')} + 1,"
            f" {q('in_use_counter')} = v_held[i] + v_counts[i],"
            f" {q('released_folded')} = v_folded[i], {q('updated_at')} = v_now"
            f" WHERE {q('id')} = v_ids[i];\n"
            " END LOOP;\n"
            # In semaphore id order: a release by key reaches the release
            # counters through the permits in id order (release.py).
            f" INSERT INTO {self.permit} ({q('semaphore_id')}, {q('request_id')}, {q('count')},"
            f" {q('fencing_token')}, {q('slot_ends')}, {q('state')})"
            f" SELECT g.id, v_request, g.n, g.token, NULL, '{self.acquired}'"
            " FROM unnest(v_ids, v_counts, v_tokens) AS g(id, n, token) ORDER BY g.id;\n"
            " RETURN QUERY SELECT v_request, v_now, v_expires, g.name, g.token, g.held + g.n"
            " FROM unnest(v_names, v_tokens, v_held, v_counts) AS g(name, token, held, n);\n"
            "END\n"
        )

    def one_name_function_body(self) -> str:
        """PostgreSQL's function for one name (``routines.py`` renders it):
        the general function's steps on one row read into a record, and fair
        mode's too (``engine/fairness.py``). Behind a live queue it grants
        only beside what the older tickets that lacked room ask for. A fair
        waiter that finds no room waits here for a release, at most
        ``HEAD_WAIT_MS``, if it is first in line (the next ones wait behind it
        in the names' queue, each handed the turn by the database), and is
        refused here otherwise, taking its ticket; a call that fails fast is
        refused here too, after at most ``BRIEF_WAIT_US`` at the head. A
        refusal that needs more -- a reclaim of expired permits, a taken
        key's request -- and a waiter outside a fair line are left to the
        general grant (``one_trip.py`` says why)."""
        q = self.q
        locking = self._locking_read_of("= p_name", "s")
        waits_sql = queue.waits_for_one_sql("p_name", "p_lock_wait")
        steps = self._line_statements("s.id", "p_count")
        released_sql = (
            f"SELECT c.{q('released')} INTO v_released FROM {self.counter} c"
            f" WHERE c.{q('semaphore_id')} = s.id"
        )
        held_sql = (
            "v_held := GREATEST(s.in_use_counter"
            " - GREATEST(COALESCE(v_released, 0) - s.released_folded, 0), 0)"
        )
        return (
            "\nDECLARE s record; v_released bigint; v_held bigint; v_now timestamptz;"
            " v_until timestamptz; v_deadline timestamptz; v_live boolean := false;"
            " v_ahead bigint := 0; v_reserved bigint := 0;\n"
            "BEGIN\n"
            f"{waits_sql}"
            f" {locking};\n"
            # Names are exact, as Python compares them (not as a collation may).
            f" IF NOT FOUND OR s.name::text <> p_name OR s.{q('window')} IS NOT NULL"
            " OR p_count > s.capacity THEN RETURN; END IF;\n"
            f" {released_sql};\n"
            f" {held_sql};\n"
            " v_now := clock_timestamp();\n"
            " IF s.queued_until > v_now OR p_ticketed OR v_held + p_count > s.capacity THEN\n"
            "  v_live := COALESCE(s.queued_until > v_now, false);\n"
            # What the older tickets that lacked room ask for stays theirs.
            f"  IF v_live THEN {steps.ahead_sql}; END IF;\n"
            "  IF v_held + p_count + v_reserved > s.capacity THEN\n"
            # No room for it: refused here, unless the general grant has
            # more to do -- answer a taken key with its request, reclaim
            # expired permits -- or it waits outside a fair line (see
            # one_trip.py: measured slower refused here).
            "   IF p_life IS NOT NULL AND NOT (v_live OR p_ticketed OR p_fair OR s.fair)"
            f" OR {steps.key_taken_sql} OR (v_held + p_count > s.capacity AND {steps.expired_sql})"
            " THEN RETURN; END IF;\n"
            # Its deadline: where its ticket, if it takes one, expires.
            "   v_deadline := v_now + make_interval(secs => p_life);\n"
            # First in line: it waits for a release here, at the head of the
            # names' queue, where the next in line waits behind it
            # (BRIEF_WAIT_US outside a fair line; LEAST ignores a NULL deadline).
            "   IF v_reserved = 0 THEN\n"
            "    v_until := LEAST(v_deadline, v_now + CASE WHEN p_life IS NOT NULL"
            f" AND (p_fair OR s.fair) THEN {int(HEAD_WAIT_MS) * 1000} ELSE {int(BRIEF_WAIT_US)}"
            " END * interval '1 microsecond');\n"
            "    WHILE v_held + p_count > s.capacity AND v_now < v_until LOOP\n"
            f"     PERFORM pg_sleep({int(HEAD_POLL_US)} / 1000000.0);\n"
            f"     {released_sql};\n"
            f"     {held_sql};\n"
            "     v_now := clock_timestamp();\n"
            "    END LOOP;\n"
            "   END IF;\n"
            "   IF v_held + p_count + v_reserved > s.capacity THEN\n"
            "    refused_ticket := p_life IS NOT NULL AND (p_fair OR s.fair)"
            " AND NOT (p_ticketed AND p_lacked);\n"
            f"    IF refused_ticket THEN {steps.take_sql}; {steps.queue_until_sql}; END IF;\n"
            "    granted_name := s.name; granted_token := s.fencing_counter;"
            " granted_in_use := v_held; refused_id := s.id; refused_capacity := s.capacity;\n"
            "    refused_rounds := (v_reserved + p_count - 1) / GREATEST(s.capacity, 1);\n"
            "    RETURN NEXT; RETURN;\n"
            "   END IF;\n"
            "  END IF;\n"
            # Granted: its tickets stop holding back others; a queue that
            # held nobody back any more is over.
            f"  IF p_ticketed OR v_live THEN {steps.delete_sql};\n"
            f"   IF v_live AND v_ahead = 0 AND NOT p_ticketed THEN {steps.over_sql}; END IF;\n"
            "  END IF;\n"
            " END IF;\n"
            " granted_at := v_now;\n"
            " granted_expires_at := granted_at + make_interval(secs => p_ttl);\n"
            f" INSERT INTO {self.request} ({q('external_id')}, {q('owner')}, {q('state')},"
            f" {q('ttl')}, {q('expires_at')}, {q('created_at')}, {q('updated_at')},"
            f" {q('released_at')}, {q('release_reason')})"
            f" VALUES (p_key, p_owner, '{self.acquired}', p_ttl, granted_expires_at, granted_at,"
            f" granted_at, NULL, '') RETURNING {q('id')} INTO granted_request;\n"
            f" UPDATE {self.semaphore} SET {q('fencing_counter')} = {q('fencing_counter')} + 1,"
            f" {q('in_use_counter')} = v_held + p_count, {q('released_folded')}"
            " = GREATEST(COALESCE(v_released, 0), s.released_folded),"
            f" {q('updated_at')} = granted_at WHERE {q('id')} = s.id;\n"
            f" INSERT INTO {self.permit} ({q('semaphore_id')}, {q('request_id')}, {q('count')},"
            f" {q('fencing_token')}, {q('slot_ends')}, {q('state')})"
            f" VALUES (s.id, granted_request, p_count, s.fencing_counter + 1, NULL,"
            f" '{self.acquired}');\n"
            " granted_name := s.name; granted_token := s.fencing_counter + 1;"
            " granted_in_use := v_held + p_count;\n"
            " RETURN NEXT;\n"
            "END\n"
        )


def _mariadb_held(i: int) -> str:
    """MariaDB: row ``i``'s permits held, from its counter and the release
    total last read (``rows.held``)."""
    return (
        f"SET v_held_{i} = GREATEST(v_in_use_counter_{i}"
        f" - GREATEST(IFNULL(v_released_{i}, 0) - v_released_folded_{i}, 0), 0)"
    )


def grant_routine(connection: BaseDatabaseWrapper) -> GrantRoutine:
    """This connection's grant routine text."""
    return built(GrantRoutine, connection)
