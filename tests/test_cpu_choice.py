"""What depends on the CPU: the MLA attention backend and dtype of a vLLM CPU engine
(dump/engine.py) and `train.precision: auto` (train/deepspeed_setup.py precision_of).

The choices are pure functions of the CPU's flags, tested here for CPUs with and without AMX and
bf16 units whatever this machine is; the last tests check that the configs as composed on this
machine reach vLLM's own config objects (EngineArgs -> VllmConfig, SpeculativeConfig) and its CPU
platform's backend selection with the chosen backend.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import infra
from dump.engine import attention_backend, cpu_attention_backend, engine_kwargs, vllm_cpu_mla_choice
from evaluation.speculative import speculative_config
from infra import parse_cpu_flags
from config import compose_config
from model.verifier_handle import Verifier
from train.deepspeed_setup import precision_of

# Flag sets as Linux prints them: a Sapphire Rapids Xeon (AMX), an AVX-512 BF16 CPU without AMX
# (Zen 4/5 EPYC), and one with neither (AVX2 only).
AMX = frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"})
AVX512_BF16 = frozenset({"avx512f", "avx512_bf16", "avx512_vnni"})
PLAIN = frozenset({"avx", "avx2", "fma"})


def test_cpu_flags_come_from_the_first_processor() -> None:
    text = "processor\t: 0\nflags\t\t: fpu avx2 amx_tile amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert parse_cpu_flags(text) == {"fpu", "avx2", "amx_tile", "amx_bf16"}
    assert parse_cpu_flags("processor : 0\n") == frozenset()
    assert isinstance(infra.cpu_flags(), frozenset) and infra.cpu_flags() is infra.cpu_flags()


@pytest.mark.parametrize("flags,dtype,wanted", [
    (AMX, "float32", "CPU_MLA"),          # AMX_MLA refuses fp32 weights
    (AMX, "bfloat16", "AMX_MLA"),
    (AMX, "float16", "CPU_MLA"),
    (AVX512_BF16, "float32", "CPU_MLA"),
    (AVX512_BF16, "bfloat16", "CPU_MLA"),  # no AMX tiles: AMX_MLA cannot run
    (PLAIN, "bfloat16", "CPU_MLA"),
    (PLAIN, "float", "CPU_MLA"),          # vLLM's alias of float32
])
def test_auto_takes_the_backend_that_runs_the_dtype_on_the_cpu(flags: frozenset[str], dtype: str, wanted: str) -> None:
    assert cpu_attention_backend(flags, dtype, "auto") == wanted


def test_vllm_would_pick_amx_mla_wherever_there_are_amx_tiles() -> None:
    assert vllm_cpu_mla_choice(AMX) == "AMX_MLA"
    assert vllm_cpu_mla_choice(AVX512_BF16) == vllm_cpu_mla_choice(PLAIN) == "CPU_MLA"


def test_a_named_backend_that_works_is_kept() -> None:
    assert cpu_attention_backend(AMX, "float32", "CPU_MLA") == "CPU_MLA"
    assert cpu_attention_backend(AMX, "bfloat16", "amx_mla") == "AMX_MLA"
    assert cpu_attention_backend(PLAIN, "float32", None) == "CPU_MLA"


@pytest.mark.parametrize("flags,dtype,requested,message", [
    (AMX, "float32", "AMX_MLA", "takes bfloat16 weights, not engine.dtype float32"),
    (AMX, "float32", None, "vLLM's own choice .* is AMX_MLA, which takes bfloat16"),
    (AVX512_BF16, "bfloat16", "AMX_MLA", "needs a CPU with amx_tile and amx_bf16"),
    (PLAIN, "float32", "FLASHMLA", "runs MLA with CPU_MLA or AMX_MLA only"),
    (PLAIN, "auto", "auto", "engine.dtype 'auto'"),
    (PLAIN, "fp8", "CPU_MLA", "engine.dtype 'fp8'"),
])
def test_a_request_that_cannot_run_is_refused(flags: frozenset[str], dtype: str, requested: str | None,
                                              message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cpu_attention_backend(flags, dtype, requested)


def test_off_the_cpu_platform_the_backend_is_vllms_or_the_named_one() -> None:
    cuda = compose_config("dump", ["engine=cuda"]).engine
    assert attention_backend(cuda, on_cpu=False) is None
    for requested, wanted in [("auto", None), ("FLASHMLA", "FLASHMLA")]:
        engine = OmegaConf.merge(cuda, {"attention_backend": requested})
        assert attention_backend(engine, on_cpu=False) == wanted
    assert "attention_backend" not in engine_kwargs(cuda, on_cpu=False)


@pytest.mark.parametrize("flags,wanted", [(AMX, "CPU_MLA"), (AVX512_BF16, "CPU_MLA")])
def test_the_cpu_config_names_its_backend_for_verifier_and_draft(flags: frozenset[str], wanted: str) -> None:
    """conf/engine/cpu.yaml as shipped (float32, auto) on either CPU kind."""
    engine = compose_config("dump").engine
    assert engine_kwargs(engine, on_cpu=True, cpu_flags=flags)["attention_backend"] == wanted
    spec = speculative_config(engine, Path("/draft"), 3, "greedy", on_cpu=True, cpu_flags=flags)
    assert spec["attention_backend"] == wanted and spec["method"] == "eagle3"
    bf16 = OmegaConf.merge(engine, {"dtype": "bfloat16"})
    assert engine_kwargs(bf16, on_cpu=True, cpu_flags=flags)["attention_backend"] == cpu_attention_backend(
        flags, "bfloat16", "auto")


def test_null_leaves_the_choice_to_vllm_where_it_works() -> None:
    engine = compose_config("dump", ["engine.attention_backend=null"]).engine
    assert "attention_backend" not in engine_kwargs(engine, on_cpu=True, cpu_flags=PLAIN)
    assert "attention_backend" not in speculative_config(engine, Path("/d"), 3, "greedy", on_cpu=True,
                                                         cpu_flags=PLAIN)
    with pytest.raises(ValueError, match="AMX_MLA"):
        engine_kwargs(engine, on_cpu=True, cpu_flags=AMX)


@pytest.mark.vllm
def test_vllm_takes_the_backend_for_verifier_and_draft(kimi_tiny_dir: Path, tmp_path: Path) -> None:
    """This machine's engine config through vLLM's own argument parsing (EngineArgs ->
    VllmConfig) and its CPU platform's selection for an MLA layer: the named backend is the one
    the verifier and the draft get. No engine starts."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from model.checkpoint import export_draft
    from config import compose_draft_conf
    from model.draft import DraftConfig, build_draft

    engine = compose_config("dump").engine
    kwargs = engine_kwargs(engine)
    chosen = cpu_attention_backend(infra.cpu_flags(), engine.dtype, engine.attention_backend)
    assert kwargs["attention_backend"] == chosen
    draft_cfg = DraftConfig.from_conf(compose_draft_conf("kimi_tiny"), Verifier.open(kimi_tiny_dir))
    draft_dir = export_draft(build_draft(draft_cfg), tmp_path / "draft")
    spec = speculative_config(engine, draft_dir, 2, "greedy")
    args = EngineArgs(model=str(kimi_tiny_dir), tokenizer=str(kimi_tiny_dir), speculative_config=spec,
                      **(kwargs | {"max_model_len": 512}))
    config = args.create_engine_config()
    assert config.attention_config.backend == AttentionBackendEnum[chosen]
    assert config.speculative_config.attention_backend == AttentionBackendEnum[chosen]
    mla = AttentionSelectorConfig(head_size=576, dtype=torch.float32, kv_cache_dtype="auto", block_size=16,
                                  use_mla=True)
    path = current_platform.get_attn_backend_cls(AttentionBackendEnum[chosen], mla)
    assert path == AttentionBackendEnum[chosen].get_path()


def test_precision_auto_is_bf16_where_the_cpu_has_bf16_units() -> None:
    assert precision_of("auto", "cpu", AMX) == "bf16"
    assert precision_of("auto", "cpu", AVX512_BF16) == "bf16"
    assert precision_of("auto", "cpu", PLAIN) == "fp32"           # bf16 fallbacks: ~30x slower
    assert precision_of("auto", "cuda", PLAIN) == "bf16"          # the host CPU does not matter
    assert precision_of("fp32", "cpu", AMX) == "fp32" and precision_of("bf16", "cpu", PLAIN) == "bf16"
