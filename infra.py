"""Where things live and the process environment every entry point shares.

REPO_ROOT and CONF_DIR (the one Hydra config folder); `resolve` for config paths given relative
to the repository; `configure_environment()`, which each entry point (`python -m dump`, `-m train`,
`-m evaluation`, tools, benchmarks, the test suite) calls before transformers, huggingface_hub or
vLLM are imported; `failpoint`, the named places where the fault suite makes a process die or
fail; `cpu_flags`, the CPU's instruction-set features, on which the CPU engine's attention
backend depends; `run_subcommand`, the `python -m <stage> <subcommand>` dispatch. Config
composition is config/'s.
Importing this module changes nothing.
"""
from __future__ import annotations

import errno
import importlib
import os
import signal
import socket
import sys
from collections import Counter
from collections.abc import Callable, Set
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent
CONF_DIR = REPO_ROOT / "conf"
CACHE = REPO_ROOT / ".cache"


def resolve(path: str | Path) -> Path:
    """A config path: absolute as given, relative ones from the repository root (not Hydra's cwd)."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def configure_environment() -> None:
    """Offline hubs and caches inside the repository, for this process and the ones it starts.

    Call it before transformers, huggingface_hub or vLLM are imported: they read it at import
    time. `setdefault` keeps whatever the user exported (a cluster's shared cache, say).
    """
    # Compiled code (vLLM's torch.compile and CUDA-graph caches, Triton kernels, torch extensions)
    # under a folder of this host's: a repository on a cluster's shared filesystem is seen by every
    # node, whose compilers, GPUs and locks are their own.
    node = CACHE / "nodes" / socket.gethostname()
    defaults = {
        # Nothing in this project may fetch a model or a data set from a hub.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(CACHE / "hf"),
        "VLLM_CACHE_ROOT": str(node / "vllm"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TORCH_EXTENSIONS_DIR": str(node / "torch_extensions"),
        "TRITON_CACHE_DIR": str(node / "triton"),
        "MPLCONFIGDIR": str(CACHE / "matplotlib"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


# ---- fault injection -------------------------------------------------------------------------
# EAGLE3_FAILPOINTS="name[:hit[:action]],...": the hit-th time (1-based, default 1) this process
# reaches failpoint(name) it acts: kill (SIGKILL itself: a crash, a preemption, an OOM kill), stop
# (SIGSTOP itself, for a test to look at the files mid-write and then SIGCONT it) or enospc (raise
# the OSError a full disk raises). Unset, a failpoint costs one dict lookup.
FAILPOINTS_ENV = "EAGLE3_FAILPOINTS"
FAILPOINT_ACTIONS = ("kill", "stop", "enospc")
_failpoint_hits: Counter[str] = Counter()


def _armed_failpoints() -> dict[str, tuple[int, str]]:
    armed = {}
    for spec in filter(None, os.environ.get(FAILPOINTS_ENV, "").split(",")):
        parts = spec.split(":")
        name, hit, action = (parts + ["1", "kill"][len(parts) - 1:]) if len(parts) <= 3 else ("", "", "")
        if not name or not hit.isdigit() or action not in FAILPOINT_ACTIONS:
            raise ValueError(f"{FAILPOINTS_ENV}: {spec!r} is not name[:hit[:action]] with action one of "
                             f"{FAILPOINT_ACTIONS}")
        armed[name] = (int(hit), action)
    return armed


def failpoint(name: str) -> None:
    """A place the fault suite can make fail (EAGLE3_FAILPOINTS above); a no-op otherwise."""
    if FAILPOINTS_ENV not in os.environ:
        return
    armed = _armed_failpoints().get(name)
    if armed is None:
        return
    _failpoint_hits[name] += 1
    hit, action = armed
    if _failpoint_hits[name] != hit:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (failpoint {name})")


def process_status_bytes(pid: int | str = "self") -> dict[str, int]:
    """The memory fields of /proc/<pid>/status (VmRSS, VmHWM, RssFile, ...; given in kB), in
    bytes; OSError where there is no such process or no /proc (not Linux)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[key] = int(parts[0]) * 1024
    return fields


def process_memory_bytes(field: str = "VmRSS") -> int | None:
    """This process's memory: VmRSS (resident now) or VmHWM (peak resident since start or the last
    reset); None where /proc is missing (not Linux)."""
    try:
        return process_status_bytes().get(field)
    except OSError:
        return None


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in /proc/cpuinfo text (x86: the `flags` line;
    aarch64: `Features`); empty when there is none."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags (e.g. amx_tile, amx_bf16, avx512_bf16), read once;
    empty where /proc/cpuinfo is missing (not Linux), which every caller treats as "no such unit"."""
    try:
        return parse_cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


# x86 units that run bf16 matmuls natively; without them bf16 takes slow fallbacks.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def has_bf16_units(flags: Set[str] | None = None) -> bool:
    """Whether a CPU with these feature flags (default: this machine's) runs bf16 natively."""
    return bool(BF16_CPU_FLAGS & set(cpu_flags() if flags is None else flags))


Subcommand = Callable[[list[str]], int]


def run_subcommand(subcommands: dict[str, str | Subcommand], stage_main: Callable[[], None]) -> None:
    """`python -m <stage> NAME ARGS...`: run subcommands[NAME] (a function, or "module:function",
    imported only when chosen so that a subcommand does not pay for the others' imports) on ARGS
    and exit with the status it returns; with no known NAME, run the stage's own (Hydra) main on
    the whole command line."""
    name = sys.argv[1] if len(sys.argv) > 1 else None
    if name not in subcommands:
        stage_main()
        return
    command = subcommands[name]
    if isinstance(command, str):
        module, _, function = command.partition(":")
        command = getattr(importlib.import_module(module), function)
    sys.exit(command(sys.argv[2:]))
