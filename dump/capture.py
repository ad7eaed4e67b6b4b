"""The only code of stage 1 that talks to vLLM: capture aux and final hidden states of prompts.

Mechanism: forward hooks installed in vLLM's workers (through `collective_rpc`), on the
verifier's own decoder layers and final norm, plus a wrapper around the model runner's
`execute_model` that records which request each row of a step's flattened batch belongs to.

Why hooks and not the `extract_hidden_states` speculative method + a KV connector:
- the final hidden state must be what the lm_head consumes (the final norm's output). The
  aux-layer mechanism that `extract_hidden_states` relies on can return the last layer's
  pre-norm residual at best; that is wrong for Kimi-K3, whose block residual mix sits before
  the final norm. A hook on the final norm is right for every architecture.
- the aux states are taken exactly where vLLM's own EAGLE-3 code takes them (the sum of the
  hidden states and residual entering layer k), so ids mean what vLLM means by them.
- hooks need no extra KV-cache layer and no per-request file round trip.
The cost: vLLM must run the model eagerly (hooks do not fire inside a compiled graph), which
`conf/engine/*` sets for dumping, and prefix caching must be off so every token is computed.

Tensor parallelism: every TP rank holds the full (all-gathered) residual stream at the hooked
points, so only rank 0 keeps what it captures; the others return nothing.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_STATE_ATTR = "_eagle3_capture"


@dataclass
class CapturedSample:
    aux: torch.Tensor    # [T, n_aux, H] in the engine dtype
    final: torch.Tensor  # [T, H] post-norm, what the lm_head consumes


class _WorkerCapture:
    """Lives inside a vLLM worker: hooks append rows, execute_model splits them by request."""

    def __init__(self, model: torch.nn.Module, aux_layer_ids: Sequence[int]) -> None:
        self.armed = False
        self.aux_ids = list(aux_layer_ids)
        self.step_aux: dict[int, torch.Tensor] = {}
        self.step_final: torch.Tensor | None = None
        self.done_aux: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.done_final: dict[str, list[torch.Tensor]] = defaultdict(list)
        inner = model.model
        for layer_id in self.aux_ids:
            if layer_id == len(inner.layers):
                raise ValueError(f"aux layer id {layer_id} is the final residual: capture the "
                                 "final (post-norm) state instead")
            inner.layers[layer_id].register_forward_pre_hook(self._aux_hook(layer_id))
        inner.norm.register_forward_hook(self._final_hook)

    def _aux_hook(self, layer_id: int):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            if not self.armed:
                return
            # vLLM's decoder layers take (positions, hidden_states, residual, ...); the state
            # entering layer k is hidden_states + residual (residual is None before layer 0).
            hidden, residual = args[1], args[2]
            entering = hidden if residual is None else hidden + residual
            self.step_aux[layer_id] = entering.detach().to("cpu", copy=True)
        return hook

    def _final_hook(self, module: torch.nn.Module, args: tuple, output) -> None:
        if not self.armed:
            return
        normed = output[0] if isinstance(output, tuple) else output  # fused add-norm: (out, res)
        self.step_final = normed.detach().to("cpu", copy=True)

    def split_step(self, req_ids: Sequence[str], num_tokens: Sequence[int]) -> None:
        """Attribute the rows of the last forward to requests, in the runner's batch order."""
        if self.step_final is None:
            return
        start = 0
        for req_id, n in zip(req_ids, num_tokens):
            rows = slice(start, start + n)
            self.done_aux[req_id].append(
                torch.stack([self.step_aux[i][rows] for i in self.aux_ids], dim=1))
            self.done_final[req_id].append(self.step_final[rows])
            start += n
        self.step_aux, self.step_final = {}, None

    def collect(self) -> dict[str, CapturedSample]:
        out = {r: CapturedSample(torch.cat(self.done_aux[r]), torch.cat(self.done_final[r]))
               for r in self.done_final}
        self.done_aux.clear()
        self.done_final.clear()
        return out


def _install(worker, aux_layer_ids: list[int]) -> bool:
    runner = worker.model_runner
    if getattr(runner, _STATE_ATTR, None) is not None:
        return True
    capture = _WorkerCapture(runner.get_model(), aux_layer_ids)
    original = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        result = original(scheduler_output, *args, **kwargs)
        if capture.armed and scheduler_output.total_num_scheduled_tokens > 0:
            req_ids = list(runner.input_batch.req_ids)
            tokens = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
            capture.split_step(req_ids, tokens)
        return result

    runner.execute_model = execute_model
    setattr(runner, _STATE_ATTR, capture)
    return True


def _arm(worker, armed: bool) -> None:
    getattr(worker.model_runner, _STATE_ATTR).armed = armed


def _collect(worker) -> dict[str, CapturedSample] | None:
    capture = getattr(worker.model_runner, _STATE_ATTR)
    result = capture.collect()
    return result if worker.rank == 0 else None


def capture_engine_overrides(max_len: int) -> dict:
    """Engine settings capture depends on, whatever conf/engine says."""
    # Every prompt token must be computed (a prefix-cache hit would skip rows), and vLLM samples
    # one token after a prefill, so a max_len prompt needs max_len + 1 positions.
    return {"enable_prefix_caching": False, "max_model_len": max_len + 1}


class HiddenStateCapture:
    """Prefill prompts through a vLLM engine and return each one's aux and final states."""

    def __init__(self, llm, aux_layer_ids: Sequence[int]) -> None:
        self.llm = llm
        llm.collective_rpc(_install, args=(list(aux_layer_ids),))

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
        by_request = self.llm.collective_rpc(_collect)[0]
        samples = []
        for prompt, out in zip(prompts, outputs):
            sample = _find(by_request, out.request_id)
            if sample.final.shape[0] != len(prompt):
                raise RuntimeError(f"request {out.request_id}: captured {sample.final.shape[0]} "
                                   f"positions for a {len(prompt)}-token prompt (prefix caching on?)")
            samples.append(sample)
        return samples


def _find(by_request: dict[str, CapturedSample], request_id: str) -> CapturedSample:
    # vLLM may suffix the user-facing request id internally ("3" -> "3-9f2c..."), so match on it.
    if request_id in by_request:
        return by_request[request_id]
    matches = [k for k in by_request if k.startswith(request_id + "-")]
    if len(matches) != 1:
        raise KeyError(f"no captured states for request {request_id} (have {sorted(by_request)})")
    return by_request[matches[0]]
