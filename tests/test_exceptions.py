"""Every error of django_semaphore.exceptions travels whole: through pickle
(a process pool, a cache) and through a Celery result stored as JSON."""

from __future__ import annotations

import pickle
import uuid
from typing import Any

import pytest
from celery import Celery

from django_semaphore import exceptions
from django_semaphore.exceptions import (
    NameNotHeld,
    PermitRefused,
    SemaphoreExhausted,
    SemaphoreNotFound,
    StaleFencingToken,
)

# Found, not listed: an error added to the module is tested without being named here.
ERRORS = sorted(
    (
        value
        for value in vars(exceptions).values()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == exceptions.__name__
    ),
    key=lambda cls: cls.__name__,
)

# The constructors that take more than a message, by the class defining them
# (their subclasses are built the same way).
ARGUMENTS: dict[type[BaseException], list[tuple[Any, ...]]] = {
    SemaphoreNotFound: [(["b", "a"],)],
    SemaphoreExhausted: [(["b", "a"],), (["b", "a"], "No room on a, b (waited 2s)")],
    StaleFencingToken: [("invoice:42", 6, 7)],
    NameNotHeld: [("key-1", "b", ["c", "a"]), ("key-2", "b", [])],
    PermitRefused: [(429, 7, ["b", "a"]), (503, 1)],
}
MESSAGE_ONLY = [("Something is wrong with 'a'.",)]


def arguments_of(cls: type[BaseException]) -> list[tuple[Any, ...]]:
    return next((ARGUMENTS[base] for base in cls.__mro__ if base in ARGUMENTS), MESSAGE_ONLY)


CASES = [
    pytest.param(cls, arguments, id=f"{cls.__name__}-{i}")
    for cls in ERRORS
    for i, arguments in enumerate(arguments_of(cls))
]


def assert_same(restored: BaseException, error: BaseException) -> None:
    assert type(restored) is type(error)
    assert str(restored) == str(error)
    assert restored.args == error.args
    assert vars(restored) == vars(error)  # names, message, resource, token, highest


def test_every_custom_constructor_has_arguments():
    assert {cls for cls in ERRORS if "__init__" in vars(cls)} <= ARGUMENTS.keys()


def test_the_module_has_its_errors():
    assert exceptions.SemaphoreError in ERRORS
    assert exceptions.AcquireTimeout in ERRORS


@pytest.mark.parametrize(("cls", "arguments"), CASES)
def test_comes_back_whole_from_pickle(cls: type[BaseException], arguments: tuple[Any, ...]):
    error = cls(*arguments)

    assert_same(pickle.loads(pickle.dumps(error)), error)


@pytest.fixture(scope="module")
def results() -> Celery:
    """A result backend storing failures as a worker does, as JSON (in memory)."""
    return Celery(
        set_as_current=False,
        config_source={
            "result_backend": "cache+memory://",
            "result_serializer": "json",
            "result_accept_content": ["json"],
        },
    )


@pytest.mark.parametrize(("cls", "arguments"), CASES)
def test_comes_back_whole_from_a_celery_json_result(
    results: Celery, cls: type[BaseException], arguments: tuple[Any, ...]
):
    error = cls(*arguments)
    task_id = str(uuid.uuid4())

    results.backend.mark_as_failure(task_id, error)

    assert_same(results.AsyncResult(task_id).result, error)


def test_messages_read_as_before():
    assert str(SemaphoreNotFound(["b", "a"])) == "No such semaphore: a, b"
    assert str(SemaphoreExhausted(["b", "a"])) == "No capacity left on: a, b"
    assert str(exceptions.AcquireTimeout(["a"], "Full (waited 2s)")) == "Full (waited 2s)"
    assert str(StaleFencingToken("r", 6, 7)) == "Fencing token 6 for 'r' is stale: 7 was seen."
