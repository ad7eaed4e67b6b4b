"""A draft folder's weights both ways: the exported tensors and their names (`export_tensors`,
`export_draft`), and a folder read back as a draft (`load_draft`, `read_folder_config`).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from model.draft import DraftConfig, Eagle3Draft
from model.vocab import t2d_from_d2t
from model.checkpoint.names import CONFIG_FILE, EMBED, WEIGHTS_FILE
from model.checkpoint.engine_rules import (ENGINE_VERSIONS, engine_captures, engine_load_problems,
                                           misreading_engines, needs_embedding, our_name)
from model.checkpoint.config_json import draft_config_from_json, draft_config_json

if TYPE_CHECKING:
    from model.verifier_handle import Verifier

logger = logging.getLogger(__name__)


def export_tensors(draft: Eagle3Draft, dtype: torch.dtype = torch.bfloat16,
                   verifier: Verifier | None = None) -> dict[str, Tensor]:
    """Checkpoint name -> tensor. The module names already are vLLM's, so this casts, and adds
    the verifier's embedding where `needs_embedding`."""
    out: dict[str, Tensor] = {}
    for name, tensor in draft.exported_state().items():
        # d2t (int64) and t2d (bool) keep their dtypes; float weights take the export dtype.
        t = tensor.to(dtype) if tensor.is_floating_point() else tensor
        out[name] = t.detach().cpu().contiguous()
    if needs_embedding(draft.config.target_model_type):
        out[EMBED] = _verifier_embedding(draft, verifier).to(dtype).cpu().contiguous()
    return out


def _verifier_embedding(draft: Eagle3Draft, verifier: Verifier | None) -> Tensor:
    """The draft's copy of the verifier's embedding, else the verifier's own; never zeros (a
    draft rebuilt from a training state has not loaded it)."""
    if draft.embed_tokens.device.type != "meta" and torch.count_nonzero(draft.embed_tokens) > 0:
        return draft.embed_tokens.detach()
    if verifier is None:
        raise ValueError(f"a {draft.config.target_model_type} draft folder carries {EMBED} (TokenSpeed cannot "
                         "share the target's), but this draft has not loaded the verifier's embedding: pass "
                         "verifier or call load_verifier_embedding first")
    return verifier.embedding()


def export_size_bytes(draft: Eagle3Draft, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of tensor data in model.safetensors (works for a draft on the meta device)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0
    for tensor in draft.exported_state().values():
        total += tensor.numel() * (itemsize if tensor.is_floating_point() else tensor.element_size())
    if needs_embedding(draft.config.target_model_type):
        total += draft.embed_tokens.numel() * itemsize
    return total


def export_draft(draft: Eagle3Draft, out_dir: Path, dtype: torch.dtype = torch.bfloat16,
                 verifier: Verifier | None = None) -> Path:
    """Write config.json + model.safetensors; returns out_dir. The draft's target_model_type
    (DEEPSEEK_V3 | KIMI_K3) decides what SGLang and TokenSpeed read, and whether the folder
    carries the embedding (from the draft, else from `verifier`). Warns of every engine that
    would not serve the folder as trained (aux layers, loader, switches)."""
    out_dir = Path(out_dir)
    config = draft_config_json(draft.config, dtype)
    tensors = export_tensors(draft, dtype, verifier)
    for engine, got in misreading_engines(config, draft.config.aux_layer_ids).items():
        logger.warning("%s: no config.json serves aux layers %s on every engine: %s would capture %s",
                       out_dir, list(draft.config.aux_layer_ids), engine, list(got))
    serving = {engine for engine, got in engine_captures(config).items() if got is not None}
    for engine, problems in engine_load_problems(config, tensors, draft.config).items():
        for problem in problems if engine in serving else []:
            logger.warning("%s: %s %s", out_dir, ENGINE_VERSIONS[engine], problem)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir


def stored_names(path: Path) -> list[str]:
    """The tensor names of a folder's model.safetensors (its header only)."""
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
        return list(f.keys())


def read_folder_config(path: Path) -> DraftConfig:
    """The DraftConfig of a draft folder, read with its tensor names (see aux_ids_from_json)."""
    path = Path(path)
    return draft_config_from_json(json.loads((path / CONFIG_FILE).read_text()), path / CONFIG_FILE,
                                  stored_names(path))


def read_tensors(path: Path) -> dict[str, Tensor]:
    """model.safetensors under our names (TorchSpec's exports call midlayer "layers.0")."""
    tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    return {our_name(k): v for k, v in tensors.items()}


def load_draft(
    path: Path,
    verifier: Verifier | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Eagle3Draft:
    """An exported draft back as Eagle3Draft (weights exactly as stored, cast to `dtype`).

    The embedding: a stored `embed_tokens.weight` (Kimi-K3 folders, other tools) when present,
    else the verifier's when `verifier` is given, else zeros.
    """
    path = Path(path)
    cfg = read_folder_config(path)
    tensors = read_tensors(path)
    embed = tensors.pop(EMBED, None)
    if cfg.pruned and "t2d" not in tensors:
        tensors["t2d"] = t2d_from_d2t(tensors["d2t"], cfg.vocab_size)
    with torch.device(device):
        draft = Eagle3Draft(cfg)
    draft.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, strict=True)
    draft.to(dtype)
    if embed is not None:
        draft.embed_tokens.copy_(embed)
    elif verifier is not None:
        draft.load_verifier_embedding(verifier)
    return draft
