"""@holds_permit on views: through the test client, and a real server under load."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from celery import shared_task
from django.contrib.auth import get_user_model
from django.db import connections, transaction

from django_semaphore import acquire, holds_permit, release, set_capacity
from django_semaphore.exceptions import (
    CapacityExceeded,
    DatabaseUnavailable,
    InvalidRequest,
    NestedTransactionError,
    SemaphoreExhausted,
    SemaphoreNotFound,
)
from django_semaphore.models import PermitRequest, Semaphore
from tests import views
from tests.test_backends import row_locked_elsewhere
from tests.testapp.models import RunLog

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def semaphore() -> Semaphore:
    return Semaphore.objects.create(name=views.VIEWS, capacity=1)


def in_use() -> int:
    return views.in_use()


@pytest.mark.parametrize("url", ["/plain/", "/class/", "/dispatch/"])
def test_permit_is_held_while_the_view_runs_and_released_after(client, semaphore, url):
    response = client.get(url)

    assert response.status_code == 200
    assert response.content == b"1"  # the view saw its own permit held
    assert in_use() == 0


@pytest.mark.parametrize("url", ["/plain/", "/class/", "/dispatch/", "/async/", "/streaming/"])
def test_exhausted_answers_429_with_retry_after_and_never_calls_the_view(client, semaphore, url):
    acquire(views.VIEWS, external_id="someone-else")
    calls = views.inside.calls

    response = client.get(url)

    assert response.status_code == 429
    assert response["Retry-After"] == "1"
    assert views.inside.calls == calls
    release("someone-else")


def test_status_and_retry_after_are_configurable(client, semaphore, settings):
    settings.DJANGO_SEMAPHORE = {"VIEW_STATUS_CODE": 503}
    acquire(views.VIEWS, external_id="someone-else")

    response = client.get("/slow/")

    assert (response.status_code, response["Retry-After"]) == (503, "7")


def test_database_trouble_answers_503_and_never_calls_the_view(client, semaphore, settings):
    settings.DJANGO_SEMAPHORE = {"LOCK_WAIT_TIMEOUT": 0.3, "RETRY_ATTEMPTS": 1}
    calls = views.inside.calls
    with row_locked_elsewhere(views.VIEWS):
        response = client.get("/plain/")
    assert response.status_code == 503
    assert views.inside.calls == calls


def test_a_failing_view_releases(client, semaphore):
    with pytest.raises(RuntimeError):
        client.get("/failing/")
    assert in_use() == 0


def test_streaming_holds_until_the_stream_is_consumed(client, semaphore):
    response = client.get("/streaming/")

    assert in_use() == 1  # the view returned, but nothing was sent yet
    assert b"".join(response.streaming_content) == b"1\n1\n1\n"
    assert in_use() == 0


def test_streaming_client_going_away_releases(client, semaphore):
    response = client.get("/streaming/")
    next(iter(response.streaming_content))

    response.close()  # what the server does when the client disconnects

    assert in_use() == 0


@pytest.mark.usefixtures("sync_thread_connections")
async def test_async_view(async_client, semaphore):
    response = await async_client.get("/async/")

    assert response.status_code == 200
    assert response.content == b"1"
    assert await sync_to_async(in_use)() == 0


@pytest.mark.usefixtures("sync_thread_connections")
async def test_async_streaming_releases_when_done(async_client, semaphore):
    response = await async_client.get("/async-streaming/")
    assert await sync_to_async(in_use)() == 1
    assert b"".join([chunk async for chunk in response.streaming_content]) == b"row\n" * 3
    assert await sync_to_async(in_use)() == 0


def test_owner_names_the_view_and_the_user(client, semaphore):
    user = get_user_model().objects.create_user("alice", password="pw")
    client.force_login(user)
    client.get("/plain/")

    owner = PermitRequest.objects.get().owner
    assert "tests.views.plain" in owner
    assert "alice" in owner
    assert "127.0.0.1" in owner


def test_real_server_under_concurrent_load(live_server, semaphore):
    """20 clients at once against a capacity-2 view on a real threaded server."""
    set_capacity(views.VIEWS, 2)
    views.inside.peak = 0
    answers: list[tuple[int, str | None]] = []
    barrier = threading.Barrier(20)

    def client() -> None:
        try:
            barrier.wait(10)
            with urllib.request.urlopen(f"{live_server.url}/slow/", timeout=30) as response:
                answers.append((response.status, None))
        except urllib.error.HTTPError as error:
            answers.append((error.code, error.headers.get("Retry-After")))
        finally:
            connections.close_all()

    threads = [threading.Thread(daemon=True, target=client) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(answers) == 20
    ok = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] != 200]
    assert 1 <= len(ok) <= 20
    assert all(a == (429, "7") for a in refused)
    assert views.inside.peak <= 2
    # The server closes each response (and its connections) just after the
    # client has read it: wait for its request threads to finish.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        "process_request_thread" in thread.name for thread in threading.enumerate()
    ):
        time.sleep(0.05)
    assert in_use() == 0


@pytest.mark.parametrize(
    "arguments",
    [
        {"names": []},
        {"names": "x", "count": 0},
        {"names": ["a", "a"]},
        {"names": {"a": -1}},
        {"names": "x", "view": "yes"},
    ],
)
def test_bad_decorator_arguments_fail_at_decoration(arguments):
    with pytest.raises(InvalidRequest):
        holds_permit(**arguments)


@pytest.fixture
def atomic_requests(monkeypatch):
    """ATOMIC_REQUESTS = True on the database under test, as a project sets it."""
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)


@pytest.mark.usefixtures("atomic_requests")
def test_atomic_requests_view_runs_in_its_transaction_after_the_permit_committed(client, semaphore):
    response = client.get("/writes/")

    # In the request's transaction, its permit committed (seen elsewhere) first.
    assert (response.status_code, response.content) == (200, b"True 1")
    assert RunLog.objects.filter(label="writes").count() == 1
    assert in_use() == 0


@pytest.mark.usefixtures("atomic_requests")
def test_atomic_requests_view_writes_roll_back_with_the_view_and_the_permit_is_released(
    client, semaphore
):
    with pytest.raises(RuntimeError, match="after writing"):
        client.get("/writes/?fail=1")

    assert not RunLog.objects.filter(label="writes").exists()
    assert in_use() == 0
    assert PermitRequest.objects.get().release_reason == "released"


@pytest.mark.usefixtures("atomic_requests")
@pytest.mark.parametrize("url", ["/writes/", "/class/", "/dispatch/"])
def test_atomic_requests_refused_answers_429_and_granted_after_release(client, semaphore, url):
    acquire(views.VIEWS, external_id="someone-else")
    assert client.get(url).status_code == 429

    release("someone-else")

    assert client.get(url).status_code == 200
    assert in_use() == 0


@pytest.mark.usefixtures("atomic_requests")
def test_atomic_requests_keeps_a_views_own_opt_out(client, semaphore):
    assert client.get("/opted-out/").content == b"False"


@pytest.mark.usefixtures("atomic_requests")
async def test_atomic_requests_refuses_async_views_as_django_does(async_client, semaphore):
    with pytest.raises(RuntimeError, match="ATOMIC_REQUESTS with async views"):
        await async_client.get("/async/")


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("/unknown-name/", SemaphoreNotFound),
        ("/too-many/", CapacityExceeded),
        ("/undeclared-family/?key=1", SemaphoreNotFound),
        ("/undeclared-family/?key=" + "x" * 300, InvalidRequest),
    ],
)
def test_a_programming_error_raises_through_the_view(client, semaphore, url, error):
    with pytest.raises(error):
        client.get(url)


def test_a_view_called_inside_an_open_transaction_raises(client, semaphore):
    with transaction.atomic(), pytest.raises(NestedTransactionError):
        client.get("/plain/")


def test_an_unreachable_database_answers_503(client, semaphore, monkeypatch):
    def unreachable(*args, **kwargs):
        raise DatabaseUnavailable("connection refused")

    monkeypatch.setattr("django_semaphore.api.acquire", unreachable)

    response = client.get("/slow/")

    assert (response.status_code, response["Retry-After"]) == (503, "7")


def test_refused_view_renders_the_projects_own_page(client, semaphore, settings):
    settings.DJANGO_SEMAPHORE = {"REFUSED_VIEW": "tests.views.busy_page"}
    acquire(views.VIEWS, external_id="someone-else")

    response = client.get("/slow/")

    assert (response.status_code, response["Retry-After"]) == (429, "7")
    assert response.content == f"busy: {views.VIEWS}".encode()
    settings.DJANGO_SEMAPHORE = {"REFUSED_VIEW": "tests.views.busy_page", "LOCK_WAIT_TIMEOUT": 0.3}
    with row_locked_elsewhere(views.VIEWS):
        response = client.get("/plain/")
    assert (response.status_code, response.content) == (503, b"busy: unreachable")


def test_a_helper_taking_a_request_decided_not_a_view_raises(rf, semaphore):
    @holds_permit(views.VIEWS, view=False)
    def render_pdf(request):
        return "pdf"

    acquire(views.VIEWS, external_id="someone-else")
    with pytest.raises(SemaphoreExhausted):
        render_pdf(rf.get("/"))


def test_a_view_is_decided_at_decoration_whatever_the_argument(rf, semaphore):
    @holds_permit(views.VIEWS, view=True)
    def handler(req):
        return "ran"

    @holds_permit(views.VIEWS)
    def not_a_view(job):
        return "ran"

    acquire(views.VIEWS, external_id="someone-else")
    assert handler(rf.get("/")).status_code == 429
    with pytest.raises(SemaphoreExhausted):
        not_a_view(rf.get("/"))


def _task_decorators() -> list[Any]:
    decorators: list[Any] = [
        shared_task(name="tests.above-a-task"),
        shared_task(bind=True, name="tests.above-a-bound-task"),
    ]
    from tests.own_tasks import task  # Django's own, or the backport's

    return [*decorators, task]


def task_body(*args: Any) -> None:
    """At module level, as Django's tasks must be."""


@pytest.mark.parametrize("task", _task_decorators())
def test_placed_above_a_task_decorator_is_refused_at_decoration(task):
    with pytest.raises(InvalidRequest, match="under @shared_task"):
        holds_permit(views.VIEWS)(task(task_body))


@pytest.mark.parametrize(
    ("url", "label"),
    [("/class/", "tests.views.DecoratedClass.dispatch"), ("/dispatch/", "DecoratedDispatch")],
)
def test_owner_of_a_class_based_view_names_its_class(client, semaphore, url, label):
    client.get(url)

    assert label in PermitRequest.objects.get().owner
