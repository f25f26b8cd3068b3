"""The engine: the only code that locks semaphore rows.

It runs one transaction at a time and returns; it never sleeps (the
database does, in one place: the head of a line,
``statements/grant_routine.py``) and knows none of its callers (``api``,
``waiting``, the sweeps and the admin call it).
"""
