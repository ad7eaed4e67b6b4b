"""The server the trainer's DataLoader workers fork from (train/batches.py `_worker_context`).

Imported as the fork server's preload, so that it runs in that server: it binds the server's life
to the rank that started it (train/parent_death.py), as each worker binds its own to the server,
so that a rank killed mid-run leaves no server and no workers behind. Then it imports the batches
module, once for every worker the server forks.
"""
from __future__ import annotations

from train.parent_death import bind_to_parent

bind_to_parent()

import train.batches  # noqa: E402,F401  (what every worker runs)
