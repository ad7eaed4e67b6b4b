"""Benchmark the trainer; writes bench/results/train.json (`make bench-train [ARGS=...]`).

    .venv/bin/python -m bench.train [--out FILE] [--steps 5] [hydra overrides of conf/train.yaml]

In one run, on this machine:
- tokens_per_s: DeepSpeed training steps (conf/train.yaml as given: draft, ZeRO stage, precision,
  TTT steps) on packed rows of train.max_len tokens from the store (synthetic hidden states of
  the same shapes when the store is missing), after warm-up steps;
- mfu: FLOPs of one step (counted by torch's FlopCounterMode over forward and backward: every
  matmul, attention and the chunked lm_heads) / step time / the matmul FLOP/s measured here, in
  the same dtype and thread count, on square matrices;
- deepspeed_over_plain: a DeepSpeed step / a plain PyTorch step (AdamW, clip_grad_norm_, same
  model, same batch), both fp32 so that they do the same arithmetic;
- loss_memory: peak memory of the chunked loss (forward + backward of one TTT step: verifier
  and draft logits) at V = 163,840 and T = 8,192 with H reduced, / the naive T x V fp32 logits.
  CPU: peak resident memory of a fresh process above its baseline (/proc/self/clear_refs resets
  the peak); CUDA: torch.cuda.max_memory_allocated above the inputs.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch.utils.flop_counter import FlopCounterMode

import infra
from infra import REPO_ROOT, compose_config, resolve

infra.configure_environment()  # offline hubs, caches in the repo (DeepSpeed's torch extensions, Triton)

RESULTS = REPO_ROOT / "bench/results/train.json"
KIMI_VOCAB = 163_840
KIMI_ROW = 8_192
WARMUP = 2


def _device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median seconds of fn() after WARMUP calls."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(repeats):
        _device_sync(device)
        start = time.perf_counter()
        fn()
        _device_sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(dtype: torch.dtype, device: torch.device, n: int = 2048, repeats: int = 5) -> float:
    """Best FLOP/s of an n x n x n matmul: this machine's reference for the MFU."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    best = min(timed(lambda: a @ b, 1, device) for _ in range(repeats))
    return 2 * n**3 / best


# ---- a batch --------------------------------------------------------------------------------
def store_batch(cfg: DictConfig, setup) -> tuple[dict[str, torch.Tensor], str]:
    """The first micro-batch of the run's row stream, or synthetic rows of the same shapes."""
    from train.batches import PackedRows, collate_rows

    t = cfg.train
    stream = setup.split.train_stream(int(t.max_len), int(cfg.seed))
    rows = PackedRows(setup.split.path, setup.split.train,
                      [stream.row(i)[1] for i in range(int(t.micro_batch))], int(t.max_len),
                      bool(t.loss.last_turn_only))
    return collate_rows([rows[i] for i in range(len(rows))]), f"store {setup.split.path}"


