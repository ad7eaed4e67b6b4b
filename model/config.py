"""Compose the Hydra configs in conf/ outside an entry point (tests, benchmarks, notebooks)."""
from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from model.paths import REPO_ROOT

CONF_DIR = REPO_ROOT / "conf"


def compose_config(name: str, overrides: list[str] | None = None) -> DictConfig:
    """The config an entry point would see for these command-line overrides."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name=name, overrides=overrides or [])
