"""Read single verifier tensors by name from its safetensors files, nothing else.

A Kimi verifier is ~1T parameters: the draft needs only its embedding, final norm and lm_head,
so they are read one by one (single model.safetensors or sharded with
model.safetensors.index.json); no other tensor is ever loaded, and each file is opened once per
read (`read_head`: a single file's header and tensors in the same open). Their names depend on
the checkpoint's layout (LAYOUTS): Kimi-K3 keeps them under `language_model.`.

These readers go to disk on every call; model/verifier_handle.py's Verifier reads through them
once per process and shares what it read.

The head is mapped, not copied (`map_file`): each tensor is a view of its file's pages
(a private mapping: a write would copy the page, never change the file), so the ranks of one
machine that read the same verifier share one copy of a 2.35 GB Kimi embedding in the page cache,
and a process holds no second copy beside the file's.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
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
    return dict.fromkeys(map_file(single), SINGLE_FILE)


# safetensors' dtype names (the header's "dtype") as torch dtypes.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                      "F8_E5M2": torch.float8_e5m2}


def map_file(file: Path) -> dict[str, Tensor]:
    """Every tensor of one safetensors file as a view of its pages (a private mapping of the file:
    nothing is read until used, and what is read stays shared with the page cache)."""
    file = Path(file)
    pages = torch.from_file(str(file), shared=False, size=file.stat().st_size, dtype=torch.uint8)
    (header_len,) = struct.unpack("<Q", pages[:8].numpy().tobytes())
    header = json.loads(pages[8:8 + header_len].numpy().tobytes())
    start = 8 + header_len
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        raw = pages[start + begin:start + end]
        if (start + begin) % dtype.itemsize:          # not aligned for a view: a copy instead
            raw = raw.clone()
        out[name] = raw.view(dtype).view(entry["shape"])
    return out


def read_tensors(verifier_dir: Path, names: Iterable[str]) -> dict[str, Tensor]:
    """The named tensors, as stored (dtype kept), mapped from their files (`map_file`), each file once."""
    verifier_dir = Path(verifier_dir)
    where = weight_map(verifier_dir)
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name not in where:
            raise KeyError(f"{name} not in the verifier's weights ({verifier_dir})")
        by_file.setdefault(where[name], []).append(name)
    out: dict[str, Tensor] = {}
    for file, file_names in by_file.items():
        mapped = map_file(verifier_dir / file)
        out.update({name: mapped[name] for name in file_names})
    return out


@dataclass
class VerifierHead:
    """The verifier tensors the draft reuses: embedding [V, H], final norm [H], lm_head [V, H]."""

    embed_tokens: Tensor
    norm: Tensor
    lm_head: Tensor


# The parts of the head, as VerifierHead names them.
HEAD_PARTS = ("embed_tokens", "norm", "lm_head")


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


def _wanted(layout: HeadNames, names: set[str], parts: Iterable[str]) -> dict[str, str]:
    """Part -> tensor name; a tied lm_head (absent) is read as the embedding."""
    tied = layout.lm_head not in names
    where = {"embed_tokens": layout.embed_tokens, "norm": layout.norm,
             "lm_head": layout.embed_tokens if tied else layout.lm_head}
    unknown = set(parts) - set(where)
    if unknown:
        raise ValueError(f"unknown verifier head parts {sorted(unknown)} (use {HEAD_PARTS})")
    return {part: where[part] for part in parts}


def read_head(verifier_dir: Path, parts: Iterable[str] = HEAD_PARTS) -> dict[str, Tensor]:
    """The asked parts of HEAD_PARTS, as stored (dtype kept), mapped from their files."""
    verifier_dir = Path(verifier_dir)
    parts = list(parts)
    if (verifier_dir / INDEX_FILE).exists():
        where = weight_map(verifier_dir)
        wanted = _wanted(_layout_of(set(where), verifier_dir), set(where), parts)
        tensors = read_tensors(verifier_dir, set(wanted.values()))
        return {part: tensors[name] for part, name in wanted.items()}
    single = verifier_dir / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"no {INDEX_FILE} or {SINGLE_FILE} in {verifier_dir}")
    tensors = map_file(single)
    wanted = _wanted(_layout_of(set(tensors), verifier_dir), set(tensors), parts)
    return {part: tensors[name] for part, name in wanted.items()}


def read_verifier_embedding(verifier_dir: Path) -> Tensor:
    """The embedding [V, H] alone, as stored, under the verifier's layout."""
    return read_head(verifier_dir, ["embed_tokens"])["embed_tokens"]


def read_verifier_head(verifier_dir: Path, dtype: torch.dtype | None = None) -> VerifierHead:
    """Embedding, final norm and lm_head (the embedding when lm_head is tied and absent)."""
    tensors = read_head(verifier_dir)
    if dtype is not None:
        tensors = {part: t.to(dtype) for part, t in tensors.items()}
    return VerifierHead(**tensors)


def token_ids_of(config: Mapping[str, Any]) -> dict[str, int | list[int] | None]:
    """bos/eos/pad token ids of a verifier config.json, as written there (None where absent)."""
    # Multimodal configs keep them on the top level or in text_config.
    merged = config.get("text_config", {}) | {k: v for k, v in config.items() if k.endswith("_token_id")}
    return {key: merged.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}


def read_token_ids(verifier_dir: Path) -> dict[str, int | list[int] | None]:
    """bos/eos/pad token ids from the verifier's config.json, as written there (None where absent)."""
    return token_ids_of(json.loads((Path(verifier_dir) / "config.json").read_text()))
