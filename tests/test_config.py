"""Hydra composition of the entry configs, with every verifier and data source."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from model.config import compose_config


@pytest.mark.parametrize("entry", ["build_verifier", "dump", "train"])
def test_entry_configs_compose(entry: str) -> None:
    cfg = compose_config(entry)
    assert cfg.verifier.name == "kimi-tiny"
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


@pytest.mark.parametrize("verifier,layers", [("kimi_tiny", 8), ("kimi_k2", 61), ("kimi_k3", 93)])
def test_verifiers_use_vllm_default_aux_layers(verifier: str, layers: int) -> None:
    v = compose_config("dump", [f"verifier={verifier}"]).verifier
    assert v.architecture.num_hidden_layers == layers
    assert v.aux_convention == "vllm"
    assert list(v.aux_layer_ids) == [2, layers // 2, layers - 3]
    # The CPU MLA backend and every Kimi model share these two dimensions.
    assert v.architecture.kv_lora_rank == 512 and v.architecture.qk_rope_head_dim == 64


def test_real_kimi_verifiers_need_a_checkpoint_path() -> None:
    cfg = compose_config("dump", ["verifier=kimi_k2"])
    assert OmegaConf.is_missing(cfg.verifier, "path")
    cfg = compose_config("dump", ["verifier=kimi_k2", "verifier.path=/ckpt/Kimi-K2"])
    assert cfg.verifier.path == "/ckpt/Kimi-K2"
    assert cfg.verifier.architecture.vocab_size == 163840


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
