"""One orphan sweep, run by the runner after a scenario's clients are gone.

Uses the app's own sweep (``django_semaphore.sweep.release_orphans``) with the
fault clients' pid liveness checker. Prints what it released as JSON.
"""

from __future__ import annotations

import json
import os


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.faults.settings")
    import django

    django.setup()
    from django_semaphore import sweep

    report = sweep.release_orphans()
    print(
        json.dumps(
            {
                "repaired": report.repaired,
                "expired": report.expired,
                "owner_dead": report.owner_dead,
                "stale": report.stale,
            }
        )
    )


if __name__ == "__main__":
    main()
