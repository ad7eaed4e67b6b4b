"""Aux-layer id conventions, the one place ids are converted (a leaf module: it imports nothing
of the project).

- vLLM / TokenSpeed / speculators: id k = the hidden state entering layer k (HF
  output_hidden_states[k]); 0 = embedding output, N = last layer's output (pre-norm residual);
  defaults (2, N//2, N-3). The project uses these ids everywhere inside.
- SGLang / SpecForge / TorchSpec: id k = the output of layer k, 0..N-1; defaults
  [1, N//2-1, N-4]. Same layer: vllm = sglang + 1 (Kimi-K2 [2, 30, 58] == [1, 29, 57]; Kimi-K3
  [2, 46, 90] == [1, 45, 89]).
What each serving engine reads from an exported folder is model/checkpoint/'s business.
"""
from __future__ import annotations

from collections.abc import Sequence


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
