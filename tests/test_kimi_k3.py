"""Kimi-K3 as a verifier without its weights: the head read from a checkpoint laid out like K3's,
and the exported draft config against the published K3 EAGLE-3 MLA draft."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from config import compose_config
from model.aux_ids import vllm_to_sglang_aux_ids
from model.checkpoint import draft_config_json
from model.draft import DraftConfig
from model.verifier_weights import (head_names, read_token_ids, read_verifier_embedding,
                                    read_verifier_head)
from store import verifier_identity

V, H = 16, 8


def _k3_checkpoint(folder: Path, with_lm_head: bool = True) -> dict[str, torch.Tensor]:
    """config.json (KimiK3Config: the text tower in text_config), tokenizer_config.json and two
    safetensors files with an index, the text tower's tensors under language_model.* next to
    vision and projector tensors, as vLLM's KimiK3ForConditionalGeneration loads them."""
    g = torch.Generator().manual_seed(3)
    first = {
        "language_model.model.embed_tokens.weight": torch.randn(V, H, generator=g).bfloat16(),
        "language_model.model.layers.0.self_attn.q_proj.weight": torch.randn(H, H, generator=g),
        "vision_tower.encoder.blocks.0.attn.wqkv.weight": torch.randn(3 * H, H, generator=g),
        "mm_projector.proj.0.weight": torch.randn(H, H, generator=g),
    }
    second = {
        "language_model.model.norm.weight": torch.randn(H, generator=g).bfloat16(),
        "language_model.model.output_attn_res_norm.weight": torch.randn(H, generator=g).bfloat16(),
        "language_model.model.layers.1.mlp.experts.0.w1.weight": torch.randn(H, H, generator=g),
    }
    if with_lm_head:
        second["language_model.lm_head.weight"] = torch.randn(V, H, generator=g).bfloat16()
    files = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    for name, tensors in files.items():
        save_file(tensors, str(folder / name))
    weight_map = {tensor: name for name, tensors in files.items() for tensor in tensors}
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    text = {"model_type": "kimi_linear", "hidden_size": H, "vocab_size": V, "num_hidden_layers": 2,
            "bos_token_id": 11, "eos_token_id": 12, "mla_use_nope": True, "attn_res_block_size": 1}
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "text_config": text, "vision_config": {}, "pad_token_id": 0}))
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return first | second


def test_head_is_read_from_k3_names(tmp_path: Path) -> None:
    tensors = _k3_checkpoint(tmp_path)
    assert head_names(tmp_path).norm == "language_model.model.norm.weight"
    head = read_verifier_head(tmp_path)
    assert torch.equal(head.embed_tokens, tensors["language_model.model.embed_tokens.weight"])
    assert torch.equal(head.norm, tensors["language_model.model.norm.weight"])
    assert torch.equal(head.lm_head, tensors["language_model.lm_head.weight"])
    assert head.lm_head.dtype == torch.bfloat16                    # as stored
    assert torch.equal(read_verifier_head(tmp_path, torch.float32).norm,
                       tensors["language_model.model.norm.weight"].float())
    assert torch.equal(read_verifier_embedding(tmp_path), tensors["language_model.model.embed_tokens.weight"])
    # The text tower's config sits in text_config: ids and the store identity read it there.
    assert read_token_ids(tmp_path) == {"bos_token_id": 11, "eos_token_id": 12, "pad_token_id": 0}
    identity = verifier_identity(tmp_path, "kimi-k3")
    assert (identity["hidden_size"], identity["vocab_size"], identity["num_hidden_layers"]) == (H, V, 2)


def test_k3_without_lm_head_ties_it_to_the_embedding(tmp_path: Path) -> None:
    tensors = _k3_checkpoint(tmp_path, with_lm_head=False)
    head = read_verifier_head(tmp_path)
    assert torch.equal(head.lm_head, tensors["language_model.model.embed_tokens.weight"])


def test_a_head_is_never_assembled_from_two_layouts(tmp_path: Path) -> None:
    _k3_checkpoint(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    save_file({"model.embed_tokens.weight": torch.zeros(V, H), "model.norm.weight": torch.ones(H)},
              str(tmp_path / "extra.safetensors"))
    raw["weight_map"] |= {"model.embed_tokens.weight": "extra.safetensors",
                          "model.norm.weight": "extra.safetensors"}
    index.write_text(json.dumps(raw))
    with pytest.raises(KeyError, match="more than one"):
        read_verifier_head(tmp_path)
    del raw["weight_map"]["language_model.model.norm.weight"], raw["weight_map"]["model.norm.weight"]
    index.write_text(json.dumps(raw))
    with pytest.raises(KeyError, match="has none of"):
        read_verifier_head(tmp_path)


# TorchSpec configs/draft_models/kimi_k3_eagle3_mla.json, the keys vLLM's
# Eagle3DeepseekV2ForCausalLM reads from it.
PUBLISHED_K3_DRAFT = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"],
    "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 1,
    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "hidden_act": "silu",
    "rms_norm_eps": 1e-05, "vocab_size": 163840, "draft_vocab_size": 163840, "rope_theta": 50000.0,
    "max_position_embeddings": 1048576,
}
PUBLISHED_K3_ROPE_SCALING = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32768,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
PUBLISHED_K3_SGLANG_AUX = [1, 45, 89]


def test_exported_k3_draft_config_matches_the_published_draft() -> None:
    cfg = compose_config("train", ["verifier=kimi_k3", "draft=kimi_k3", "verifier.path=/x"])
    exported = draft_config_json(DraftConfig.from_conf(cfg.draft))
    assert {k: exported[k] for k in PUBLISHED_K3_DRAFT} == PUBLISHED_K3_DRAFT
    assert {k: exported["rope_scaling"][k] for k in PUBLISHED_K3_ROPE_SCALING} == PUBLISHED_K3_ROPE_SCALING
    assert vllm_to_sglang_aux_ids(exported["eagle_aux_hidden_state_layer_ids"], 93) == PUBLISHED_K3_SGLANG_AUX
    assert exported["target_hidden_size"] == 7168 and exported["target_num_hidden_layers"] == 93
