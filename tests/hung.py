"""Tests that hang on purpose, run only by ``tests/test_hangs.py`` (the file
name keeps pytest from collecting them): the proof that a hang fails a run
in minutes, with stacks, and leaves no process behind."""

from __future__ import annotations

import threading
import time

from tests.children import join, spawn


def hang_forever() -> None:
    time.sleep(3600)


def test_a_child_hangs() -> None:
    join([spawn(hang_forever, bound=3600)], within=3600)


def test_a_thread_keeps_pytest_from_exiting() -> None:
    threading.Thread(target=hang_forever).start()
