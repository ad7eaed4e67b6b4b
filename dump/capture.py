"""The only code of stage 1 that talks to vLLM: capture aux and final hidden states of prompts.

Mechanism: vLLM's own EAGLE-3 aux-hidden-state outputs, the path serving uses. A model that
implements vLLM's SupportsEagle3 interface (DeepseekV2ForCausalLM for DeepSeek-V3 / Kimi-K2,
KimiK3ForConditionalGeneration for Kimi-K3) returns `(hidden_states, [aux_0, aux_1, ...])` from
its forward once `set_aux_hidden_state_layers(ids)` was called and the model runner was told to
expect it (`use_aux_hidden_state_outputs`). The stored aux states are therefore by construction
the tensors vLLM hands an EAGLE-3 draft, for every architecture and aux mode vLLM implements:
DeepSeek-V3's residual stream entering layer k, Kimi-K3's block prefix sum (`prefix_only`) or
AttnRes-mixed stream (`attn_res_stream`, chosen by VLLM_KIMI_K3_AUX_ATTN_RES_STREAM).

When: the engine runs the worker class of dump/capture_worker.py, which switches those outputs on
right after the model is loaded, as vLLM's runner does for an EAGLE-3 speculator, and so before
vLLM profiles memory, traces the model with torch.compile and captures CUDA graphs. Compiled and
graph-captured engines (the GPU config: enforce_eager false) therefore return the aux states too,
and between pipeline stages the intermediate tensors carry them (vLLM's
`reserve_aux_intermediate_tensor_slots`, for models with `supports_aux_hidden_states_over_pp`, such
as Kimi-K3's KimiLinearModel; vLLM 0.32's DeepseekV2Model does not relay them, so aux layers on an
earlier stage are refused when the engine starts). No speculative method runs: decoding (the
answer regeneration) is the plain engine's.

Reading the outputs: the runner's `_model_forward` (plain Python around the compiled model) is
wrapped in each worker; it copies the model output of armed steps, and a wrapper around
`execute_model` attributes the rows of each step to requests in the runner's batch order.

Final state: what the lm_head consumes. DeepSeek-V3 applies its final norm at the end of the
forward; Kimi-K3 applies it in compute_logits (its forward returns the pre-norm state for its MTP
head), so for K3 the verifier config names that norm module (`final_norm_module`) and the worker
applies it to the forward output, as compute_logits does. (A hook on compute_logits would see
only the sampled rows.)

Which worker keeps states: every tensor-parallel rank holds the same full (all-gathered) outputs,
and only the last pipeline stage has the final state and all aux states, so the worker of
TP rank 0 on the last PP stage returns what it captured; the others capture nothing.
"""
from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from store import AUX_CAPTURES

_STATE_ATTR = "_eagle3_capture"
# vLLM's switch between Kimi-K3's two aux modes (vllm/envs.py, vLLM 0.32); read when the engine's
# workers start, so it is set before the engine is built.
ATTN_RES_STREAM_ENV = "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
CAPTURE_WORKER = "dump.capture_worker.CaptureWorker"
ADDITIONAL_CONFIG_KEY = "eagle3_capture"


@dataclass
class CapturedSample:
    aux: torch.Tensor    # [T, n_aux, H] in the engine dtype
    final: torch.Tensor  # [T, H] what the lm_head consumes


@dataclass(frozen=True)
class CaptureSpec:
    """What to capture, in vLLM's terms."""

    aux_layer_ids: tuple[int, ...]       # vLLM convention: id k = the state entering layer k
    aux_capture: str = "residual_stream"  # residual_stream | prefix_only | attn_res_stream
    final_norm_module: str | None = None  # module applied to the forward output before lm_head

    def __post_init__(self) -> None:
        if self.aux_capture not in AUX_CAPTURES:
            raise ValueError(f"aux_capture {self.aux_capture!r} is not one of {AUX_CAPTURES}")
        if list(self.aux_layer_ids) != sorted(set(self.aux_layer_ids)):
            # vLLM sorts and de-duplicates the ids it is given; stored order must be its order.
            raise ValueError(f"aux layer ids {list(self.aux_layer_ids)} must be distinct and ascending")


def capture_engine_overrides(spec: CaptureSpec, max_len: int) -> dict[str, Any]:
    """Engine settings capture depends on, whatever conf/engine says (the one place they are set)."""
    return {
        # Every prompt token must be computed (a prefix-cache hit would skip rows), and vLLM
        # samples one token after a prefill, so a max_len prompt needs max_len + 1 positions.
        "enable_prefix_caching": False,
        "max_model_len": max_len + 1,
        "worker_cls": CAPTURE_WORKER,
        # Read by the capture worker when the model is loaded; part of vLLM's config hash, so a
        # compile cache traced for other aux layers is not reused.
        "additional_config": {ADDITIONAL_CONFIG_KEY: {"aux_layer_ids": list(spec.aux_layer_ids)}},
    }


