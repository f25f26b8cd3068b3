"""Tasks run by a real Celery worker in the tests."""

from __future__ import annotations

import os
import time
from typing import Any

from celery import shared_task
from django.utils import timezone

from django_semaphore import PermitTask, holds_permit
from tests.testapp.models import RunLog

ONE = "celery-one"  # capacity 1, created by each test


def _work(label: str, hold: float, task: Any) -> int:
    from django_semaphore.models import PermitRequest

    request = PermitRequest.objects.get(external_id__startswith=task.request.id, state="ACQUIRED")
    log = RunLog.objects.create(
        label=label,
        task_id=task.request.id,
        pid=os.getpid(),
        token=request.token(ONE),
        started_at=timezone.now(),
    )
    time.sleep(hold)
    log.ended_at = timezone.now()
    log.save(update_fields=["ended_at"])
    return log.pk


@shared_task(bind=True, max_retries=40)
@holds_permit(ONE)
def exclusive(self: Any, label: str, hold: float) -> int:
    return _work(label, hold, self)


@shared_task(max_retries=40)
@holds_permit(ONE)
def exclusive_unbound(label: str, hold: float) -> int:
    from celery import current_task

    return _work(label, hold, current_task)


@shared_task(bind=True, max_retries=1)
@holds_permit(ONE, park=False)
def impatient(self: Any, label: str) -> int:
    """Retries when refused (opted out of parking), then fails."""
    return _work(label, 0, self)


@shared_task(bind=True, max_retries=0)
@holds_permit(ONE)
def waits_its_turn(self: Any, label: str, hold: float) -> int:
    """The defaults: refused, it waits (stands by, parks); one retry spent
    for want of room would fail it."""
    return _work(label, hold, self)


@shared_task(bind=True, max_retries=3)
@holds_permit(ONE)
def retries_once(self: Any, label: str) -> int:
    log_pk = _work(label, 0, self)
    if self.request.retries == 0:
        raise self.retry(countdown=1)
    return log_pk


@shared_task(bind=True, max_retries=3)
@holds_permit(ONE, ttl=30)
def slow(self: Any, label: str, hold: float) -> int:
    return _work(label, hold, self)


# --- leases (test_leases, on a worker whose LEASE is 2 s) ------------------------


@shared_task(bind=True, acks_late=False)  # acknowledged first: never run again once killed
@holds_permit(ONE)
def held_until_killed(self: Any, label: str, hold: float) -> int:
    return _work(label, hold, self)


@shared_task(bind=True, max_retries=3)
@holds_permit(ONE)
def retries_after_a_lease(self: Any, label: str, countdown: int) -> int:
    """Holds ONE across a retry whose countdown outlasts the lease."""
    log_pk = _work(label, 0, self)
    if self.request.retries == 0:
        raise self.retry(countdown=countdown)
    return log_pk


# --- maintenance (test_liveness, test_beat) ------------------------------------

# The worker runs the app's own maintenance tasks too (scheduled by beat).
import django_semaphore.tasks  # noqa: E402, F401


@shared_task(bind=True)
def naps(self: Any, seconds: float) -> str:
    time.sleep(seconds)
    return str(self.request.id)


@shared_task(bind=True, max_retries=3)
@holds_permit(ONE)
def retries_much_later(self: Any) -> None:
    """Holds ONE, then waits for a retry a minute away: a parked permit."""
    raise self.retry(countdown=60)


HELPER = "celery-helper"  # capacity 1, created by the test that uses it


@holds_permit(HELPER)
def helper_holding_its_own_permit() -> str:
    from django_semaphore.models import PermitRequest

    return PermitRequest.objects.get(permits__semaphore__name=HELPER, state="ACQUIRED").external_id


@shared_task(bind=True, max_retries=3)
@holds_permit(ONE)
def calls_a_decorated_helper(self: Any) -> str:
    return helper_holding_its_own_permit()


@shared_task(bind=True, autoretry_for=(ValueError,), max_retries=2, default_retry_delay=0)
@holds_permit(ONE)
def fails_then_autoretries(self: Any, label: str) -> int:
    log_pk = _work(label, 0, self)
    if self.request.retries < 2:
        raise ValueError("not yet")
    return log_pk


# --- parked tasks (test_parked) ----------------------------------------------------

PARK = "celery-park"  # created by each test of test_parked, capacity as it needs
PARK_OTHER = "celery-park-other"


def _work_on(name: str, label: str, hold: float, task: Any) -> int:
    from django_semaphore.models import PermitRequest

    request = PermitRequest.objects.get(external_id__startswith=task.request.id, state="ACQUIRED")
    log = RunLog.objects.create(
        label=label,
        task_id=task.request.id,
        pid=os.getpid(),
        token=request.token(name),
        started_at=timezone.now(),
    )
    time.sleep(hold)
    log.ended_at = timezone.now()
    log.save(update_fields=["ended_at"])
    return log.pk


