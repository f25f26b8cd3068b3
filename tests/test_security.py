"""Security: who may do what in the admin, what a web client can and cannot
steer in ``@holds_permit``, and no SQL assembled from values in the package.

The admin's own behaviour is tested in test_admin.py; here are the paths an
attacker would try: no login, staff without the permission, crafted POSTs,
no CSRF token, HTML in names and owners.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

import django_semaphore
from django_semaphore import acquire, release
from django_semaphore.models import CapacityChange, PermitRequest, Semaphore
from django_semaphore.states import ReleaseReason, State
from tests import views
from tests.conftest import unique

PACKAGE = Path(django_semaphore.__file__).parent

MODELS = ("semaphore", "permitrequest", "capacitychange")


def make_user(*codenames: str, staff: bool = True):
    user = get_user_model().objects.create_user(unique("user"), password="pw", is_staff=staff)
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="django_semaphore", codename__in=codenames
        )
    )
    return user


def admin_pages(sem: Semaphore, request: PermitRequest) -> list[str]:
    pages = [reverse(f"admin:django_semaphore_{model}_changelist") for model in MODELS]
    pages.append(reverse("admin:django_semaphore_semaphore_change", args=[sem.pk]))
    pages.append(reverse("admin:django_semaphore_permitrequest_change", args=[request.pk]))
    return pages


# --- admin -------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["anonymous", "not staff"])
def test_admin_pages_need_a_staff_login(client, make_semaphore, who):
    sem = make_semaphore(capacity=2)
    held = acquire(sem.name, external_id=unique(), owner="secret-owner")
    if who == "not staff":
        client.force_login(make_user("view_semaphore", "view_permitrequest", staff=False))

    for page in admin_pages(sem, held):
        response = client.get(page)
        assert response.status_code == 302, page
        assert "/login/" in response["Location"]
        assert b"secret-owner" not in response.content


@pytest.mark.django_db
def test_staff_without_permissions_sees_nothing(client, make_semaphore):
    sem = make_semaphore(capacity=2)
    held = acquire(sem.name, external_id=unique(), owner="secret-owner")
    client.force_login(make_user())

    for page in admin_pages(sem, held):
        response = client.get(page)
        assert response.status_code == 403, page
        assert b"secret-owner" not in response.content


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "codenames",
    [
        ("view_permitrequest",),
        ("view_permitrequest", "change_permitrequest", "delete_permitrequest"),
        ("view_semaphore", "change_semaphore"),
    ],
)
def test_force_release_by_crafted_post_needs_the_force_release_permission(
    client, make_semaphore, codenames
):
    sem = make_semaphore(capacity=1)
    held = acquire(sem.name, external_id=unique())
    client.force_login(make_user(*codenames))

    client.post(
        reverse("admin:django_semaphore_permitrequest_changelist"),
        {"action": "force_release", "_selected_action": [held.pk]},
    )

    held.refresh_from_db()
    assert held.state == State.ACQUIRED
    assert held.release_reason == ""


@pytest.mark.django_db(transaction=True)
def test_capacity_change_needs_permission_and_csrf(make_semaphore):
    sem = make_semaphore(capacity=2)
    url = reverse("admin:django_semaphore_semaphore_change", args=[sem.pk])
    form = {"capacity": "9", "reason": "attack"}

    view_only = Client()
    view_only.force_login(make_user("view_semaphore"))
    assert view_only.post(url, form).status_code == 403

    no_token = Client(enforce_csrf_checks=True)
    no_token.force_login(make_user("view_semaphore", "change_semaphore"))
    assert no_token.post(url, form).status_code == 403

    sem.refresh_from_db()
    assert sem.capacity == 2
    assert not CapacityChange.objects.filter(semaphore=sem).exists()


@pytest.mark.django_db
def test_names_and_owners_are_escaped_in_the_admin(client, make_semaphore):
    script = "<script>alert(1)</script>"
    sem = make_semaphore(capacity=2, name=f"x{script}")
    acquire(sem.name, external_id=f"k{script}", owner=f"<img src=x onerror=alert(2)>{script}")
    user = make_user()
    user.is_superuser = True
    user.save()
    client.force_login(user)

    for page in (
        reverse("admin:django_semaphore_semaphore_changelist"),
        reverse("admin:django_semaphore_semaphore_change", args=[sem.pk]),
        reverse("admin:django_semaphore_permitrequest_changelist"),
    ):
        html = client.get(page).content.decode()
        assert script not in html, page
        assert "<img src=x" not in html, page
        assert "&lt;script&gt;" in html, page


# --- the view decorator: the key is never the client's ---------------------------------


@pytest.fixture
def views_semaphore(db) -> Semaphore:
    views.inside.__init__()
    return Semaphore.objects.create(name=views.VIEWS, capacity=2)


@pytest.mark.django_db(transaction=True)
def test_a_client_cannot_choose_the_key_of_a_view_permit(client, views_semaphore):
    """Whatever the request carries -- a key in the query, the body, a header
    or a cookie -- the view's permit gets a fresh key of its own: a client can
    neither join another holder's permit nor release it."""
    victim = acquire(views.VIEWS, external_id="victim-key", owner="victim")
    client.cookies["external_id"] = "victim-key"
    attempts = [
        client.get("/plain/?external_id=victim-key&key=victim-key&idempotency_key=victim-key"),
        client.post("/plain/", {"external_id": "victim-key", "key": "victim-key"}),
        client.get("/plain/", HTTP_IDEMPOTENCY_KEY="victim-key", HTTP_X_REQUEST_ID="victim-key"),
        client.get("/class/?external_id=victim-key"),
        client.get("/async/?external_id=victim-key"),
    ]

    for response in attempts:
        assert response.status_code == 200
        # The view ran under a second permit beside the victim's: 2 in use.
        assert response.content == b"2"
    victim.refresh_from_db()
    assert victim.state == State.ACQUIRED
    assert PermitRequest.objects.filter(external_id="victim-key").count() == 1
    others = PermitRequest.objects.exclude(pk=victim.pk)
    assert others.count() == len(attempts)
    assert all(len(r.external_id) == 32 for r in others)  # uuid4().hex, server-made
    assert set(others.values_list("state", flat=True)) == {State.RELEASED}
    assert set(others.values_list("release_reason", flat=True)) == {ReleaseReason.RELEASED}
    release("victim-key")


