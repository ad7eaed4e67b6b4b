"""Where a verifier's files are: the folder its config names (config.json, weights, tokenizer).

The embedded kimi-tiny ships in kimi_tiny/ (built by `make verifier`, tools/build_verifier.py);
the real Kimi models' shapes are in conf/verifier/.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from infra import resolve


def verifier_dir(cfg: DictConfig) -> Path:
    """The folder holding the verifier's config.json, weights and tokenizer."""
    return resolve(cfg.path)