def synthetic_batch(cfg: DictConfig, rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of max_len tokens, 4 samples each, half of the tokens assistant-written."""
    from model.draft import DraftConfig
    from train.batches import collate_rows, pack_row

    d = DraftConfig.from_conf(cfg.draft)
    g = torch.Generator().manual_seed(seed)
    L, H = int(cfg.train.max_len), d.target_hidden_size
    out = []
    for _ in range(rows):
        samples = []
        for n in (L // 4,) * 3 + (L - 3 * (L // 4),):
            samples.append((torch.randint(0, d.vocab_size, (n,), generator=g),
                            torch.rand(n, generator=g) < 0.5,
                            torch.randn(n, d.num_aux, H, generator=g).bfloat16(),
                            torch.randn(n, H, generator=g).bfloat16()))
        out.append(pack_row(samples, L))
    return collate_rows(out)


# ---- steps ---------------------------------------------------------------------------------------
def count_flops(objective: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        objective(batch).loss.backward()
    objective.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def deepspeed_step_time(cfg: DictConfig, objective, batch, total_steps: int, repeats: int) -> float:
    from train import engine as E

    engine = E.initialize(objective, cfg, total_steps)
    batch = {k: v.to(engine.device) for k, v in batch.items()}

    def step() -> None:
        for _ in range(int(cfg.train.grad_accum)):
            engine.backward(engine(batch).loss)
            engine.step()

    seconds = timed(step, repeats, engine.device)
    engine.destroy()
    return seconds


def plain_step_time(cfg: DictConfig, objective, batch, total_steps: int, repeats: int) -> float:
    """The same work without DeepSpeed: torch AdamW, clip_grad_norm_, the same lr schedule."""
    from train.engine import lr_factor, warmup_steps_of

    t = cfg.train
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=float(t.lr), betas=tuple(t.betas), eps=float(t.eps),
                                  weight_decay=float(t.weight_decay))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_factor(warmup_steps_of(t, total_steps), total_steps, float(t.min_lr_ratio)))
    device = next(objective.parameters()).device

    def step() -> None:
        for _ in range(int(t.grad_accum)):
            (objective(batch).loss / int(t.grad_accum)).backward()
        torch.nn.utils.clip_grad_norm_(params, float(t.grad_clip))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(step, repeats, device)


# ---- loss memory ---------------------------------------------------------------------------------
def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def loss_memory_child(T: int, V: int, H: int, chunk_bytes: int) -> dict[str, Any]:
    """In a fresh process: peak memory of one step's chunked loss, forward and backward."""
    from train.objective import ObjectiveConfig, soft_cross_entropy

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    normed = (torch.randn(T, H, generator=g, device=device) / H**0.5).requires_grad_()
    head = torch.randn(V, H, generator=g, device=device) / H**0.5
    target_hidden = torch.randn(T, H, generator=g, device=device)
    target_head = torch.randn(V, H, generator=g, device=device) / H**0.5
    chunk = ObjectiveConfig(1, 1.0, chunk_bytes).chunk_tokens(V)
    start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss, _ = soft_cross_entropy(normed, head, target_hidden, target_head, None, chunk)
        loss.backward()
        torch.cuda.synchronize()
        peak, method = torch.cuda.max_memory_allocated() - base, "torch.cuda.max_memory_allocated"
    else:
        base = _rss_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")      # reset VmHWM, the peak RSS, to now
        loss, _ = soft_cross_entropy(normed, head, target_hidden, target_head, None, chunk)
        loss.backward()
        peak, method = _rss_bytes("VmHWM") - base, "peak RSS above baseline (VmHWM after clear_refs)"
    naive = T * V * 4
    return {"T": T, "V": V, "H": H, "chunk_tokens": chunk, "chunk_bytes": chunk_bytes,
            "peak_bytes": peak, "naive_logits_bytes": naive, "ratio": peak / naive,
            "goal": "<= 1/8 = 0.125", "seconds": time.perf_counter() - start, "method": method,
            "device": device.type, "loss": loss.item()}


def loss_memory(H: int, chunk_bytes: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.train", "--loss-memory", str(KIMI_ROW), str(KIMI_VOCAB), str(H),
                          str(chunk_bytes)], check=True, capture_output=True, text=True, cwd=REPO_ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- main ------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    parser.add_argument("--loss-hidden", type=int, default=128, help="H of the loss-memory measurement")
    parser.add_argument("overrides", nargs="*", help="hydra overrides of conf/train.yaml")
    args = parser.parse_args()

    from train import engine as E
    from train.loop import build_objective, prepare

    cfg = compose_config("train", args.overrides)
    if cfg.train.threads:
        torch.set_num_threads(int(cfg.train.threads))
    E.init_distributed()
    run_dir = REPO_ROOT / "runs/bench-train"
    run_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                              "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                              "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                              "overrides": args.overrides}
    store_ok = (resolve(cfg.store_dir) / "store.json").is_file()
    setup = prepare(cfg, run_dir, 1) if store_ok else None
    if setup is None:          # the model needs the verifier head; shapes follow the draft config
        from types import SimpleNamespace

        from model.draft import DraftConfig
        from model.verifier import verifier_dir

        vdir = verifier_dir(cfg.verifier)
        setup = SimpleNamespace(draft_cfg=DraftConfig.from_conf(cfg.draft, vdir), d2t=None, verifier=vdir)
        batch, source = synthetic_batch(cfg, int(cfg.train.micro_batch)), "synthetic"
    else:
        batch, source = store_batch(cfg, setup)
    tokens = int((batch["segment_ids"] >= 0).sum()) * int(cfg.train.grad_accum)
    total = WARMUP + args.steps
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # 1. DeepSpeed at the configured precision: tokens/s and MFU.
    objective = build_objective(setup, cfg)
    fp32_copy = copy.deepcopy(objective)          # before DeepSpeed changes it in place
    flops = count_flops(copy.deepcopy(objective).to(device, dtype), {k: v.to(device) for k, v in batch.items()})
    flops *= int(cfg.train.grad_accum)
    ds_time = deepspeed_step_time(cfg, objective, batch, total, args.steps)
    peak = matmul_flops(dtype, device)
    report["train"] = {"batch": source, "tokens_per_step": tokens, "precision": cfg.train.precision,
                       "zero_stage": int(cfg.deepspeed.zero_optimization.stage),
                       "ttt_steps": int(cfg.train.ttt.steps), "step_s": ds_time,
                       "tokens_per_s": tokens / ds_time, "step_flops": flops,
                       "step_flop_per_s": flops / ds_time, "matmul_flop_per_s": peak,
                       "mfu": flops / ds_time / peak}
    print(json.dumps(report["train"]), flush=True)

    # 2. DeepSpeed vs plain PyTorch, both fp32.
    fp32 = compose_config("train", [*args.overrides, "train.precision=fp32"])
    plain_model = copy.deepcopy(fp32_copy).to(device)
    ds32 = deepspeed_step_time(fp32, fp32_copy, batch, total, args.steps)
    plain = plain_step_time(fp32, plain_model, {k: v.to(device) for k, v in batch.items()}, total, args.steps)
    report["deepspeed_vs_plain"] = {"precision": "fp32", "deepspeed_step_s": ds32, "plain_step_s": plain,
                                    "deepspeed_over_plain": ds32 / plain}
    print(json.dumps(report["deepspeed_vs_plain"]), flush=True)

    # 3. The chunked loss at Kimi's vocabulary and row length.
    report["loss_memory"] = loss_memory(args.loss_hidden, int(cfg.train.loss.chunk_bytes))
    print(json.dumps(report["loss_memory"]), flush=True)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--loss-memory":
        T, V, H, chunk_bytes = map(int, sys.argv[2:6])
        print(json.dumps(loss_memory_child(T, V, H, chunk_bytes)))
    else:
        main()
