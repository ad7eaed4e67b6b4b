"""Hydra composition of the entry configs, with every verifier and data source."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from config import ConfigError, compose_config


@pytest.mark.parametrize("entry", ["build_verifier", "dump", "train"])
def test_entry_configs_compose(entry: str) -> None:
    cfg = compose_config(entry)
    assert cfg.verifier.name == "kimi-tiny"
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


@pytest.mark.parametrize("verifier,layers", [("kimi_tiny", 8), ("kimi_k2", 61), ("kimi_k3", 93)])
def test_verifiers_use_vllm_default_aux_layers(verifier: str, layers: int) -> None:
    cfg = compose_config("train", [f"verifier={verifier}", f"draft={verifier}"])
    v = cfg.verifier
    assert v.architecture.num_hidden_layers == layers
    assert v.aux_convention == "vllm"
    assert list(v.aux_layer_ids) == [2, layers // 2, layers - 3]
    # vLLM's CPU MLA backend and every published Kimi MLA draft share these two dimensions.
    assert cfg.draft.kv_lora_rank == 512 and cfg.draft.qk_rope_head_dim == 64


@pytest.mark.parametrize("verifier,capture", [("kimi_tiny", "residual_stream"),
                                              ("kimi_k2", "residual_stream"),
                                              ("kimi_k3", "prefix_only")])
def test_aux_capture_of_each_verifier_reaches_its_draft(verifier: str, capture: str) -> None:
    from store import AUX_CAPTURES

    cfg = compose_config("train", [f"verifier={verifier}", f"draft={verifier}"])
    assert cfg.verifier.aux_capture == cfg.draft.aux_capture == capture
    assert capture in AUX_CAPTURES


# The published Kimi-K3 EAGLE-3 MLA draft (TorchSpec configs/draft_models/kimi_k3_eagle3_mla.json),
# in DraftConfig's terms: its SGLang aux ids [1, 45, 89] are vLLM's [2, 46, 90].
K3_DRAFT = {
    "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                        "original_max_position_embeddings": 32768, "beta_fast": 32.0,
                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rope_interleave": True, "vocab_size": 163840, "draft_vocab_size": 163840,
    "target_hidden_size": 7168, "target_num_hidden_layers": 93, "aux_layer_ids": (2, 46, 90),
}
# Kimi-K2's draft copies the verifier's MLA and dense MLP shapes and its RoPE (conf/verifier/kimi_k2).
K2_DRAFT = K3_DRAFT | {
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                        "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "target_num_hidden_layers": 61, "aux_layer_ids": (2, 30, 58),
}


@pytest.mark.parametrize("name,expected", [("kimi_k3", K3_DRAFT), ("kimi_k2", K2_DRAFT)])
def test_real_kimi_train_configs_resolve_to_the_published_draft(name: str, expected: dict) -> None:
    from dataclasses import asdict

    from model.draft import DraftConfig

    cfg = compose_config("train", [f"verifier={name}", f"draft={name}", "verifier.path=/x"])
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    draft = asdict(DraftConfig.from_conf(cfg.draft))
    assert {k: draft[k] for k in expected} == expected


def test_real_kimi_verifiers_need_a_checkpoint_path() -> None:
    cfg = compose_config("dump", ["verifier=kimi_k2"])
    assert OmegaConf.is_missing(cfg.verifier, "path")
    cfg = compose_config("dump", ["verifier=kimi_k2", "verifier.path=/ckpt/Kimi-K2"])
    assert cfg.verifier.path == "/ckpt/Kimi-K2"
    assert cfg.verifier.architecture.vocab_size == 163840


def test_kimi_k3_checkpoint_path_stays_mandatory() -> None:
    cfg = compose_config("train", ["verifier=kimi_k3", "draft=kimi_k3"])
    assert OmegaConf.is_missing(cfg.verifier, "path")
    assert cfg.verifier.architecture.hidden_size == 7168  # the rest needs no checkpoint


@pytest.mark.parametrize("data,category", [("sharegpt", "dialogue"), ("humaneval", "code"),
                                           ("jsonl", "dialogue")])
def test_data_sources_compose(data: str, category: str) -> None:
    cfg = compose_config("dump", [f"data={data}"])
    assert cfg.data.category == category
    assert cfg.data.on_error in ("raise", "skip")


def test_jsonl_data_requires_a_path() -> None:
    cfg = compose_config("dump", ["data=jsonl"])
    assert OmegaConf.is_missing(cfg.data, "path")
    cfg = compose_config("dump", ["data=jsonl", "data.path=/tmp/x.jsonl", "data.on_error=skip"])
    assert cfg.data.path == "/tmp/x.jsonl" and cfg.data.on_error == "skip"


@pytest.mark.parametrize("engine", ["cpu", "cuda"])
def test_engine_configs_compose(engine: str) -> None:
    from dump.engine import engine_kwargs

    kwargs = engine_kwargs(compose_config("dump", [f"engine={engine}"]).engine)
    assert kwargs["tensor_parallel_size"] >= 1
    assert ("compilation_config" in kwargs) == (engine == "cpu")


@pytest.mark.parametrize("draft_vocab,wanted", [(8192, "probabilistic"), (4096, "greedy")])
def test_auto_proposal_is_probabilistic_unless_the_vocabulary_is_pruned(tmp_path, draft_vocab: int,
                                                                        wanted: str) -> None:
    import json

    from evaluation.run import proposal_method

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8192, "draft_vocab_size": draft_vocab}))
    assert compose_config("eval", ["draft_dir=x"]).draft_sample == "auto"
    assert proposal_method("auto", tmp_path) == wanted
    assert proposal_method("greedy", tmp_path) == "greedy"
    with pytest.raises(ValueError, match="draft_sample"):
        proposal_method("typical", tmp_path)


@pytest.mark.parametrize(("stage", "override", "choices"), [
    ("dump", "regenerate.turns=every", "[all, first]"),
    ("dump", "split=test", "[train, heldout, all]"),
    ("dump", "over_long=cut", "[truncate, drop]"),
    ("dump", "data.on_error=warn", "[raise, skip]"),
    ("dump", "store.aux=int4", "[bf16, fp32, fp8, fp4]"),
    ("train", "train.loss.acceptance=kl", "[tv, lk, hybrid]"),
    ("train", "train.precision=fp16", "[auto, bf16, fp32]"),
    ("train", "verifier.aux_capture=mixed", "[residual_stream, prefix_only, attn_res_stream]"),
    ("plan", "train.export_dtype=int8", "[bfloat16, float16, float32]"),
    ("eval", "draft_sample=best", "[auto, greedy, probabilistic]"),
])
def test_a_choice_outside_its_type_is_refused_at_composition(stage: str, override: str, choices: str) -> None:
    """config/choices.py: OmegaConf refuses the value, naming the key and the values allowed."""
    with pytest.raises(ConfigError) as refused:
        compose_config(stage, [override])
    key = override.split("=")[0]
    assert key in str(refused.value) and choices in str(refused.value), str(refused.value)


@pytest.mark.parametrize(("stage", "overrides", "named"), [
    ("dump", ["max_len=0", "regenerate.top_p=0"], ["max_len=0 (at least 1)", "regenerate.top_p=0"]),
    ("dump", ["regenerate.sampled_share=1.5", "regenerate.sampled_temperature=0"],
     ["regenerate.sampled_share=1.5 (in [0, 1])", "regenerate.sampled_temperature=0"]),
    ("train", ["train.grad_accum=0", "train.checkpoint_every=-1", "train.warmup_ratio=0.1"],
     ["train.grad_accum=0 (at least 1)", "train.checkpoint_every=-1 (at least 0)",
      "train.warmup_steps=20 and train.warmup_ratio=0.1: set exactly one"]),
    ("train", ["train.loss.acceptance=tv", "train.loss.target_topk=8"], ["needs the verifier's whole distribution"]),
    ("train", ["train.aux_noise=-0.1", "train.init_from_verifier=-1"],
     ["train.aux_noise=-0.1", "train.init_from_verifier=-1"]),
    ("dump", ["heldout_set.max_tokens=0", "heldout_set.conversations=-2", "heldout_set.answer_tokens=0"],
     ["heldout_set.max_tokens=0 (at least 1)", "heldout_set.conversations=-2 (at least 0)",
      "heldout_set.answer_tokens=0 (at least 1)"]),
    ("eval", ["num_speculative_tokens=0", "num_prompts=0"],
     ["num_speculative_tokens=0 (at least 1)", "num_prompts=0 (at least 1)"]),
    ("train", ["verifier.aux_layer_ids=[2,4,9]"], ["verifier.aux_layer_ids=[2, 4, 9] (vllm convention: ids 0..8"]),
    ("dump", ["verifier.aux_layer_ids=[0,3,8]", "verifier.aux_convention=sglang"], ["(sglang convention: ids 0..7"]),
    ("eval", ["verifier.aux_layer_ids=[5,4,2]"], ["verifier.aux_layer_ids=[5, 4, 2] (distinct and ascending"]),
])
def test_rules_across_keys_are_refused_at_composition(stage: str, overrides: list[str], named: list[str]) -> None:
    """config/validate.py's rules run with the composition: every broken one named in one message."""
    with pytest.raises(ConfigError) as refused:
        compose_config(stage, overrides)
    for part in named:
        assert part in str(refused.value), str(refused.value)


@pytest.mark.parametrize(("override", "status", "named"), [
    ("regenerate.turns=every", 1, "expected one of [all, first]"),   # the type: Hydra's refusal
    ("regenerate.top_p=0", 2, "(in (0, 1])"),     # a rule: config.check_entry
])
def test_an_entry_point_refuses_before_any_work(tmp_path, override: str, status: int, named: str) -> None:
    """`python -m dump <override>`: refused with the key named, before data or an engine."""
    import subprocess
    import sys

    from infra import REPO_ROOT

    done = subprocess.run([sys.executable, "-m", "dump", override, f"output_dir={tmp_path / 'store'}",
                           f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == status, done.stderr[-2000:]
    assert override.split("=")[0] in done.stderr and named in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "store").exists()
