"""The demo's embedded Celery broker: kombu's filesystem transport, each
message written whole before a worker can see it.

Kombu writes a message file in place (``open``, then ``write``) while a
worker moves and reads every message file it lists, so a worker that lists
one between the two reads it empty and dies on it (celery/kombu#1551; the
demo's worker did once under load). Here a message is written under a name
no worker reads, then renamed to its own: a rename within a folder is
atomic.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    # Kombu's own channels name the message differently (message, payload).
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        # Kombu's name: a worker takes the files of a queue in name order.
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        path = os.path.join(self.data_folder_out, name)
        # Not "<anything>.<queue>.msg": no worker lists it as a message.
        staged = os.path.join(self.data_folder_out, f".{name}.part")
        try:
            with open(staged, "wb") as file:
                file.write(str_to_bytes(dumps(payload)))  # type: ignore[no-untyped-call]
            os.replace(staged, path)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {path!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel
