"""THE draft checkpoint contract: vLLM's Eagle3DeepseekV2ForCausalLM folder, both ways.

A draft folder holds config.json + model.safetensors, read by
vllm/model_executor/models/deepseek_eagle3.py (vLLM 0.32) like this:

- config.json is parsed by transformers' DeepseekV2Config (model_type "deepseek_v2"; with
  "deepseek_v3" vLLM turns the draft into an MTP model). vLLM reads q_lora_rank with hasattr,
  and DeepseekV2Config defaults it to 1536, so it is always written (null = q_proj).
- RoPE: vLLM 0.32 / transformers 5 read `rope_parameters`; older readers (transformers 4,
  SGLang) read `rope_scaling` + `rope_theta`. Both are written with the same values. vLLM
  builds "deepseek_yarn" from them (always interleaved for MLA) and, since no
  `attention_factor` is written, applies the mscale^2 softmax correction like the verifier.
- aux layers: `eagle_aux_hidden_state_layer_ids` top level (the worker reads it first) and in
  `eagle_config` (the draft model sizes fc from there, else assumes 3), vLLM convention.
- draft_vocab_size always; vocab_size = target vocabulary; target_hidden_size.
- Weights without a "model." prefix: fc, midlayer.*, norm, lm_head (vLLM's loader prefixes and
  renames them); d2t only with a pruned vocabulary (vLLM scatters logits to i + d2t[i]); t2d
  with it (vLLM skips t2d, it documents the vocabulary for other readers); no embed_tokens
  (vLLM then shares the target's embedding).

Aux-layer conventions (facts section 3) are converted here and only here.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from model.draft import DraftConfig, Eagle3Draft, layer_shapes
from model.vocab import t2d_from_d2t

ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
MODEL_TYPE = "deepseek_v2"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


# ---- aux-layer id conventions -----------------------------------------------------------
# vLLM / speculators: id k = hidden state entering layer k (HF output_hidden_states[k]),
#   0 = embedding output, N = last layer's output (pre-norm residual).
# SGLang / SpecForge: id k = output of layer k, 0..N-1. Same layer: vllm = sglang + 1.

def sglang_to_vllm_aux_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """SGLang ids (layer outputs, 0..N-1) -> vLLM ids (layer inputs, 1..N)."""
    if any(not 0 <= i < num_layers for i in ids):
        raise ValueError(f"SGLang aux ids {list(ids)} outside 0..{num_layers - 1}")
    return [i + 1 for i in ids]


def vllm_to_sglang_aux_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """vLLM ids (layer inputs, 1..N) -> SGLang ids (layer outputs, 0..N-1); 0 (embeddings) has none."""
    if any(not 1 <= i <= num_layers for i in ids):
        raise ValueError(f"vLLM aux ids {list(ids)} outside 1..{num_layers} (SGLang cannot name the embedding output)")
    return [i - 1 for i in ids]


def to_vllm_aux_ids(ids: Sequence[int], convention: str, num_layers: int) -> list[int]:
    """Aux ids given in `convention` ("vllm" | "sglang") as vLLM ids."""
    if convention == "vllm":
        if any(not 0 <= i <= num_layers for i in ids):
            raise ValueError(f"vLLM aux ids {list(ids)} outside 0..{num_layers}")
        return list(ids)
    if convention == "sglang":
        return sglang_to_vllm_aux_ids(ids, num_layers)
    raise ValueError(f"unknown aux-id convention {convention!r} (vllm | sglang)")


# ---- config.json ------------------------------------------------------------------------
def draft_config_json(cfg: DraftConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The config.json vLLM's Eagle3DeepseekV2ForCausalLM reads."""
    rope_parameters = dict(cfg.rope_parameters)
    rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    if rope_scaling.get("rope_type", "default") != "default":
        rope_scaling["type"] = rope_scaling["rope_type"]   # transformers-4 readers look for "type"
    aux = list(cfg.aux_layer_ids)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "attention_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_interleave": cfg.rope_interleave,
        "rope_theta": rope_parameters["rope_theta"],
        "rope_scaling": rope_scaling if rope_scaling.get("rope_type", "default") != "default" else None,
        "rope_parameters": rope_parameters,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "target_num_hidden_layers": cfg.target_num_hidden_layers,
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        "tie_word_embeddings": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def draft_config_from_json(d: dict[str, Any]) -> DraftConfig:
    """Inverse of `draft_config_json` (also reads drafts that only carry the legacy rope keys)."""
    if d.get("architectures") != [ARCHITECTURE]:
        raise ValueError(f"not an {ARCHITECTURE} checkpoint: {d.get('architectures')}")
    rope_parameters = d.get("rope_parameters")
    if not rope_parameters:  # legacy form: rope_scaling (with "type" or "rope_type") + rope_theta
        legacy = dict(d.get("rope_scaling") or {})
        rope_type = legacy.pop("rope_type", None) or legacy.get("type") or "default"
        legacy.pop("type", None)
        rope_parameters = {"rope_type": rope_type, **legacy, "rope_theta": d["rope_theta"]}
    aux = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError("the checkpoint names no eagle_aux_hidden_state_layer_ids")
    return DraftConfig(
        **layer_shapes(d),
        rope_parameters=dict(rope_parameters),
        rope_interleave=d.get("rope_interleave", True),   # vLLM's MLA always rotates interleaved
        vocab_size=d["vocab_size"],
        draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
        target_hidden_size=d.get("target_hidden_size", d["hidden_size"]),
        # Unknown for third-party drafts: the smallest layer count the ids allow.
        target_num_hidden_layers=d.get("target_num_hidden_layers", max(aux)),
        aux_layer_ids=tuple(aux),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
    )