def capture_environment(spec: CaptureSpec) -> dict[str, str]:
    """Environment the engine's processes read at start-up."""
    return {
        ATTN_RES_STREAM_ENV: "1" if spec.aux_capture == "attn_res_stream" else "0",
        # The capture wraps the V1 model runner's `_model_forward` / `execute_model`; on CUDA with
        # Triton vLLM 0.32 would pick its V2 runner (vllm/config/vllm.py `use_v2_model_runner`).
        V2_RUNNER_ENV: "0",
    }


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def capture_spec(verifier: Any) -> CaptureSpec:
    """The capture a verifier config asks for (conf/verifier/*: aux ids, aux mode, final norm)."""
    from model.aux_ids import to_vllm_aux_ids

    ids = to_vllm_aux_ids(list(verifier.aux_layer_ids), verifier.aux_convention,
                          int(verifier.architecture.num_hidden_layers))
    return CaptureSpec(tuple(ids), str(verifier.aux_capture), verifier.final_norm_module)


def start_capture_engine(model_dir: str | os.PathLike, engine: Any, spec: CaptureSpec, max_len: int):
    """A vLLM engine on the verifier that returns the aux states of `spec` (conf/engine/* + overrides)."""
    from dump.engine import make_llm

    # The engine's processes start inside LLM(...) and keep the environment they were given.
    with _environment(capture_environment(spec)):
        return make_llm(model_dir, engine, **capture_engine_overrides(spec, max_len))


class _WorkerCapture:
    """Lives inside a vLLM worker: keeps the model outputs of armed steps, split by request."""

    def __init__(self, final_norm: torch.nn.Module | None, num_aux: int, keeps: bool) -> None:
        self.armed = False
        self.keeps = keeps              # TP rank 0 of the last PP stage
        self.final_norm = final_norm
        self.num_aux = num_aux
        self.step_tokens = 0
        self.step: tuple[torch.Tensor, torch.Tensor] | None = None   # final [N, H], aux [N, n_aux, H]
        self.done_aux: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.done_final: dict[str, list[torch.Tensor]] = defaultdict(list)

    def record(self, output: Any) -> None:
        if not (self.armed and self.keeps):
            return
        if not isinstance(output, tuple):
            raise RuntimeError(f"the model returned {type(output).__name__}, not (hidden, aux): "
                               "vLLM's aux-hidden-state outputs are off in this worker")
        hidden, aux = output
        if len(aux) != self.num_aux:
            raise RuntimeError(f"the model returned {len(aux)} aux states for {self.num_aux} aux layers "
                               "(aux states of another pipeline stage did not arrive)")
        n = self.step_tokens  # rows past it are padding (CUDA graphs, batch-size buckets)
        final = hidden[:n] if self.final_norm is None else self.final_norm(hidden[:n])
        self.step = (final.detach().to("cpu", copy=True),
                     torch.stack([a[:n] for a in aux], dim=1).detach().to("cpu", copy=True))

    def split_step(self, req_ids: Sequence[str], num_tokens: Sequence[int]) -> None:
        """Attribute the rows of the last forward to requests, in the runner's batch order."""
        if self.step is None:
            return
        final, aux = self.step
        start = 0
        for req_id, n in zip(req_ids, num_tokens):
            self.done_final[req_id].append(final[start:start + n])
            self.done_aux[req_id].append(aux[start:start + n])
            start += n
        self.step = None

    def collect(self) -> dict[str, CapturedSample]:
        out = {r: CapturedSample(torch.cat(self.done_aux[r]), torch.cat(self.done_final[r]))
               for r in self.done_final}
        self.done_aux.clear()
        self.done_final.clear()
        return out


def _keeps_states() -> bool:
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return get_pp_group().is_last_rank and get_tp_group().rank_in_group == 0


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (embedding, layers, norm): `model.model`, or that of a multimodal
    wrapper's language model (Kimi-K3)."""
    language_model = model.get_language_model() if hasattr(model, "get_language_model") else model
    return language_model.model


def enable_aux_outputs(runner, aux_layer_ids: tuple[int, ...]) -> None:
    """Switch vLLM's EAGLE-3 aux outputs on in a worker whose model was just loaded (before
    memory profiling, compilation and graph capture). Called by dump/capture_worker.py."""
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import reserve_aux_intermediate_tensor_slots

    model = runner.get_model()
    if not supports_eagle3(model):
        raise RuntimeError(f"{type(model).__name__} does not implement vLLM's SupportsEagle3: "
                           "no aux hidden states to capture")
    pp, decoder = get_pp_group(), _decoder(model)
    local = [i for i in aux_layer_ids if decoder.start_layer <= i < decoder.end_layer]
    if not pp.is_last_rank and local and not getattr(decoder, "supports_aux_hidden_states_over_pp", False):
        # vLLM 0.32's DeepseekV2Model drops aux states computed before the last stage.
        raise ValueError(f"{type(model).__name__}: aux layers {local} live on pipeline stage {pp.rank_in_group} "
                         f"of {pp.world_size} (layers {decoder.start_layer}..{decoder.end_layer - 1}), and vLLM "
                         "does not send this model's aux states to the last stage; run it with "
                         "pipeline_parallel_size 1 (tensor parallelism is fine)")
    model.set_aux_hidden_state_layers(aux_layer_ids)
    reserve_aux_intermediate_tensor_slots(model)  # a no-op without PP or without relaying
    if not pp.is_first_rank:
        # The receive buffers, with the aux slots. vLLM allocates them lazily in a dummy run,
        # which its CPU runner skips for eager engines.
        runner.intermediate_tensors = model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
    # Only the last stage returns (hidden, aux); earlier stages return intermediate tensors.
    runner.use_aux_hidden_state_outputs = pp.is_last_rank


