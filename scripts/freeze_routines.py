"""Freeze this code's routines into a migration's SQL files.

    scripts/freeze_routines.py 0019_routines_v2

writes ``django_semaphore/migrations/sql/0019_routines_v2.{mariadb,postgresql}.sql``
from ``engine/statements/routines.creates``, rendered on the private test
servers (``scripts/servers.py start mariadb postgres`` prints their URLs:
``eval`` them first). A migration installs the files with
``_routines.replace``; once released, neither ever changes again: a changed
routine is a new ``ROUTINES_VERSION``, frozen by a new migration.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import django
import environ
from django.conf import settings

ROOT = Path(__file__).resolve().parent.parent
END = "\n-- end of statement\n"


def main(migration: str) -> None:
    servers = {
        "mariadb": os.environ["SEMAPHORE_MARIADB_URL"],
        "postgresql": os.environ["SEMAPHORE_POSTGRES_URL"],
    }
    settings.configure(
        INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django_semaphore"],
        DATABASES={
            "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
            **{server: environ.Env.db_url_config(url) for server, url in servers.items()},
        },
        USE_TZ=True,
    )
    django.setup()
    from django.db import connections

    from django_semaphore.engine.statements import routines

    for server in servers:
        path = ROOT / "django_semaphore" / "migrations" / "sql" / f"{migration}.{server}.sql"
        path.write_text("".join(sql.strip() + END for sql in routines.creates(connections[server])))
        print(path.relative_to(ROOT))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(*sys.argv[1:])
