"""The server the trainer's DataLoader workers fork from (train/batches.py `_worker_context`).

Imported as the fork server's preload, so that it runs in that server: it binds the server's life
to the rank that started it (Linux: PR_SET_PDEATHSIG), as `bind_to_parent` does for each worker in
turn, so that a rank killed mid-run (a crash, a preemption, a fault test) leaves no server and no
workers behind holding its files and pipes. Then it imports the batches module, once for every
worker the server forks.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def bind_to_parent() -> None:
    """This process gets SIGKILL when its parent dies (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:           # the parent died before the binding took
        os._exit(1)


bind_to_parent()

import train.batches  # noqa: E402,F401  (what every worker runs)
