"""Tests of model/checkpoint/: the vLLM draft folder contract and aux-id conventions."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from model.checkpoint import (
    DEEPSEEK_V3,
    KIMI_K3,
    TARGETS,
    draft_config_json,
    engine_captures,
    export_draft,
    export_size_bytes,
    init_from_draft,
    load_draft,
    misreading_engines,
    sglang_capture,
    tokenspeed_capture,
    tokenspeed_flag_ids,
    vllm_capture,
)
from model.aux_ids import sglang_to_vllm_aux_ids, to_vllm_aux_ids, vllm_to_sglang_aux_ids
from tests.conftest import plain_layer
from config import compose_draft_conf
from model.draft import DraftConfig, Eagle3Draft, build_draft
from model.verifier_handle import Verifier
from model.vocab import build_draft_vocab


@pytest.fixture(scope="module")
def tiny_cfg(draft_verifier_dir: Path) -> DraftConfig:
    return plain_layer(DraftConfig.from_conf(compose_draft_conf("kimi_tiny"), Verifier.open(draft_verifier_dir)))


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
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]                    # vLLM ids
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]    # SGLang ids
    assert cfg["target_model_type"] == "deepseek_v3"
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
    back = load_draft(tmp_path, verifier=Verifier.open(draft_verifier_dir))
    for name, tensor in draft.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor.to(torch.bfloat16).float()), name
    from model.verifier_weights import read_verifier_head

    assert torch.equal(back.embed_tokens, read_verifier_head(draft_verifier_dir).embed_tokens.float())


def test_a_third_party_draft_without_t2d_or_new_rope_keys_loads(tiny_cfg: DraftConfig, tmp_path: Path) -> None:
    """SpecForge-style files: legacy rope keys only, aux ids only in eagle_config (SGLang's), no t2d."""
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


# ---- one folder for vLLM, SGLang and TokenSpeed ---------------------------------------------
def _with_aux(cfg: DraftConfig, aux: tuple[int, ...], layers: int, target: str = DEEPSEEK_V3) -> DraftConfig:
    return dataclasses.replace(cfg, aux_layer_ids=aux, target_num_hidden_layers=layers, target_model_type=target)


def _rewrite_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


LAYOUTS = {"tiny": ((2, 4, 5), 8), "k2": ((2, 30, 58), 61), "k3": ((2, 46, 90), 93)}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_engine_captures_the_trained_layers_of_an_export(tiny_cfg: DraftConfig, layout: str,
                                                                target: str) -> None:
    aux, layers = LAYOUTS[layout]
    config = draft_config_json(_with_aux(tiny_cfg, aux, layers, target))
    captures = engine_captures(config)
    assert captures["vllm"] == captures["tokenspeed"] == aux
    # SGLang 0.5.23 serves EAGLE-3 on DeepSeek-V3 targets only.
    assert captures["sglang"] == (aux if target == DEEPSEEK_V3 else None)
    assert config["eagle_aux_hidden_state_layer_ids"] == list(aux)
    expected = vllm_to_sglang_aux_ids(aux, layers) if target == DEEPSEEK_V3 else list(aux)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == expected


def test_engine_rules_state_each_engines_reading() -> None:
    """The rules on the folders that tell them apart (model/checkpoint/ cites the sources)."""
    key = "eagle_aux_hidden_state_layer_ids"
    both_vllm = {key: [2, 4, 5], "eagle_config": {key: [2, 4, 5]}}
    sglang_only = {"eagle_config": {key: [1, 3, 4]}}
    top_only = {key: [3, 4, 5]}
    # vLLM: top level first, else eagle_config, as they are.
    assert vllm_capture(both_vllm, DEEPSEEK_V3, 8) == (2, 4, 5)
    assert vllm_capture(sglang_only, DEEPSEEK_V3, 8) == (1, 3, 4)
    assert vllm_capture({}, KIMI_K3, 93) == (2, 46, 90)
    # SGLang: eagle_config only; +1 only when the first id is 1; no EAGLE-3 on Kimi-K3.
    assert sglang_capture(sglang_only, DEEPSEEK_V3, 8) == (2, 4, 5)
    assert sglang_capture(both_vllm, DEEPSEEK_V3, 8) == (2, 4, 5)
    assert sglang_capture({"eagle_config": {key: [2, 3, 4]}}, DEEPSEEK_V3, 8) == (2, 3, 4)
    assert sglang_capture(top_only, DEEPSEEK_V3, 8) == (2, 4, 5)                  # its default, not the key
    assert sglang_capture(sglang_only, KIMI_K3, 8) is None
    # TokenSpeed: eagle_config before the top level; DeepSeek-V3 +1, Kimi-K3 as they are.
    assert tokenspeed_capture(both_vllm, DEEPSEEK_V3, 8) == (3, 5, 6)
    assert tokenspeed_capture(both_vllm, KIMI_K3, 8) == (2, 4, 5)
    assert tokenspeed_capture(top_only, DEEPSEEK_V3, 8) == (4, 5, 6)
    assert tokenspeed_capture({"text_config": sglang_only}, DEEPSEEK_V3, 8) == (2, 4, 5)
    assert tokenspeed_capture({"eagle_config": {key: [4, 2, 5]}}, KIMI_K3, 8) == ()   # K3 wants them ascending


def test_ids_no_folder_serves_everywhere_are_exported_with_a_warning(tiny_cfg: DraftConfig, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """First id 3 on a DeepSeek-V3 target: SGLang adds 1 only to lists starting at 1, TokenSpeed always."""
    draft = _draft(_with_aux(tiny_cfg, (3, 4, 5), 8))
    with caplog.at_level("WARNING", logger="model.checkpoint"):
        export_draft(draft, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert misreading_engines(cfg, (3, 4, 5)) == {"sglang": (2, 3, 4)}
    assert "sglang would capture [2, 3, 4]" in caplog.text
    assert tokenspeed_flag_ids([3, 4, 5], DEEPSEEK_V3, 8) == [2, 3, 4]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("vocab", [None, 2048], ids=["full", "pruned"])
def test_export_import_reexport_is_identical(tiny_cfg: DraftConfig, tmp_path: Path, target: str,
                                             vocab: int | None, draft_verifier_dir: Path) -> None:
    draft = _draft(_with_aux(tiny_cfg, *LAYOUTS["k3" if target == KIMI_K3 else "tiny"], target), draft_vocab_size=vocab)
    first, second = tmp_path / "first", tmp_path / "second"
    export_draft(draft, first, verifier=Verifier.open(draft_verifier_dir))      # Kimi-K3 folders carry the embedding
    assert ("embed_tokens.weight" in _tensors(first)) == (target == KIMI_K3)
    back = load_draft(first)
    assert back.config == draft.config
    export_draft(back, second)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    a, b = (json.loads((d / "config.json").read_text()) for d in (first, second))
    for key in ("eagle_aux_hidden_state_layer_ids", "target_model_type"):
        assert a[key] == b[key], key
    assert a["eagle_config"] == b["eagle_config"]
    assert a == b


# TorchSpec's and SGLang's own folders (eagle_config ids only, layers.0.* or midlayer.*, no
# max_position_embeddings): tests/test_published_drafts.py, on tools/published_drafts.py's fixtures.


def test_disagreeing_aux_ids_are_refused_and_old_exports_still_load(tiny_cfg: DraftConfig, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    export_draft(_draft(tiny_cfg), tmp_path)
    with caplog.at_level("WARNING", logger="model.checkpoint"):
        load_draft(tmp_path)
    assert caplog.text == ""                                # a new export: every engine reads it right

    def nested(ids: list[int]):
        def edit(cfg: dict) -> None:
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
            cfg.pop("target_model_type", None)
        return edit

    _rewrite_config(tmp_path, nested([0, 3, 4]))
    with pytest.raises(ValueError, match=r"config\.json: eagle_aux_hidden_state_layer_ids \[2, 4, 5\] and "
                                         r"eagle_config\.eagle_aux_hidden_state_layer_ids \[0, 3, 4\]") as err:
        load_draft(tmp_path)
    assert str(tmp_path) in str(err.value)
    _rewrite_config(tmp_path, nested([2, 4, 5]))            # this project's exports before both conventions
    with caplog.at_level("WARNING", logger="model.checkpoint"):
        assert load_draft(tmp_path).config.aux_layer_ids == (2, 4, 5)
    assert "tokenspeed would feed the draft the layers entering [3, 5, 6]" in caplog.text


# ---- train.init_from --------------------------------------------------------------------------
def test_init_from_loads_the_exported_weights_exactly(tiny_cfg: DraftConfig, tmp_path: Path) -> None:
    published = _draft(tiny_cfg, draft_vocab_size=2048)
    export_draft(published, tmp_path)
    torch.manual_seed(1)
    draft = build_draft(published.config)
    draft.set_vocab(published.d2t)
    init_from_draft(draft, tmp_path)
    for name, tensor in published.state_dict().items():
        expected = tensor.to(torch.bfloat16).float() if tensor.is_floating_point() else tensor
        assert torch.equal(draft.state_dict()[name], expected), name


@pytest.mark.parametrize("field,change", [
    ("intermediate_size", {"intermediate_size": 512}),
    ("draft_vocab_size", {"draft_vocab_size": 1024}),
    ("aux_layer_ids", {"aux_layer_ids": (1, 4, 5)}),
    ("d2t", {}),
], ids=["shape", "vocab_size", "aux", "d2t"])
def test_init_from_refuses_another_draft(tiny_cfg: DraftConfig, tmp_path: Path, field: str, change: dict) -> None:
    export_draft(_draft(tiny_cfg, draft_vocab_size=2048), tmp_path)
    draft = build_draft(dataclasses.replace(tiny_cfg, **{"draft_vocab_size": 2048, **change}))
    counts = torch.randint(0, 1000, (tiny_cfg.vocab_size,), generator=torch.Generator().manual_seed(2))
    draft.set_vocab(build_draft_vocab(counts, draft.config.draft_vocab_size)[0])       # another vocabulary
    with pytest.raises(ValueError, match=rf"{tmp_path} cannot start this draft: (.*; )?{field}"):
        init_from_draft(draft, tmp_path)


def test_train_init_from_starts_the_run_from_the_folder_unless_it_resumes(tiny_cfg: DraftConfig, tmp_path: Path,
                                                                          draft_verifier_dir: Path) -> None:
    from config import compose_config
    from train.loop import RunSetup, build_objective

    published = _draft(tiny_cfg)                            # seed 0; the run initialises with seed 7
    export_draft(published, tmp_path, dtype=torch.float32)
    cfg = compose_config("train", [f"verifier.path={draft_verifier_dir}", f"train.init_from={tmp_path}", "seed=7"])
    setup = RunSetup(tiny_cfg, None, Verifier.open(draft_verifier_dir), None, 1, 1)
    started = build_objective(setup, cfg).draft.state_dict()
    resumed = build_objective(setup, cfg, resuming=True).draft.state_dict()
    assert all(torch.equal(started[k], v) for k, v in published.state_dict().items())
    assert not torch.equal(resumed["fc.weight"], published.fc.weight)