def test_holds_permit_has_no_way_to_take_a_key_from_a_request():
    """The decorator's only knobs are set in code, none per request."""
    import inspect

    from django_semaphore.integrations.decorators import holds_permit

    parameters = set(inspect.signature(holds_permit).parameters)
    assert parameters == {
        "names", "count", "ttl", "timeout", "retry_after", "priority", "share", "fair", "park",
        "max_waiting",
        "on_conflict", "debounce", "view",
    }  # fmt: skip


# --- no SQL built from values ----------------------------------------------------------

# Upper case, as every statement in the package is written (and "Set ..." in a
# hint is not SQL).
SQL_WORDS = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|PRAGMA|SET|WHERE|VALUES)\b")
# What may be interpolated into SQL text: quoted identifiers, placeholder lists
# ("%s, %s"), SQL the ORM compiled (with its parameters kept apart), and ints.
SAFE_CALLS = {
    "q", "quote_name", "_placeholders", "placeholders", "case_placeholders", "int", "len", "ceil",
    "floor", "range",
    "routine",  # a routine's versioned name, from a constant
    # The grant routines' builders (statements/grant_routine.py): SQL text
    # made by these same rules, each one's f-strings checked here too.
    "decide", "grant_one", "insert_request", "count_grant", "insert_permits", "lock_into",
    "waits_sql", "let", "after", "sleep", "loop", "answer", "_held", "_short", "_folded",
    "_read_released", "_not_refused", "_mariadb_declarations",
}  # fmt: skip
INT_COMBINERS = {"max", "min"}  # safe when every argument is
SAFE_NAMES = {
    # identifiers and compiled fragments named in the statement builders
    "semaphore", "request", "permit", "counter", "now", "ids", "rows", "table", "column",
    "db_table", "sql", "where", "columns", "returning", "bound", "hint", "stamp",
    "locking",  # the manager's locking read, compiled by the ORM
    "declarations",  # a block's variables, typed by quoted columns
    "acquired",  # the ACQUIRED state, a constant (a function's body takes no parameters)
    "clock", "decline",  # a routine's server spellings (grant_routine._Server)
}  # fmt: skip


def _is_sql(text: str) -> bool:
    return SQL_WORDS.search(text) is not None


