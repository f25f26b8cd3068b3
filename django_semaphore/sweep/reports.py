"""What a sweep reports: the counts of one orphan sweep or one clean-up run,
added up over the aliases (``batches._on_every_alias``)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class OrphanReport:
    """How many requests one orphan sweep released, by reason, and what else
    it repaired that the engine did not write (see :data:`REPAIRS`)."""

    # Requests completed whose permits were all or partly released already:
    # a crash between release's updates, or an edit behind the engine's back.
    repaired: int = 0
    expired: int = 0
    owner_dead: int = 0
    stale: int = 0
    stray_permits: int = 0  # ACQUIRED permits of a RELEASED request, released
    orphan_permits: int = 0  # ACQUIRED permits whose request row is gone, released
    fencing_counters: int = 0  # counters raised to the highest token already issued
    # In-use counters found differing from the permits they count (corrected
    # unless dry_run): a bug, reported loudly by ``verifier.verify``.
    counter_drift: int = 0
    dry_run: bool = False

    @property
    def total(self) -> int:
        """Requests released."""
        return self.repaired + self.expired + self.owner_dead + self.stale

    @property
    def repairs(self) -> int:
        """Inconsistent states repaired, whichever way they arose."""
        return self.repaired + self.stray_permits + self.orphan_permits + self.fencing_counters

    def __str__(self) -> str:
        verb = "would release" if self.dry_run else "released"
        counts = ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self)[:4])
        text = f"Orphans: {verb} {self.total} ({counts})."
        others = [f for f in fields(self)[4:7] if getattr(self, f.name)]
        if others:
            verb = "would repair" if self.dry_run else "repaired"
            repairs = ", ".join(f"{f.name} {getattr(self, f.name)}" for f in others)
            text += f" Also {verb}: {repairs}."
        if self.counter_drift:
            text += f" {self.counter_drift} in-use counters drifted."
        return text


@dataclass
class CleanupReport:
    """What one clean-up run deleted."""

    what: str
    deleted: int = 0  # requests, or capacity changes
    permits: int = 0  # permits deleted with their requests
    batches: int = 0
    finished: bool = True  # False: the time budget ran out first
    dry_run: bool = False

    def __str__(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        text = f"{self.what.capitalize()}: {verb} {self.deleted}"
        if self.what in {"released requests", "idle family members"}:
            text += f" and {self.permits} permits"
        if not self.dry_run:
            text += f" in {self.batches} batches"
            if not self.finished:
                text += " (time budget spent; the next run goes on)"
        return text + "."
