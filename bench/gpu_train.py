"""The Kimi-K2 draft's training step on one GPU: step time, peak memory, tokens/s, MFU, and the
memory plan (train/plan.py) beside the measured peak. Writes bench/results/gpu_train.json.

    python -m bench.gpu_train                     Kimi-K2 shapes, T 8192, bf16, TTT 4, CUDA
    python -m bench.gpu_train --max-len 4096      another row length
    python -m bench.gpu_train --smoke             kimi-tiny shapes, T 128, 2 steps, CPU, fp32, one
                                                  thread (a test runs it; bf16 matmuls crawl on CPUs
                                                  without bf16 units)

Needs PyTorch, hydra-core and omegaconf (the project's config and draft code), with their own
requirements (PyYAML, antlr4-python3-runtime); nothing else: not vLLM, DeepSpeed, transformers,
safetensors, numpy, nor the store's zarr, numcodecs and crc32c (tests/test_gpu.py runs the smoke
mode with every other installed package unimportable). Two options need more: `--engine deepspeed`
uses train/deepspeed_setup.py and needs DeepSpeed; `train.loss.target_topk=<k>` computes the top-k with
the store's encoder (store/encoding.py) and needs the store's packages.

What runs: the project's Eagle3Objective (model/draft.py's MLA draft, TTT steps, the chunked soft
cross-entropy) on synthetic states: random aux and final hidden states and token ids, one sample
per row with every position loss-masked, a random frozen embedding, draft lm_head and verifier
lm_head of the verifier's shapes. One optimizer step = one row forward + backward + AdamW.
The plain step keeps bf16 weights and gradients, fp32 master weights and fp32 moments, and clips
the global gradient norm: what DeepSpeed's ZeRO optimizers hold on a single rank.

If the plan says the requested row length does not fit in the GPU's memory, the step is still
tried once (an out-of-memory error is recorded: it checks the plan), then the row length is
halved until the plan fits, and that length is benchmarked.

Model FLOPs (MFU), per optimizer step, from the batch's own token counts. T tokens, C_k = the
positions the loss counts at TTT step k, ctx_k = sum over tokens of the keys each query attends
at step k (its causal context inside its sample, plus k diagonal keys), h heads, d_qk / d_v
head dims, P_layer = weights of the decoder layer's matmuls, P_fc = 3H x H, V x H the lm_heads:

    fc            4 x P_fc x T                  once: forward + weight gradient (the aux states
                                                need no gradient)
    per TTT step k:
      layer       6 x P_layer x T               forward, input gradient, weight gradient
      attention   3 x 2 x h x (d_qk + d_v) x ctx_k
                                                Q K^T and P V, 2 FLOPs per multiply-add each,
                                                forward + twice that backward
      draft head  4 x V x H x C_k               frozen: forward + input gradient (6 x with
                                                draft.train_head)
      target head 2 x V x H x C_k               the verifier's distribution: forward only

Not counted (not model FLOPs): the attention's query blocks computing masked scores and its
backward recomputing them, norms, RoPE and softmax element-wise work.
MFU = model FLOPs per step / step time / the GPU's dense bf16 peak (datasheet, table below);
for a GPU not in the table the FLOP/s are printed without an MFU. The executed FLOP/s (the
matmuls the blocked kernels run, recomputation and masked scores included) are printed too.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

import infra
from infra import REPO_ROOT
from config import compose_config
from model.batch import Batch
from model.chain import step_inputs
from model.draft import DraftConfig, Eagle3Draft
from model.ttt_attention import attention_block_size, query_blocks
from train.objective import Eagle3Objective, ObjectiveConfig
from train.plan import GIB, MemoryPlan, PlanSpec, memory_plan

infra.configure_environment()  # caches in the repo (torch extensions, Triton)

RESULTS = REPO_ROOT / "bench/results/gpu_train.json"
SMOKE_RESULTS = REPO_ROOT / "bench/results/gpu_train_smoke.json"
KIMI_K2 = ["verifier=kimi_k2", "draft=kimi_k2", "verifier.path=/unused"]
KIMI_TINY = ["verifier=kimi_tiny", "draft=kimi_tiny"]
# Dense bf16 tensor-core peak FLOP/s from the datasheets (no sparsity), by device-name pattern.
PEAK_BF16 = [
    (re.compile(r"\bH100\b(?!.*\b(PCIe|NVL)\b)"), "H100 SXM", 989.4e12),
    (re.compile(r"\bH200\b"), "H200", 989.4e12),
    (re.compile(r"\bA100\b"), "A100", 312e12),
    (re.compile(r"\bB200\b"), "B200", 2.25e15),
]
# The plan must fit in this share of the GPU's memory (context, allocator rounding, fragmentation).
FIT_FRACTION = 0.92
MIN_FALLBACK_LEN = 512


def peak_flops(device_name: str) -> tuple[str, float] | None:
    for pattern, name, flops in PEAK_BF16:
        if pattern.search(device_name):
            return name, flops
    return None


# ---- the model ---------------------------------------------------------------------------------
def synthetic_objective(draft_cfg: DraftConfig, objective_cfg: ObjectiveConfig, device: torch.device,
                        dtype: torch.dtype, seed: int = 0) -> Eagle3Objective:
    """Random layer weights and random frozen verifier tensors of the real shapes, in `dtype`."""
    torch.manual_seed(seed)
    with torch.device(device):
        draft = Eagle3Draft(draft_cfg)
        draft.init_weights()
        draft.embed_tokens.normal_()
        target_head = torch.randn(draft_cfg.vocab_size, draft_cfg.hidden_size) * 0.02
    objective = Eagle3Objective(draft, target_head, objective_cfg).to(dtype)
    objective.cast_buffers(dtype)
    return objective


def synthetic_batch(draft_cfg: DraftConfig, max_len: int, device: torch.device, seed: int = 0) -> Batch:
    """One row of one sample of max_len tokens, every position loss-masked."""
    g = torch.Generator(device=device).manual_seed(seed)
    T, H = max_len, draft_cfg.target_hidden_size
    input_ids = torch.randint(0, draft_cfg.vocab_size, (1, T), generator=g, device=device)
    aux = torch.randn(1, T, draft_cfg.num_aux * H, generator=g, device=device).bfloat16()
    final = torch.randn(1, T, H, generator=g, device=device).bfloat16()
    return Batch(input_ids=input_ids, loss_mask=torch.ones(1, T, dtype=torch.bool, device=device), aux=aux,
                 position_ids=torch.arange(T, device=device)[None],
                 segment_ids=torch.zeros(1, T, dtype=torch.long, device=device), final=final)


# ---- model FLOPs ---------------------------------------------------------------------------------
def _matmul_params(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def _executed_score_pairs(segment_ids: Tensor, heads: int) -> int:
    """(query, key) pairs model/ttt_attention.py's block-wise causal attention computes per head and row:
    each query block [start, end) scores the keys [lo, end), lo the first key any of its queries
    may see (the block's first sample start, lowest over the micro-batch)."""
    B, L = segment_ids.shape
    return sum((end - start) * (end - lo) for start, end, lo in
               query_blocks(L, attention_block_size(B, heads, L), segment_ids))


def model_flops(draft: Eagle3Draft, batch: Batch, steps: int, *, executed: bool = False) -> int:
    """Model FLOPs of one forward + backward of the objective on `batch` (module docstring).

    executed: the matmul FLOPs the kernels run instead: every position of the row, the attention's
    query blocks against the keys from the block's first visible one to its end (the blocked
    kernel a GPU runs), its backward recomputing the scores (2 x dqk more per pair), no diagonal
    keys (element-wise); the chunked loss takes its gradients in its forward, so both heads'
    logits once (what torch's FlopCounterMode counts)."""
    cfg = draft.config
    real = batch.real
    B, L = real.shape
    T = B * L if executed else int(real.sum())
    head_flops = (6 if cfg.train_head else 4) * cfg.draft_vocab_size * cfg.hidden_size
    target_flops = 2 * cfg.vocab_size * cfg.hidden_size
    attention_width = 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    causal = int(((batch.position_ids + 1) * real).sum())
    executed_attention = B * cfg.num_attention_heads * _executed_score_pairs(batch.segment_ids, cfg.num_attention_heads) * (
        attention_width // cfg.num_attention_heads * 3 + 2 * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim))
    flops = 4 * draft.fc.weight.numel() * T
    for k in range(steps):
        _, _, counted = step_inputs(batch, k)
        flops += 6 * _matmul_params(draft.midlayer) * T
        flops += 3 * attention_width * (causal + k * T) if not executed else executed_attention
        flops += (head_flops + target_flops) * int(counted.sum())
    return int(flops)


# ---- the step ------------------------------------------------------------------------------------
class MixedPrecisionAdamW:
    """AdamW on fp32 master copies of low-precision weights, with global-norm clipping: the state
    DeepSpeed's ZeRO optimizers keep on one rank (fp32 weights are their own master)."""

    def __init__(self, params: list[nn.Parameter], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, grad_clip: float) -> None:
        self.params = params
        self.master = [p if p.dtype == torch.float32 else p.detach().float() for p in params]
        fused = params[0].device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                           fused=fused)
        self.grad_clip = grad_clip

    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            if m is not p:
                m.grad = p.grad.float()
                p.grad = None
        torch.nn.utils.clip_grad_norm_(self.master, self.grad_clip)
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if m is not p:
                    p.copy_(m)
                m.grad = None


def plain_step(objective: Eagle3Objective, cfg: DictConfig) -> Callable[[Batch], float]:
    t = cfg.train
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = MixedPrecisionAdamW(params, float(t.lr), tuple(t.betas), float(t.eps), float(t.weight_decay),
                                    float(t.grad_clip))

    def step(batch: Batch) -> float:
        loss = objective(batch).loss
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def deepspeed_step(objective: Eagle3Objective, cfg: DictConfig, total_steps: int
                   ) -> tuple[Callable[[Batch], float], Any]:
    """train/deepspeed_setup.py's DeepSpeed engine (the trainer's own path)."""
    from train.deepspeed_setup import initialize
    from train.distributed import init_distributed

    init_distributed()
    engine = initialize(objective, cfg, total_steps)

    def step(batch: Batch) -> float:
        loss = engine(batch).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step, engine


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_attempt(cfg: DictConfig, draft_cfg: DraftConfig, plan: MemoryPlan, device: torch.device, engine_name: str,
                warmup: int, steps: int) -> dict[str, Any]:
    """Build, train warmup + steps optimizer steps, measure; an out-of-memory error is a result."""
    spec = plan.spec
    objective_cfg = spec.objective_config()
    engine = None
    cuda = device.type == "cuda"
    try:
        if engine_name == "deepspeed":    # fp32 on the host, as the trainer builds it; DeepSpeed casts and moves it
            objective = synthetic_objective(draft_cfg, objective_cfg, torch.device("cpu"), torch.float32)
        else:
            objective = synthetic_objective(draft_cfg, objective_cfg, device, spec.dtype)
        batch = synthetic_batch(draft_cfg, spec.max_len, device)
        flops = model_flops(objective.draft, batch, spec.ttt_steps)
        executed = model_flops(objective.draft, batch, spec.ttt_steps, executed=True)
        tokens = int(batch.tokens())
        if engine_name == "deepspeed":
            step, engine = deepspeed_step(objective, cfg, warmup + steps)
        else:
            step = plain_step(objective, cfg)
        if cuda:
            # From here on: what the plan counts (weights, optimizer, batch, the steps), without
            # the construction's fp32 transients.
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        times, losses = [], []
        for i in range(warmup + steps):
            _sync(device)
            began = time.perf_counter()
            losses.append(step(batch))
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - began)
        step_s = statistics.median(times)
        result: dict[str, Any] = {"outcome": "ok", "tokens_per_step": tokens, "step_s": step_s,
                                  "step_times_s": times, "tokens_per_s": tokens / step_s, "model_flops_per_step": flops,
                                  "model_flop_per_s": flops / step_s, "executed_flops_per_step": executed,
                                  "executed_flop_per_s": executed / step_s, "losses": losses}
    except torch.cuda.OutOfMemoryError as error:
        result = {"outcome": "out of memory", "error": str(error).splitlines()[0]}
    finally:
        if engine is not None:
            engine.destroy()
    if cuda:
        result |= {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                   "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
        result["plan_over_measured"] = plan.total_bytes / result["peak_allocated_bytes"]
    objective = batch = step = engine = None
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


# ---- plans ---------------------------------------------------------------------------------------
def plan_for(cfg: DictConfig, draft_cfg: DraftConfig, max_len: int, zero_stage: int) -> MemoryPlan:
    t = cfg.train
    spec = PlanSpec(world_size=1, zero_stage=zero_stage, max_len=max_len, micro_batch=1, precision=t.precision,
                    ttt_steps=t.ttt.steps, ttt_decay=t.ttt.decay, chunk_bytes=t.loss.chunk_bytes,
                    recompute=t.recompute)
    return memory_plan(draft_cfg, spec, str(cfg.draft.name))


def fitting_plan(cfg: DictConfig, draft_cfg: DraftConfig, max_len: int, zero_stage: int,
                 capacity: int) -> MemoryPlan | None:
    """The plan of the longest row, halving max_len, that fits in FIT_FRACTION of capacity."""
    while max_len >= MIN_FALLBACK_LEN:
        plan = plan_for(cfg, draft_cfg, max_len, zero_stage)
        if plan.total_bytes <= FIT_FRACTION * capacity:
            return plan
        max_len //= 2
    return None


def comparison(plan: MemoryPlan, result: dict[str, Any]) -> str:
    """The plan's rows and total beside the measured peak."""
    measured = result.get("peak_allocated_bytes")
    lines = [plan.table(), f"  {'measured peak (max_memory_allocated)':<37}"
             + ("not measured (CPU)" if measured is None else
                f"{measured / GIB:.2f} GiB; plan / measured {plan.total_bytes / measured:.3f}; "
                f"peak reserved {result['peak_reserved_bytes'] / GIB:.2f} GiB")]
    return "\n".join(lines)


def summary_line(max_len: int, result: dict[str, Any], peak: tuple[str, float] | None) -> str:
    if result["outcome"] != "ok":
        return f"T {max_len}: {result['outcome']}: {result.get('error', '')}"
    mfu = (f"MFU {result['mfu']:.3f} of {peak[0]} {peak[1] / 1e12:.1f} TFLOP/s" if "mfu" in result
           else "no MFU (no datasheet peak for this device)")
    return (f"T {max_len}: step {result['step_s']:.3f} s (median of {len(result['step_times_s'])}), "
            f"{result['tokens_per_s']:.0f} tokens/s, {result['model_flop_per_s'] / 1e12:.3g} model TFLOP/s "
            f"({result['executed_flop_per_s'] / 1e12:.3g} executed), {mfu}; "
            f"loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}")


# ---- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="kimi-tiny shapes, T 128, 2 steps, on the CPU")
    parser.add_argument("--max-len", type=int, help="tokens per row (default: the recipe's, 8192 for Kimi-K2)")
    parser.add_argument("--steps", type=int, help="timed optimizer steps (default 5; smoke 1)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 2; smoke 1)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], help="default bf16 (smoke: fp32)")
    parser.add_argument("--engine", choices=["plain", "deepspeed"], default="plain")
    parser.add_argument("--device", help="default: cuda (smoke: cpu)")
    parser.add_argument("--threads", type=int, help="CPU math threads (smoke: 1; OpenMP threads that lose "
                                                    "their core on a shared machine wait on each other)")
    parser.add_argument("--no-fallback", action="store_true", help="do not retry shorter rows after an OOM")
    parser.add_argument("--out", type=Path)
    parser.add_argument("overrides", nargs="*", help="hydra overrides of conf/train.yaml")
    args = parser.parse_args(argv)

    smoke = args.smoke
    device = torch.device(args.device or ("cpu" if smoke else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or --smoke for the CPU smoke test")
    precision = args.precision or ("fp32" if smoke else "bf16")
    cfg = compose_config("train", [*(KIMI_TINY if smoke else KIMI_K2), f"train.precision={precision}",
                                   "train.micro_batch=1", "train.grad_accum=1", *args.overrides])
    draft_cfg = DraftConfig.from_conf(cfg.draft)
    max_len = args.max_len or (128 if smoke else int(cfg.train.max_len))
    threads = args.threads or (1 if smoke else None)
    if threads:
        torch.set_num_threads(threads)
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 2)
    steps = args.steps if args.steps is not None else (1 if smoke else 5)
    zero_stage = int(cfg.deepspeed.zero_optimization.stage) if args.engine == "deepspeed" else 0
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine()
    capacity = torch.cuda.get_device_properties(device).total_memory if cuda else None
    peak = peak_flops(name) if cuda else None
    report: dict[str, Any] = {
        "command": shlex.join([Path(sys.executable).name, "-m", "bench.gpu_train", *(sys.argv[1:] if argv is None else argv)]),
        "device": name, "device_memory_bytes": capacity, "torch": torch.__version__,
        "cuda": torch.version.cuda, "engine": args.engine, "draft": str(cfg.draft.name),
        "shapes": {"hidden_size": draft_cfg.hidden_size, "vocab_size": draft_cfg.vocab_size,
                   "draft_vocab_size": draft_cfg.draft_vocab_size, "ttt_steps": int(cfg.train.ttt.steps),
                   "chunk_bytes": int(cfg.train.loss.chunk_bytes), "precision": precision},
        "peak_bf16_flops": None if peak is None else {"gpu": peak[0], "flop_per_s": peak[1]},
        "warmup_steps": warmup, "timed_steps": steps, "attempts": []}
    print(f"{report['command']}\n{name}, torch {torch.__version__}, engine {args.engine}", flush=True)

    plan = plan_for(cfg, draft_cfg, max_len, zero_stage)
    attempts = [plan]
    if cuda and plan.total_bytes > FIT_FRACTION * capacity:
        print(f"plan: {plan.total_bytes / GIB:.1f} GiB at T {max_len} > {FIT_FRACTION:.0%} of "
              f"{capacity / GIB:.1f} GiB: trying once to check, then shorter rows", flush=True)
        shorter = None if args.no_fallback else fitting_plan(cfg, draft_cfg, max_len // 2, zero_stage, capacity)
        attempts += [shorter] if shorter is not None else []
    for plan in attempts:
        T = plan.spec.max_len
        result = run_attempt(cfg, draft_cfg, plan, device, args.engine, warmup, steps)
        if result["outcome"] == "ok" and peak is not None:
            result["mfu"] = result["model_flop_per_s"] / peak[1]
        report["attempts"].append({"max_len": T, "plan": plan.to_json(), **result})
        print(comparison(plan, result))
        print(summary_line(T, result, peak), flush=True)
    out = args.out or (SMOKE_RESULTS if smoke else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
