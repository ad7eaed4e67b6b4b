"""Read single verifier tensors by name from its safetensors files, nothing else.

A Kimi verifier is ~1T parameters: the draft needs only its embedding, final norm and lm_head,
so they are read one by one with `safe_open` (single model.safetensors or sharded with
model.safetensors.index.json); no other tensor is ever loaded.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
# Multimodal wrappers (Kimi-K2.5/K3 style) nest the language model one level down.
PREFIXES = ("", "language_model.")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def weight_map(verifier_dir: Path) -> dict[str, str]:
    """Tensor name -> file name (relative to verifier_dir)."""
    verifier_dir = Path(verifier_dir)
    index = verifier_dir / INDEX_FILE
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = verifier_dir / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"no {INDEX_FILE} or {SINGLE_FILE} in {verifier_dir}")
    with safe_open(str(single), framework="pt") as f:
        return {name: SINGLE_FILE for name in f.keys()}


def read_tensors(verifier_dir: Path, names: Iterable[str]) -> dict[str, Tensor]:
    """The named tensors, as stored (dtype kept), opening each file once."""
    verifier_dir = Path(verifier_dir)
    where = weight_map(verifier_dir)
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name not in where:
            raise KeyError(f"{name} not in the verifier's weights ({verifier_dir})")
        by_file.setdefault(where[name], []).append(name)
    out: dict[str, Tensor] = {}
    for file, file_names in by_file.items():
        with safe_open(str(verifier_dir / file), framework="pt") as f:
            for name in file_names:
                out[name] = f.get_tensor(name)
    return out


@dataclass
class VerifierHead:
    """The verifier tensors the draft reuses: embedding [V, H], final norm [H], lm_head [V, H]."""

    embed_tokens: Tensor
    norm: Tensor
    lm_head: Tensor


def _resolve(names: set[str], canonical: str) -> str | None:
    for prefix in PREFIXES:
        if prefix + canonical in names:
            return prefix + canonical
    return None


def read_verifier_head(verifier_dir: Path, dtype: torch.dtype | None = None) -> VerifierHead:
    """Embedding, final norm and lm_head (the embedding when lm_head is tied and absent)."""
    names = set(weight_map(verifier_dir))
    resolved = {c: _resolve(names, c) for c in (EMBED, NORM, LM_HEAD)}
    if resolved[EMBED] is None or resolved[NORM] is None:
        raise KeyError(f"{verifier_dir} has no {EMBED} / {NORM}")
    tensors = read_tensors(verifier_dir, [n for n in resolved.values() if n is not None])
    embed = tensors[resolved[EMBED]]
    lm_head = tensors[resolved[LM_HEAD]] if resolved[LM_HEAD] is not None else embed  # tied embeddings
    head = VerifierHead(embed, tensors[resolved[NORM]], lm_head)
    if dtype is not None:
        head = VerifierHead(*(t.to(dtype) for t in (head.embed_tokens, head.norm, head.lm_head)))
    return head


def read_token_ids(verifier_dir: Path) -> dict[str, int | list[int] | None]:
    """bos/eos/pad token ids from the verifier's config.json, as written there (None where absent)."""
    cfg = json.loads((Path(verifier_dir) / "config.json").read_text())
    # Multimodal configs keep them on the top level or in text_config.
    merged = cfg.get("text_config", {}) | {k: v for k, v in cfg.items() if k.endswith("_token_id")}
    return {key: merged.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