def _install(worker, aux_layer_ids: list[int], final_norm_module: str | None) -> bool:
    # Plain arguments: collective_rpc serialises a dataclass argument into a dict.
    runner = worker.model_runner
    model = runner.get_model()
    ids = tuple(aux_layer_ids)
    built_for = (worker.vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {}).get("aux_layer_ids")
    if built_for is None:
        raise RuntimeError("this engine was not built for capture: start it with dump.capture.start_capture_engine")
    if tuple(built_for) != ids:
        raise ValueError(f"this engine was built to capture aux layers {list(built_for)}, not {list(ids)}")
    keeps = _keeps_states()
    final_norm = model.get_submodule(final_norm_module) if (keeps and final_norm_module) else None
    capture = _WorkerCapture(final_norm, len(ids), keeps)
    previous = getattr(runner, _STATE_ATTR, None)
    setattr(runner, _STATE_ATTR, capture)
    if previous is None:  # wrap once; the wrappers read whichever capture is current
        _wrap_runner(runner)
    return True


def _wrap_runner(runner) -> None:
    original_forward, original_execute = runner._model_forward, runner.execute_model

    def model_forward(*args, **kwargs):
        output = original_forward(*args, **kwargs)
        getattr(runner, _STATE_ATTR).record(output)
        return output

    def execute_model(scheduler_output, *args, **kwargs):
        capture = getattr(runner, _STATE_ATTR)
        capture.step_tokens = scheduler_output.total_num_scheduled_tokens
        result = original_execute(scheduler_output, *args, **kwargs)
        if capture.armed and capture.step_tokens > 0:
            req_ids = list(runner.input_batch.req_ids)
            capture.split_step(req_ids, [scheduler_output.num_scheduled_tokens[r] for r in req_ids])
        return result

    runner._model_forward = model_forward
    runner.execute_model = execute_model


def _arm(worker, armed: bool) -> None:
    getattr(worker.model_runner, _STATE_ATTR).armed = armed


def _collect(worker) -> dict[str, CapturedSample] | None:
    capture = getattr(worker.model_runner, _STATE_ATTR)
    result = capture.collect()
    return result if capture.keeps else None


class HiddenStateCapture:
    """Prefill prompts through a vLLM engine and return each one's aux and final states.

    Build the engine with `start_capture_engine` for the same spec.
    """

    def __init__(self, llm, spec: CaptureSpec) -> None:
        self.llm = llm
        self.spec = spec
        llm.collective_rpc(_install, args=(list(spec.aux_layer_ids), spec.final_norm_module))

    def capture(self, prompts: Sequence[Sequence[int]]) -> list[CapturedSample]:
        """One engine call for the whole batch; results in the order of `prompts`."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0)
        self.llm.collective_rpc(_arm, args=(True,))
        try:
            # Plain ints: vLLM's request encoder rejects numpy scalars.
            requests = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        finally:
            self.llm.collective_rpc(_arm, args=(False,))
        by_request = _one_keeper(self.llm.collective_rpc(_collect))
        samples = []
        for prompt, out in zip(prompts, outputs):
            sample = _find(by_request, out.request_id)
            if sample.final.shape[0] != len(prompt):
                raise RuntimeError(f"request {out.request_id}: captured {sample.final.shape[0]} "
                                   f"positions for a {len(prompt)}-token prompt (prefix caching on?)")
            samples.append(sample)
        return samples


def _one_keeper(per_worker: list[dict[str, CapturedSample] | None]) -> dict[str, CapturedSample]:
    kept = [r for r in per_worker if r is not None]
    if len(kept) != 1:
        raise RuntimeError(f"{len(kept)} of {len(per_worker)} workers kept captured states; expected "
                           "exactly one (TP rank 0 of the last pipeline stage)")
    return kept[0]


def _find(by_request: dict[str, CapturedSample], request_id: str) -> CapturedSample:
    # vLLM may suffix the user-facing request id internally ("3" -> "3-9f2c..."), so match on it.
    if request_id in by_request:
        return by_request[request_id]
    matches = [k for k in by_request if k.startswith(request_id + "-")]
    if len(matches) != 1:
        raise KeyError(f"no captured states for request {request_id} (have {sorted(by_request)})")
    return by_request[matches[0]]