# ---- weights ----------------------------------------------------------------------------
def export_tensors(draft: Eagle3Draft, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
    """Checkpoint name -> tensor. The module names already are vLLM's, so this only casts."""
    out: dict[str, Tensor] = {}
    for name, tensor in draft.state_dict().items():
        # d2t (int64) and t2d (bool) keep their dtypes; float weights take the export dtype.
        t = tensor.to(dtype) if tensor.is_floating_point() else tensor
        out[name] = t.detach().cpu().contiguous()
    return out


def export_size_bytes(draft: Eagle3Draft, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of tensor data in model.safetensors (works for a draft on the meta device)."""
    total = 0
    for tensor in draft.state_dict().values():
        itemsize = torch.empty((), dtype=dtype).element_size() if tensor.is_floating_point() else tensor.element_size()
        total += tensor.numel() * itemsize
    return total


def export_draft(draft: Eagle3Draft, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors for vLLM; returns out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).write_text(json.dumps(draft_config_json(draft.config, dtype), indent=2) + "\n")
    save_file(export_tensors(draft, dtype), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir


def load_draft(
    path: Path,
    verifier_dir: Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Eagle3Draft:
    """An exported draft back as Eagle3Draft (weights exactly as stored, cast to `dtype`).

    The embedding is not in the checkpoint: pass `verifier_dir` to read it from the verifier
    (else it stays zeros). A stored `embed_tokens.weight` (other tools) is used when present.
    """
    path = Path(path)
    cfg = draft_config_from_json(json.loads((path / CONFIG_FILE).read_text()))
    tensors = load_file(str(path / WEIGHTS_FILE))
    embed = tensors.pop("embed_tokens.weight", None)
    if cfg.pruned and "t2d" not in tensors:
        tensors["t2d"] = t2d_from_d2t(tensors["d2t"], cfg.vocab_size)
    with torch.device(device):
        draft = Eagle3Draft(cfg)
    draft.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, strict=True)
    draft.to(dtype)
    if embed is not None:
        draft.embed_tokens.copy_(embed)
    elif verifier_dir is not None:
        draft.load_verifier_embedding(verifier_dir)
    return draft
