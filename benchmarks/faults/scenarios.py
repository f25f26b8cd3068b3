"""The fault scenarios: which semaphores, what clients ask for, which fault.

Every scenario runs ``clients`` processes (>= 8) on a mix of *hot*
semaphores (every client wants them: capacity 1 and 2) and *spread* ones
(16 semaphores of capacity 2, one picked at random), plus multi-semaphore
requests over both (all-or-nothing, names in random order, counts 1-2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SPREAD = [f"spread-{i:02d}" for i in range(16)]
SEMAPHORES = {"hot-1": 1, "hot-2": 2, "hot-3": 3, **dict.fromkeys(SPREAD, 2)}
TTL = 2
# Each scenario runs until this many acquire attempts (or its time cap):
# 12 scenarios of clients plus the Celery one give >= 200,000 (full) and
# >= 20,000 (the test suite's subset).
FULL_TARGET = 19_000
CI_TARGET = 1_900


def standard_mix(ttl: int | None = TTL) -> list[dict[str, Any]]:
    return [
        {"weight": 25, "names": ["hot-1"], "ttl": ttl},
        {"weight": 15, "names": ["hot-2"], "ttl": ttl, "counts": [1, 2]},
        {"weight": 35, "names": SPREAD, "ttl": ttl},
        # Spread permits without a TTL: only the dead-owner sweep frees them
        # when their holder is killed.
        {"weight": 5, "names": SPREAD, "ttl": None},
        {"weight": 10, "names": ["hot-2", "hot-3"], "take": 2, "ttl": ttl, "counts": [1, 2]},
        {"weight": 10, "names": ["hot-1", *SPREAD[:4]], "take": 2, "ttl": ttl},
    ]


@dataclass
class Scenario:
    name: str
    what: str  # the fault, as the results table says it
    duration: float  # seconds of load in the full run
    fault: dict[str, Any] = field(default_factory=dict)  # armed in the clients
    arm_every: float = 0.0  # seconds between arms (a random client each time)
    nemesis: str = "arm"  # or: restart-clean, restart-hard, lock-hog, deadlock-hog, celery
    every: float = 0.0  # seconds between nemesis actions
    mix: list[dict[str, Any]] = field(default_factory=standard_mix)
    clients: int = 8
    hold: tuple[float, float] = (0.0, 0.002)
    env: dict[str, str] = field(default_factory=dict)
    ci_duration: float = 0.0

    target: int = FULL_TARGET  # acquire attempts after which the scenario ends
    ci_target: int = CI_TARGET
    least: float = 0.0  # seconds it runs at least (restarts need time)

    def budget(self, ci: bool) -> tuple[float, int, float]:
        """Longest it runs, attempts after which it stops, shortest it runs."""
        if ci:
            return self.ci_duration, self.ci_target, min(self.least / 4, self.ci_duration)
        return self.duration, self.target, self.least

    def seconds(self, ci: bool) -> float:
        return self.ci_duration if ci else self.duration


PAUSE_MIX = [
    # Mutual exclusion guarding a downstream resource with fencing tokens.
    {"weight": 60, "names": ["hot-1"], "ttl": 1, "fence": "hot-1"},
    {"weight": 40, "names": SPREAD, "ttl": TTL},
]

DEADLOCK_MIX = [
    {"weight": 40, "names": ["hot-1", "hot-3"], "take": 2, "ttl": TTL},
    {"weight": 40, "names": ["hot-2", "hot-3"], "take": 2, "ttl": TTL, "counts": [1, 2]},
    {"weight": 20, "names": ["hot-1", "hot-2", "hot-3"], "take": 3, "ttl": TTL},
]

SCENARIOS = [
    Scenario(
        "baseline",
        "none (control run)",
        duration=300,
        ci_duration=20,
    ),
    Scenario(
        "kill-holding",
        "SIGKILL of a client while it holds permits",
        duration=300,
        ci_duration=20,
        fault={"points": ["hold"], "action": "sigkill"},
        arm_every=0.3,
    ),
    Scenario(
        "kill-acquiring",
        "SIGKILL of a client inside its grant transaction (rows locked, permits inserted)",
        duration=300,
        ci_duration=20,
        fault={"points": ["acquire.insert"], "action": "sigkill"},
        arm_every=0.3,
    ),
    Scenario(
        "kill-releasing",
        "SIGKILL of a client as it releases (before its one release statement; between the\n"
        "two updates of a sweep or SQLite release: a half-released request)",
        duration=300,
        ci_duration=20,
        fault={"points": ["release.request"], "action": "sigkill"},
        arm_every=0.3,
    ),
    Scenario(
        "connkill-acquire",
        "server-side KILL of the client's connection mid-acquire (row lock / insert)",
        duration=300,
        ci_duration=20,
        fault={"points": ["acquire.lock", "acquire.insert"], "action": "connkill"},
        arm_every=0.05,
    ),
    Scenario(
        "connkill-release",
        "server-side KILL of the client's connection mid-release",
        duration=300,
        ci_duration=20,
        fault={"points": ["release.permits", "release.request"], "action": "connkill"},
        arm_every=0.05,
    ),
    Scenario(
        "restart-clean",
        "MariaDB shut down cleanly and restarted mid-run",
        duration=300,
        ci_duration=20,
        least=40,
        nemesis="restart-clean",
        every=7,
    ),
    Scenario(
        "restart-kill9",
        "MariaDB killed with SIGKILL (crash recovery) and restarted mid-run",
        duration=300,
        ci_duration=20,
        least=40,
        nemesis="restart-hard",
        every=7,
    ),
    Scenario(
        "lock-timeouts",
        "hot rows held locked past the bounded lock wait (1 s) by another session",
        duration=300,
        ci_duration=20,
        nemesis="lock-hog",
        target=8_000,
        ci_target=1_000,
        env={"FAULTS_LOCK_WAIT_TIMEOUT": "1", "FAULTS_RETRY_ATTEMPTS": "2"},
    ),
    Scenario(
        "deadlocks",
        "forced deadlocks: sessions locking hot rows in the opposite order",
        duration=300,
        ci_duration=20,
        nemesis="deadlock-hog",
        target=8_000,
        ci_target=1_000,
        mix=DEADLOCK_MIX,
    ),
    Scenario(
        "lost-response",
        "the grant commits, then the connection drops before the answer arrives",
        duration=300,
        ci_duration=20,
        fault={"points": ["acquire.commit"], "action": "lost-response"},
        arm_every=0.05,
    ),
    Scenario(
        "paused-holder",
        "holder SIGSTOPped past its TTL, then SIGCONT; its fenced write must be refused",
        duration=300,
        ci_duration=20,
        fault={"points": ["hold"], "action": "sigstop"},
        arm_every=0.6,
        mix=PAUSE_MIX,
        least=32,
        hold=(0.0, 0.01),
    ),
    Scenario(
        "celery-redelivery",
        "Celery pool process SIGKILLed mid-task (acks_late), task redelivered",
        duration=60,
        ci_duration=10,
        nemesis="celery",
        every=0.8,
    ),
]


def by_name() -> dict[str, Scenario]:
    return {scenario.name: scenario for scenario in SCENARIOS}