@shared_task(bind=True, max_retries=0)
@holds_permit(PARK, park=True)
def parked(self: Any, label: str, hold: float) -> int:
    return _work_on(PARK, label, hold, self)


@shared_task(bind=True, max_retries=0)
@holds_permit({PARK: 1, PARK_OTHER: 1}, park=True)
def parked_on_two(self: Any, label: str, hold: float) -> int:
    return _work_on(PARK, label, hold, self)


@shared_task(bind=True, max_retries=0)
@holds_permit(PARK, park=True, max_waiting=3)
def parked_at_most_three(self: Any, label: str, hold: float) -> int:
    return _work_on(PARK, label, hold, self)


RATE_PARK = "celery-rate-park"  # a rate limit, created by test_rates


@shared_task(bind=True, max_retries=0)
@holds_permit(RATE_PARK, park=True)
def rate_limited(self: Any, label: str) -> int:
    return _work_on(RATE_PARK, label, 0.0, self)


# Two tenants sharing one semaphore, each under its own cap (test_tenants).
SHARED = "celery-exports"
TENANT_A = "celery-export:customer:A"
TENANT_B = "celery-export:customer:B"


@shared_task(bind=True, max_retries=0)
@holds_permit({SHARED: 1, TENANT_A: 1}, park=True)
def export_for_a(self: Any, label: str, hold: float) -> int:
    return _work_on(SHARED, label, hold, self)


@shared_task(bind=True, max_retries=0)
@holds_permit({SHARED: 1, TENANT_B: 1}, park=True)
def export_for_b(self: Any, label: str, hold: float) -> int:
    return _work_on(SHARED, label, hold, self)


@shared_task(bind=True, max_retries=40)
@holds_permit(lambda member, **_: f"celery-family:{member}")
def per_member(self: Any, member: str, hold: float = 0.0) -> int:
    """Holds a permit of its own member of the family ``celery-family:*``
    (capacity 1), computed from its argument; returns the member's in-use."""
    from django_semaphore.models import Semaphore

    time.sleep(hold)
    return Semaphore.objects.get(name=f"celery-family:{member}").in_use


# --- who may wait: policies decided when the task is sent (test_policies) ------------

ONCE = "celery-once"  # capacity 1, created by each test of test_policies
LATEST = "celery-latest"


@shared_task(bind=True, base=PermitTask, max_retries=0)
@holds_permit(ONCE, on_conflict="discard")
def once(self: Any, label: str, hold: float) -> int:
    return _work_on(ONCE, label, hold, self)


@shared_task(bind=True, base=PermitTask, max_retries=0)
@holds_permit(lambda customer, hold: f"{ONCE}:{customer}", on_conflict="discard")
def once_per_customer(self: Any, customer: int, hold: float) -> int:
    return _work_on(f"{ONCE}:{customer}", str(customer), hold, self)


@shared_task(bind=True, base=PermitTask, max_retries=2)
@holds_permit(ONCE, on_conflict="discard")
def once_retried(self: Any, label: str) -> int:
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return _work_on(ONCE, label, 0, self)


@shared_task(bind=True, base=PermitTask, max_retries=0)
@holds_permit(LATEST, on_conflict="replace")
def latest(self: Any, label: str, hold: float) -> int:
    return _work_on(LATEST, label, hold, self)


@shared_task(bind=True, base=PermitTask, max_retries=0)
@holds_permit(LATEST, max_waiting=2)
def at_most_two_wait(self: Any, label: str, hold: float) -> int:
    return _work_on(LATEST, label, hold, self)


@shared_task(bind=True, base=PermitTask, max_retries=0)
@holds_permit(LATEST, max_waiting=10, priority=lambda label, urgent: 80 if urgent else 0)
def urgent_first(self: Any, label: str, urgent: bool) -> int:
    return _work_on(LATEST, label, 0, self)


@shared_task(bind=True, base=PermitTask, max_retries=0)
@holds_permit(LATEST, max_waiting=2, share=lambda customer, label: customer)
def per_customer(self: Any, customer: str, label: str) -> int:
    return _work_on(LATEST, label, 0, self)


@shared_task(bind=True, max_retries=0)
@holds_permit(ONCE, on_conflict="discard")
def discards_without_its_class(self: Any) -> None:
    """``on_conflict`` on a plain task class: its run fails."""


DEBOUNCED = "celery-debounced"


@shared_task(bind=True, base=PermitTask, max_retries=0)
@holds_permit(DEBOUNCED, debounce=1)
def debounced(self: Any, label: str, hold: float) -> int:
    return _work_on(DEBOUNCED, label, hold, self)


@shared_task(bind=True, base=PermitTask, max_retries=0)
@holds_permit(lambda member: f"celery-family:{member}", on_conflict="discard")
def once_per_member(self: Any, member: str) -> None:
    """One at a time per member of ``celery-family:*``, created when first sent."""
