"""Verifier definitions: the embedded kimi-tiny and the shapes of the real Kimi models."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from model.paths import resolve

CHAT_TEMPLATE_PATH = Path(__file__).with_name("kimi_chat_template.jinja")


def chat_template() -> str:
    """Kimi's chat format as a Jinja template (the one tokenizer_config.json carries)."""
    return CHAT_TEMPLATE_PATH.read_text()


def verifier_dir(cfg: DictConfig) -> Path:
    """The folder holding the verifier's config.json, weights and tokenizer."""
    return resolve(cfg.path)


def hf_config_dict(cfg: DictConfig) -> dict[str, Any]:
    """The verifier's architecture as a Hugging Face config dict (the keys vLLM reads too)."""
    arch = OmegaConf.to_container(cfg.architecture, resolve=True)
    assert isinstance(arch, dict)
    return arch
