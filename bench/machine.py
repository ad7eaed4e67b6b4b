"""The machine a benchmark ran on, as its result file records it: a CPU figure is this machine's."""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from infra import cpu_flags


def machine() -> dict[str, Any]:
    """CPU model, cores, memory (GiB) and the bf16 units that decide the CPU paths (AMX, AVX-512 bf16)."""
    import psutil

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor() or platform.machine())
    flags = cpu_flags()
    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags}
