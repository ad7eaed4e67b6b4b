"""Process environment every entry point and test shares: offline hubs, caches inside the repo.

Set before transformers, huggingface_hub or vLLM are imported, since they read it at import
time. `setdefault` keeps whatever the user exported (a cluster's shared cache, say).
"""
from __future__ import annotations

import os

from model.paths import REPO_ROOT

CACHE = REPO_ROOT / ".cache"


def configure() -> None:
    defaults = {
        # Nothing in this project may fetch a model or a data set from a hub.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(CACHE / "hf"),
        "VLLM_CACHE_ROOT": str(CACHE / "vllm"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TORCH_EXTENSIONS_DIR": str(CACHE / "torch_extensions"),
        "TRITON_CACHE_DIR": str(CACHE / "triton"),
        "MPLCONFIGDIR": str(CACHE / "matplotlib"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


configure()
