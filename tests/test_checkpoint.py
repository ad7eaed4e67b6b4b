"""Tests of model/checkpoint.py: the vLLM draft folder contract and aux-id conventions."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from model.checkpoint import (
    export_draft,
    export_size_bytes,
    load_draft,
    sglang_to_vllm_aux_ids,
    to_vllm_aux_ids,
    vllm_to_sglang_aux_ids,
)
from model.draft import DraftConfig, Eagle3Draft, build_draft, compose_draft_conf
from model.vocab import build_draft_vocab


@pytest.fixture(scope="module")
def tiny_cfg(draft_verifier_dir: Path) -> DraftConfig:
    return DraftConfig.from_conf(compose_draft_conf("kimi_tiny"), draft_verifier_dir)


def _draft(cfg: DraftConfig, draft_vocab_size: int | None = None, q_lora_rank: int | None | str = "keep") -> Eagle3Draft:
    if draft_vocab_size is not None:
        cfg = dataclasses.replace(cfg, draft_vocab_size=draft_vocab_size)
    if q_lora_rank != "keep":
        cfg = dataclasses.replace(cfg, q_lora_rank=q_lora_rank)
    torch.manual_seed(0)
    draft = build_draft(cfg)
    if cfg.pruned:
        counts = torch.randint(0, 1000, (cfg.vocab_size,), generator=torch.Generator().manual_seed(1))
        draft.set_vocab(build_draft_vocab(counts, cfg.draft_vocab_size)[0])
    return draft


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


# ---- aux ids ------------------------------------------------------------------------------
@pytest.mark.parametrize("layers,vllm,sglang", [(61, [2, 30, 58], [1, 29, 57]), (93, [2, 46, 90], [1, 45, 89]),
                                                (8, [2, 4, 5], [1, 3, 4])], ids=["k2", "k3", "tiny"])
def test_aux_ids_convert_both_ways(layers: int, vllm: list[int], sglang: list[int]) -> None:
    assert vllm_to_sglang_aux_ids(vllm, layers) == sglang
    assert sglang_to_vllm_aux_ids(sglang, layers) == vllm
    assert to_vllm_aux_ids(sglang, "sglang", layers) == vllm
    assert to_vllm_aux_ids(vllm, "vllm", layers) == vllm


def test_aux_ids_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError):
        vllm_to_sglang_aux_ids([0, 30, 58], 61)     # the embedding output has no SGLang id
    with pytest.raises(ValueError):
        sglang_to_vllm_aux_ids([1, 29, 61], 61)
    with pytest.raises(ValueError):
        to_vllm_aux_ids([2, 30, 62], "vllm", 61)
    with pytest.raises(ValueError):
        to_vllm_aux_ids([2, 30, 58], "eagle", 61)


# ---- export -------------------------------------------------------------------------------
def test_full_vocabulary_export_follows_the_vllm_contract(tiny_cfg: DraftConfig, tmp_path: Path) -> None:
    draft = _draft(tiny_cfg)
    export_draft(draft, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v2" and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == cfg["vocab_size"] == 8192
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["target_hidden_size"] == 256 and cfg["q_lora_rank"] == 128 and cfg["torch_dtype"] == "bfloat16"
    assert cfg["rope_parameters"] == tiny_cfg.rope_parameters
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] and cfg["rope_scaling"]["type"] == "yarn"
    tensors = _tensors(tmp_path)
    assert set(tensors) == {
        "fc.weight", "norm.weight", "lm_head.weight",
        "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
        "midlayer.self_attn.q_a_proj.weight", "midlayer.self_attn.q_a_layernorm.weight",
        "midlayer.self_attn.q_b_proj.weight", "midlayer.self_attn.kv_a_proj_with_mqa.weight",
        "midlayer.self_attn.kv_a_layernorm.weight", "midlayer.self_attn.kv_b_proj.weight",
        "midlayer.self_attn.o_proj.weight",
        "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    }
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert tensors["fc.weight"].shape == (256, 3 * 256)
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == export_size_bytes(draft)


def test_transformers_reads_the_config_as_vllm_will(tiny_cfg: DraftConfig, tmp_path: Path) -> None:
    from transformers import AutoConfig

    export_draft(_draft(tiny_cfg, q_lora_rank=None), tmp_path)
    hf = AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "DeepseekV2Config"
    assert hf.q_lora_rank is None                       # not DeepseekV2Config's default 1536
    assert hf.rope_parameters["rope_type"] == "yarn" and "attention_factor" not in hf.rope_parameters
    assert {k: hf.rope_parameters[k] for k in tiny_cfg.rope_parameters} == tiny_cfg.rope_parameters


@pytest.mark.parametrize("variant", ["full", "pruned", "q_proj"])
def test_fp32_round_trip_is_exact(tiny_cfg: DraftConfig, tmp_path: Path, variant: str) -> None:
    draft = _draft(tiny_cfg, draft_vocab_size=2048 if variant == "pruned" else None,
                   q_lora_rank=None if variant == "q_proj" else "keep")
    export_draft(draft, tmp_path, dtype=torch.float32)
    back = load_draft(tmp_path)
    assert back.config == draft.config
    assert back.state_dict().keys() == draft.state_dict().keys()
    for name, tensor in draft.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    tensors = _tensors(tmp_path)
    assert ("d2t" in tensors) == (variant == "pruned")
    if variant == "pruned":
        assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (2048,)
        assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 2048
        assert tensors["lm_head.weight"].shape == (2048, 256)


def test_bf16_export_loads_as_the_rounded_weights(tiny_cfg: DraftConfig, tmp_path: Path, draft_verifier_dir: Path) -> None:
    draft = _draft(tiny_cfg)
    export_draft(draft, tmp_path)
    back = load_draft(tmp_path, verifier_dir=draft_verifier_dir)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor.to(torch.bfloat16).float()), name
    from model.verifier_weights import read_verifier_head

    assert torch.equal(back.embed_tokens, read_verifier_head(draft_verifier_dir).embed_tokens.float())


def test_a_third_party_draft_without_t2d_or_new_rope_keys_loads(tiny_cfg: DraftConfig, tmp_path: Path) -> None:
    """SpecForge-style files: legacy rope keys only, aux ids only in eagle_config, no t2d."""
    draft = _draft(tiny_cfg, draft_vocab_size=1024)
    export_draft(draft, tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "eagle_aux_hidden_state_layer_ids"):
        del cfg[key]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file

    tensors = _tensors(tmp_path)
    del tensors["t2d"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    back = load_draft(tmp_path)
    assert back.config.rope_parameters == tiny_cfg.rope_parameters
    assert back.config.aux_layer_ids == (2, 4, 5)
    assert torch.equal(back.t2d, draft.t2d) and torch.equal(back.d2t, draft.d2t)
