"""What this process keeps between calls, and the one hook that renews it
in a forked child.

A Celery prefork worker forks once the app is loaded. The child inherits
the parent's memory but none of its threads: a lock another thread held at
the fork would stay taken in the child forever, and the parent's waiters,
leases, listeners and grants belong to threads that are not there. So every
such piece of state is a ``State``: it builds itself in ``reset``, once when
created and again in every forked child, before the child runs anything
else (``os.register_at_fork``, registered here once for all of them).
"""

from __future__ import annotations

import os
import weakref


class State:
    """Per-process state: ``reset`` builds every lock, queue and thread
    reference it owns, as new."""

    def __init__(self) -> None:
        self.reset()
        KEPT.add(self)

    def reset(self) -> None:
        raise NotImplementedError


# Every live State of this process (the fork test holds each of their locks).
KEPT: weakref.WeakSet[State] = weakref.WeakSet()


def _renew_in_child() -> None:
    for state in list(KEPT):
        state.reset()


os.register_at_fork(after_in_child=_renew_in_child)
