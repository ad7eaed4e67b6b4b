"""Read single verifier tensors by name from its safetensors files, nothing else.

A Kimi verifier is ~1T parameters: the draft needs only its embedding, final norm and lm_head,
so they are read one by one with `safe_open` (single model.safetensors or sharded with
model.safetensors.index.json); no other tensor is ever loaded. Their names depend on the
checkpoint's layout (LAYOUTS): Kimi-K3 keeps them under `language_model.`.
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


@dataclass(frozen=True)
class HeadNames:
    """Where one checkpoint layout keeps the embedding, the final norm and lm_head."""

    embed_tokens: str
    norm: str
    lm_head: str


# A causal LM (DeepSeek-V3, Kimi-K2, kimi-tiny), and a multimodal wrapper whose text tower sits
# under `language_model.` (Kimi-K2.5, Kimi-K3: vLLM's KimiK3ForConditionalGeneration loads its
# language_model.model.{embed_tokens,norm} and language_model.lm_head unrenamed). One layout is
# chosen for all three, so a head is never assembled from two models' tensors.
LAYOUTS = (HeadNames(EMBED, NORM, LM_HEAD),
           HeadNames("language_model." + EMBED, "language_model." + NORM, "language_model." + LM_HEAD))

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


def head_names(verifier_dir: Path) -> HeadNames:
    """The layout of LAYOUTS whose embedding and final norm the verifier's weights hold."""
    return _layout_of(set(weight_map(verifier_dir)), verifier_dir)


def _layout_of(names: set[str], verifier_dir: Path) -> HeadNames:
    found = [layout for layout in LAYOUTS if {layout.embed_tokens, layout.norm} <= names]
    if len(found) != 1:
        tried = "; ".join(f"{layout.embed_tokens} + {layout.norm}" for layout in LAYOUTS)
        what = "holds more than one of" if found else "has none of"
        raise KeyError(f"{verifier_dir} {what} the embedding + final norm layouts ({tried})")
    return found[0]


def read_verifier_embedding(verifier_dir: Path) -> Tensor:
    """The embedding [V, H] alone, as stored, under the verifier's layout."""
    name = head_names(verifier_dir).embed_tokens
    return read_tensors(verifier_dir, [name])[name]


def read_verifier_head(verifier_dir: Path, dtype: torch.dtype | None = None) -> VerifierHead:
    """Embedding, final norm and lm_head (the embedding when lm_head is tied and absent)."""
    names = set(weight_map(verifier_dir))
    layout = _layout_of(names, verifier_dir)
    tied = layout.lm_head not in names
    wanted = [layout.embed_tokens, layout.norm] + ([] if tied else [layout.lm_head])
    tensors = read_tensors(verifier_dir, wanted)
    embed = tensors[layout.embed_tokens]
    head = VerifierHead(embed, tensors[layout.norm], embed if tied else tensors[layout.lm_head])
    if dtype is not None:
        head = VerifierHead(*(t.to(dtype) for t in (head.embed_tokens, head.norm, head.lm_head)))
    return head


def read_token_ids(verifier_dir: Path) -> dict[str, int | list[int] | None]:
    """bos/eos/pad token ids from the verifier's config.json, as written there (None where absent)."""
    cfg = json.loads((Path(verifier_dir) / "config.json").read_text())
    # Multimodal configs keep them on the top level or in text_config.
    merged = cfg.get("text_config", {}) | {k: v for k, v in cfg.items() if k.endswith("_token_id")}
    return {key: merged.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
