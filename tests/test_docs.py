"""The API reference (docs/reference/) says what the code is.

Each of its signatures is a ```python block that opens with where the name
is imported from (``# from django_semaphore import acquire``) and defines a
stub: a function, or a class with its methods, fields or members. Here each
stub is compared with the real object (``inspect.signature``: parameter
names, kinds, defaults and annotations, and the return annotation), so a
changed signature fails until the page says it too; and every public name
and management command must have its entry. The blocks are read by Sybil,
as conftest.py reads them to run them.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser

import django_semaphore
import django_semaphore.management.commands
from django_semaphore import exceptions, signals, tasks

pytestmark = pytest.mark.any_database

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference"
IMPORTED_FROM = re.compile(r"\A# from ([\w.]+) import (\w+)\n")


@dataclasses.dataclass(frozen=True)
class Entry:
    page: str
    line: int
    module: str
    name: str
    source: str

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"

    def __str__(self) -> str:
        return f"{self.page}:{self.line} {self.path}"


def entries() -> Iterator[Entry]:
    sybil = Sybil(parsers=[PythonCodeBlockParser()], path=str(REFERENCE), patterns=["*.md"])
    for page in sorted(REFERENCE.glob("*.md")):
        for example in sybil.parse(page).examples():
            source = str(example.parsed)
            found = IMPORTED_FROM.match(source)
            assert found, f"{page.name}:{example.line}: a block must open with '# from M import N'"
            yield Entry(page.name, example.line, found[1], found[2], source)


ENTRIES = list(entries())


def stubs() -> dict[Entry, tuple[bool, Any]]:
    """Each page's blocks run in order in one namespace, as the docs run
    them (annotations kept as text; a class may name one above it as its
    base): whether each block annotated its name, and what it defined."""
    found: dict[Entry, tuple[bool, Any]] = {}
    namespaces: dict[str, dict[str, Any]] = {}
    for entry in ENTRIES:
        namespace = namespaces.setdefault(entry.page, {"__name__": "reference"})
        namespace.pop("__annotations__", None)
        before = namespace.pop(entry.name, None)
        source = f"from __future__ import annotations\n{entry.source}"
        exec(compile(source, str(entry), "exec", dont_inherit=True), namespace)
        annotated = entry.name in namespace.get("__annotations__", {})
        found[entry] = (annotated, namespace.get(entry.name))
        if entry.name not in namespace and before is not None:
            namespace[entry.name] = before
    return found


STUBS = stubs()


def real_of(entry: Entry) -> Any:
    module = importlib.import_module(entry.module)
    assert hasattr(module, entry.name), f"{entry}: no such name"
    return getattr(module, entry.name)


def callable_of(obj: Any) -> Any:
    """A Celery task's signature is its function's."""
    return getattr(obj, "run", obj) if hasattr(obj, "delay") else obj


def described(signature: inspect.Signature) -> list[tuple[object, ...]]:
    return [
        (
            parameter.name,
            parameter.kind,
            parameter.default,
            parameter.annotation,
        )
        for parameter in signature.parameters.values()
    ] + [("->", signature.return_annotation)]


def assert_same_signature(what: str, stub: Any, real: Any) -> None:
    documented = described(inspect.signature(stub))
    actual = described(inspect.signature(callable_of(real)))
    assert documented == actual, f"{what}: the page says {documented}, the code {actual}"


def assert_same_class(entry: Entry, stub: type, real: type) -> None:
    assert inspect.isclass(real), f"{entry}: not a class"
    real_bases = {base.__name__ for base in real.__mro__}
    for base in stub.__bases__:
        if base is not object:
            assert base.__name__ in real_bases, f"{entry}: {real.__name__} is no {base.__name__}"
    if issubclass(real, enum.Enum):
        documented = {name: member.value for name, member in stub.__members__.items()}
        assert documented == {name: member.value for name, member in real.__members__.items()}
    elif dataclasses.is_dataclass(real):
        fields = {field.name: field.type for field in dataclasses.fields(real)}
        assert stub.__annotations__ == fields, f"{entry}: the fields differ"
    for name, member in vars(stub).items():
        what = f"{entry}.{name}"
        if isinstance(member, property):
            assert isinstance(inspect.getattr_static(real, name), property), f"{what}: no property"
            assert_same_signature(what, member.fget, inspect.getattr_static(real, name).fget)
        elif isinstance(member, classmethod | staticmethod):
            real_member = inspect.getattr_static(real, name)
            assert_same_signature(what, member.__func__, real_member.__func__)
        elif inspect.isfunction(member):
            assert_same_signature(what, member, inspect.getattr_static(real, name))


@pytest.mark.parametrize("entry", ENTRIES, ids=str)
def test_the_reference_says_what_the_code_is(entry: Entry) -> None:
    real = real_of(entry)
    annotated, stub = STUBS[entry]
    if stub is None:
        # A module attribute (a signal, a schedule): annotated, not assigned.
        assert annotated, f"{entry}: nothing documented"
    elif inspect.isclass(stub):
        assert_same_class(entry, stub, real)
    else:
        assert_same_signature(str(entry), stub, real)


def documented() -> set[str]:
    return {entry.path for entry in ENTRIES}


def test_every_public_name_has_its_entry() -> None:
    public = {f"django_semaphore.{name}" for name in django_semaphore.__all__}
    public |= {
        f"django_semaphore.exceptions.{name}"
        for name, value in vars(exceptions).items()
        if inspect.isclass(value) and value.__module__ == exceptions.__name__
    }
    public |= {
        f"django_semaphore.signals.{name}"
        for name, value in vars(signals).items()
        if isinstance(value, signals.Signal)
    }
    public |= {
        f"django_semaphore.tasks.{name}"
        for name, value in vars(tasks).items()
        if hasattr(value, "delay")
    }
    assert public - documented() == set()


def test_every_management_command_has_its_entry() -> None:
    commands = django_semaphore.management.commands
    names = {module.name for module in pkgutil.iter_modules(commands.__path__)}
    page = (REFERENCE / "commands.md").read_text()
    assert set(re.findall(r"^## `(\w+)`$", page, re.M)) == names
    for name in names:
        command = importlib.import_module(f"{commands.__name__}.{name}").Command()
        options = {
            option
            for action in command.create_parser("manage.py", name)._actions
            for option in action.option_strings
        }
        section = page.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
        for option in re.findall(r"\[(--[\w-]+)", section):
            assert option in options, f"manage.py {name} has no {option}"


def test_each_block_is_one_stub() -> None:
    """One name per block, so each description sits under its signature."""
    definitions = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.AnnAssign
    for entry in ENTRIES:
        tree = ast.parse(entry.source)
        defined = [node for node in tree.body if isinstance(node, definitions)]
        assert len(defined) == 1, f"{entry}: {len(defined)} definitions"
