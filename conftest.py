"""The docs run: every ```python block of README.md and docs/ is a test (Sybil).

Each Markdown page is one pytest module: its blocks run in order in one
namespace (what a block defines, the next one uses), each as a test of its
own on pytest-django's ``transactional_db``: outside any transaction, as a
project's code runs (``acquire()`` refuses to join an outer ``atomic()``),
and flushed after the block. The items are marked ``any_database``: they run
in the test command's SQLite passes, not on MariaDB or PostgreSQL, where what
they call is tested by the suite.

What a page leans on without showing it (a ``rows()`` generator, a ``job``)
is set up in invisible blocks, ``<!-- invisible-code-block: python -->``;
a block that cannot run in this process (a real worker, several machines,
MariaDB or PostgreSQL) is skipped on purpose, with its reason:
``<!-- skip: next "needs a real Celery worker" -->``.

Helpers the invisible blocks find in the namespace:

- ``declare(DJANGO_SEMAPHORE)``: the settings a page shows take effect for the
  rest of the page, and the semaphores they declare are created, as ``migrate``
  creates them (and again after each block's flush, as ``migrate`` would).
- ``as_module("mysite.urls", urlpatterns=urlpatterns)``: a module made of
  names the page defined, for the blocks that import it; returns its name.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from sybil import Sybil
from sybil.integration.pytest import SybilItem
from sybil.parsers.markdown import ClearNamespaceParser, PythonCodeBlockParser, SkipParser

_DOCUMENT_SETTINGS = "_docs_settings"
_OWN_NAMES = "_docs_own_names"
_MODULES = "_docs_modules"


def _setup(namespace: dict[str, Any]) -> None:
    from celery import current_app

    namespace[_DOCUMENT_SETTINGS] = []
    namespace["_celery_eager"] = current_app.conf.task_always_eager
    # A task a block calls runs here, in this process, as a worker would run it.
    current_app.conf.task_always_eager = True
    namespace["declare"] = lambda declared: _declare(namespace, declared)
    namespace[_MODULES] = []
    namespace["as_module"] = lambda name, **attributes: _as_module(namespace, name, attributes)


def _teardown(namespace: dict[str, Any]) -> None:
    from celery import current_app

    current_app.conf.task_always_eager = namespace["_celery_eager"]
    for override in reversed(namespace[_DOCUMENT_SETTINGS]):
        override.disable()
    for name in namespace[_MODULES]:
        sys.modules.pop(name, None)


def _declare(namespace: dict[str, Any], declared: dict[str, Any]) -> None:
    from django.conf import settings
    from django.test import override_settings

    from django_semaphore.declared import create_declared_semaphores

    merged = {**settings.DJANGO_SEMAPHORE, **declared}
    merged["SEMAPHORES"] = {
        **settings.DJANGO_SEMAPHORE.get("SEMAPHORES", {}),
        **declared.get("SEMAPHORES", {}),
    }
    override = override_settings(DJANGO_SEMAPHORE=merged)
    override.enable()
    namespace[_DOCUMENT_SETTINGS].append(override)
    create_declared_semaphores(using="default")


def _as_module(namespace: dict[str, Any], name: str, attributes: dict[str, Any]) -> str:
    """A module the page's blocks import (``from mysite import views``), made
    of names the page defined; gone when the page ends."""
    parent, _, child = name.rpartition(".")
    if parent and parent not in sys.modules:
        _as_module(namespace, parent, {})
    module = sys.modules.get(name) or types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    if parent:
        setattr(sys.modules[parent], child, module)
    namespace[_MODULES].append(name)
    return name


pytest_collect_file = Sybil(
    # Annotations stay text, as in the package: the API reference's
    # signatures name types its blocks do not import.
    parsers=[
        PythonCodeBlockParser(future_imports=["annotations"]),
        SkipParser(),
        ClearNamespaceParser(),
    ],
    patterns=["README.md", "docs/*.md", "docs/*/*.md"],
    fixtures=["transactional_db"],
    setup=_setup,
    teardown=_teardown,
).pytest()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """Sybil hands each block the fixtures it asked for, and every fixture they
    stand on (pytest's ``request`` among them), as names in the page's
    namespace: take them out again, so a page's own ``request`` (an
    ``HttpRequest``) stays its own and an undefined name fails as written."""
    if not isinstance(item, SybilItem):
        return (yield)
    namespace = item.example.namespace
    # The module the page's functions and Celery tasks say they are in.
    namespace["__name__"] = f"docs.{item.path.stem.lower()}"
    own = namespace.setdefault(_OWN_NAMES, {})
    result = yield
    for name, value in item.funcargs.items():
        if name in namespace and namespace[name] is value:
            if name in own:
                namespace[name] = own[name]
            else:
                del namespace[name]
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Remember which fixture names the page's blocks define themselves."""
    if not isinstance(item, SybilItem):
        return (yield)
    namespace = item.example.namespace
    try:
        return (yield)
    finally:
        for name, value in item.funcargs.items():
            if name in namespace and namespace[name] is not value:
                namespace[_OWN_NAMES][name] = namespace[name]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Docs blocks run on SQLite only: what they call is tested on every database."""
    for item in items:
        if isinstance(item, SybilItem):
            item.add_marker(pytest.mark.any_database)
