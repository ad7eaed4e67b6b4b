"""The memory of a command and of every process it starts: wall time, exit status, each process's peak
RSS (VmHWM, by role: vLLM's engine core and workers, training ranks, DataLoader workers) and the
machine's peak used memory, sampled every 0.25 s. Used by bench/rehearse.py to set each stage's
measurement beside its plan."""
from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infra import process_status_bytes

GIB = 1024**3


def _role(pid: int) -> str:
    """What a process of the tree is: its title (vLLM names its engine core and workers), else its
    command."""
    import psutil

    proc = psutil.Process(pid)
    name = proc.name()
    cmd = proc.cmdline()
    if cmd and cmd[0].startswith("VLLM"):              # vLLM's process titles: VLLM::EngineCore, VLLM::Worker
        return cmd[0].split()[0]
    if name.startswith("VLLM") or name == "pt_data_worker":
        return name
    joined = " ".join(cmd)
    rank = proc.environ().get("RANK") if "torchrun" not in joined else None
    for module in ("dump", "train", "evaluation", "bench.rehearse_serve", "bench.rehearse", "tools.rehearsal_verifier", "torch.distributed.run"):
        if f"-m {module}" in joined:
            return module + (f" rank {rank}" if rank is not None and module == "train" else "")
    return name


def watch(cmd: Sequence[str], env: dict[str, str] | None = None, log: Path | None = None) -> dict[str, Any]:
    """Run cmd; its wall time, exit status, the peak RSS (VmHWM) of each process it started (by
    role; the largest of one role) and the machine's peak used memory (total - available)."""
    import psutil

    out = open(log, "w") if log else subprocess.DEVNULL
    began = time.time()
    proc = subprocess.Popen(list(cmd), env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
    peaks: dict[int, dict[str, Any]] = {}
    node = {"peak": 0}
    base = psutil.virtual_memory()
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
            except psutil.Error:
                tree = []
            for pid in tree:
                try:
                    status = process_status_bytes(pid)
                    entry = peaks.setdefault(pid, {"role": _role(pid)})
                    entry["peak_rss"] = max(entry.get("peak_rss", 0), status.get("VmHWM", 0))
                    entry["peak_file"] = max(entry.get("peak_file", 0), status.get("RssFile", 0))
                except (OSError, psutil.Error):
                    pass
            vm = psutil.virtual_memory()
            node["peak"] = max(node["peak"], vm.total - vm.available)
            done.wait(0.25)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    rc = proc.wait()
    done.set()
    thread.join()
    if log:
        out.close()
    by_role: dict[str, dict[str, float]] = {}
    for entry in peaks.values():
        if entry.get("peak_rss", 0) < 64 << 20:          # compilers, shells: not the run's memory
            continue
        role = by_role.setdefault(entry["role"], {"peak_rss_gib": 0.0, "peak_rss_file_gib": 0.0})
        role["peak_rss_gib"] = max(role["peak_rss_gib"], round(entry["peak_rss"] / GIB, 3))
        role["peak_rss_file_gib"] = max(role["peak_rss_file_gib"], round(entry["peak_file"] / GIB, 3))
    return {"cmd": " ".join(cmd), "rc": rc, "wall_s": round(time.time() - began, 1), "processes": by_role,
            "node_used_peak_gib": round(node["peak"] / GIB, 3),
            "node_used_before_gib": round((base.total - base.available) / GIB, 3)}


def checked(result: dict[str, Any], what: str) -> dict[str, Any]:
    if result["rc"] != 0:
        raise RuntimeError(f"{what} failed (exit {result['rc']}): {result['cmd']}")
    return result
