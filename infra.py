"""Where things live and the process environment every entry point shares.

REPO_ROOT and CONF_DIR (the one Hydra config folder); `resolve` for config paths given relative
to the repository; `configure_environment()`, which each entry point (`python -m dump`, `-m train`,
`-m evaluation`, tools, benchmarks, the test suite) calls before transformers, huggingface_hub or
vLLM are imported; `compose_config` for the configs outside an entry point. Importing this module
changes nothing.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

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


def compose_config(name: str, overrides: list[str] | None = None) -> DictConfig:
    """The config an entry point would see for these command-line overrides (tests, benchmarks)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name=name, overrides=overrides or [])
