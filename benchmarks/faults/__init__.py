"""Jepsen-style fault injection for django-semaphore on a real MariaDB.

Real client processes hammer real semaphores while faults are injected
(SIGKILL, server-side ``KILL``, MariaDB restarts, lock waits, deadlocks, lost
responses, a killed Celery worker, paused holders). Every client records what
it asked and what it was told; triggers record every committed change to the
permit tables inside the database; an independent checker then verifies the
invariants from those records. See ``docs/faults.md``.

    python -m benchmarks.faults            # the full run (>= 200,000 acquires)
    python -m benchmarks.faults --ci       # the subset the test suite runs
"""
