"""A process that dies with its parent (Linux: PR_SET_PDEATHSIG), for the trainer's DataLoader fork
server and its workers: a rank killed mid-run (a crash, a preemption, a fault test) then leaves no
process behind holding its files and pipes."""
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