def _safe_value(node: ast.expr, local: frozenset[str] = frozenset()) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in INT_COMBINERS or (name == "join" and isinstance(func, ast.Attribute)):
            # max()/min() of safe ints; ", ".join([...constants...] * n)
            return all(_safe_value(arg, local) for arg in node.args)
        return name in SAFE_CALLS
    if isinstance(node, ast.Name):
        # "..._sql": SQL text the builders made by these same rules.
        return node.id in SAFE_NAMES or node.id in local or node.id.endswith("_sql")
    if isinstance(node, ast.Attribute):
        # row.*: a routine's own variables (grant_routine._Row), named from constants.
        row = isinstance(node.value, ast.Name) and node.value.id == "row"
        return row or node.attr in SAFE_NAMES or node.attr.endswith("_sql")
    if isinstance(node, ast.Subscript):
        return _safe_value(node.value, local)
    if isinstance(node, ast.IfExp):
        return _safe_value(node.body, local) and _safe_value(node.orelse, local)
    if isinstance(node, ast.BinOp):
        return _safe_value(node.left, local) and _safe_value(node.right, local)
    if isinstance(node, ast.List | ast.Tuple):
        return all(_safe_value(element, local) for element in node.elts)
    return False


def _safe_locals(tree: ast.AST) -> frozenset[str]:
    """Names only ever assigned SQL-safe text (e.g. a placeholder list)."""
    assigned: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    safe = _safe_value(node.value)
                    assigned[target.id] = assigned.get(target.id, True) and safe
    safe_names = frozenset(name for name, safe in assigned.items() if safe)
    # A loop over a safe range (rows rendered per index) binds safe ints.
    looped = {
        node.target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.comprehension)
        and isinstance(node.target, ast.Name)
        and _safe_value(node.iter, safe_names)
    }
    return safe_names | looped


def sql_formatting(path: Path) -> list[str]:
    """f-strings, ``%`` and ``.format()`` that put a value into SQL text."""
    tree = ast.parse(path.read_text(), filename=str(path))
    local = _safe_locals(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(part.value for part in node.values if isinstance(part, ast.Constant))
            values = [part.value for part in node.values if isinstance(part, ast.FormattedValue)]
        elif (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Mod)
            and isinstance(node.left, ast.Constant)
            and isinstance(node.left.value, str)
        ):
            text = node.left.value
            right = node.right
            values = list(right.elts) if isinstance(right, ast.Tuple) else [right]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "format"
        ):
            target = node.func.value
            text = target.value if isinstance(target, ast.Constant) else ""
            if isinstance(target, ast.Attribute) and target.attr.endswith("_sql"):
                text = "SELECT "  # a precompiled statement being filled in
            values = [*node.args, *(keyword.value for keyword in node.keywords)]
        else:
            continue
        if not isinstance(text, str) or not _is_sql(text):
            continue
        for value in values:
            if not _safe_value(value, local):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(value)}")
    return found


def test_no_sql_is_built_by_formatting_values_into_it():
    """Values reach the database as parameters, never inside the SQL text.

    Identifiers (quoted by the backend), placeholder lists and ORM-compiled
    fragments may be interpolated. One integer is, by design: SQLite's
    ``PRAGMA busy_timeout = <int>`` takes no parameters, so backends.py
    formats ``int(...)`` into it -- an ``int`` renders only as digits and a
    sign, so nothing else can get in.
    """
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in sql_formatting(path)]

    assert offenders == []


def test_the_sql_check_catches_a_value_formatted_into_sql(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(cursor, key, name):\n"
        "    cursor.execute(f\"SELECT id FROM t WHERE key = '{key}'\")\n"
        "    cursor.execute(\"DELETE FROM t WHERE name = '%s'\" % name)\n"
        '    cursor.execute("UPDATE t SET a = 1 WHERE b = {}".format(name))\n'
        '    cursor.execute(f"PRAGMA busy_timeout = {int(key)}")\n'
        "    marks = ', '.join(['%s'] * len(key))\n"
        '    cursor.execute(f"SELECT 1 FROM t WHERE a IN ({marks})", key)\n'
        '    cursor.execute(f"SET x = {max(1, name)}")\n'
    )

    assert [hit.split(": ")[1] for hit in sql_formatting(bad)] == [
        "key",
        "name",
        "name",
        "max(1, name)",
    ]


def test_raw_sql_entry_points_are_not_used_with_values():
    """No ``.raw()``/``.extra()``/``RawSQL`` anywhere in the package."""
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                assert name not in {"raw", "extra", "RawSQL"}, f"{path.name}:{node.lineno}"
