"""Every public name has a docstring: what ``help()`` and an editor show, and
what the API reference (docs/reference/) says in its own words.

Read statically with griffe, so the docstrings of module attributes
(signals, beat's names) count, which no runtime ``__doc__`` holds. A new
public function, class, method, signal or schedule name without a docstring
fails here.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator

import griffe
import pytest
from django.core.management import BaseCommand

import django_semaphore
import django_semaphore.management.commands

# The modules whose public names are the API; everything else is internal.
PUBLIC_MODULES = (
    "beat",
    "blockers",
    "engine.verifier",
    "exceptions",
    "fencing",
    "integrations.context",
    "integrations.leases",
    "liveness",
    "managers",
    "models",
    "parking",
    "parking.wake",
    "signals",
    "states",
    "sweep",
    "sweep.batches",
    "sweep.cleanups",
    "sweep.orphans",
    "sweep.parked",
    "sweep.repairs",
    "sweep.reports",
    "tasks",
    "waiting",
)
# Module attributes that are API (the others are constants and loggers).
PUBLIC_ATTRIBUTE_MODULES = ("beat", "signals")
# Internal despite a public name: the process heartbeat (``leases.hold`` is its door).
INTERNAL = {"django_semaphore.integrations.leases.Heartbeat"}


def package() -> griffe.Module:
    loaded = griffe.load("django_semaphore", resolve_aliases=True, resolve_external=False)
    assert isinstance(loaded, griffe.Module)
    return loaded


def public_objects() -> Iterator[griffe.Object | griffe.Alias]:
    """``__all__``'s names, then each public module's functions and classes (and
    their own public methods), and the API attributes."""
    root = package()
    for name in django_semaphore.__all__:
        yield root[name]
    for module_name in PUBLIC_MODULES:
        module = root[module_name]
        for member in module.members.values():
            if member.is_alias or not member.is_public or member.path in INTERNAL:
                continue
            api_attribute = member.is_attribute and module_name in PUBLIC_ATTRIBUTE_MODULES
            if api_attribute or member.is_function:
                yield member
            elif member.is_class:
                yield member
                yield from own_public_methods(member)


def own_public_methods(cls: griffe.Object | griffe.Alias) -> Iterator[griffe.Object]:
    """Methods the class adds: not private, and not overriding a base class's
    method (Django's ``get_queryset``, a checker's ``check``), which the base
    documents."""
    runtime = getattr(importlib.import_module(cls.module.path), cls.name)
    for name, member in cls.members.items():
        if name.startswith("_") or member.is_alias or not member.is_function:
            continue
        if any(hasattr(base, name) for base in runtime.__mro__[1:]):
            continue
        yield member


def missing_docstrings() -> set[str]:
    return {obj.path for obj in public_objects() if not (obj.docstring and obj.docstring.value)}


def test_every_public_name_has_a_docstring():
    assert missing_docstrings() == set()


def test_the_check_sees_the_public_names():
    """Guards the guard: the walk reaches the names the reference documents."""
    seen = {obj.path for obj in public_objects()}
    assert {
        "django_semaphore.acquire",
        "django_semaphore.force_release",
        "django_semaphore.set_capacity",
        "django_semaphore.managers.SemaphoreQuerySet.locked",
        "django_semaphore.exceptions.SemaphoreExhausted",
        "django_semaphore.signals.permit_released",
        "django_semaphore.beat.BEAT_SCHEDULE",
        "django_semaphore.tasks.release_orphans",
        "django_semaphore.sweep.orphans.release_orphans",
        "django_semaphore.parking.wake.wake",
        "django_semaphore.fencing.advance",
        "django_semaphore.integrations.context.HeldPermit.token",
    } <= seen


def command_names() -> list[str]:
    commands = django_semaphore.management.commands
    return [module.name for module in pkgutil.iter_modules(commands.__path__)]


@pytest.mark.parametrize("name", command_names())
def test_every_management_command_has_help(name):
    command = importlib.import_module(f"django_semaphore.management.commands.{name}").Command
    assert issubclass(command, BaseCommand)
    assert command.help.strip(), f"manage.py {name} --help says nothing"
