"""The trainer's CPU kernels against the ones before them, step by step in one process:
`python -m bench.train_kernels [--pairs 60] [--store DIR] [--out bench/results/train_kernels.json]`.

Two kernels of a training step changed (f01deee): the fused attention kernel takes bf16 operands
where the training runs in bf16 (model/ttt_attention.py `_kernel_dtype`; before: fp32), and the
losses' top-1 goes through the blocked argmax (train/logit_blocks.py `row_argmax`; before: torch's
argmax). On a shared 2-core machine two whole training runs an hour apart differ by more than such
a change (the demo's training ran at 1,874 and 3,046 tokens/s on the same store), so this runs both
in one trainer on the same micro-batches: pair i is one optimizer step with each, on the same two
micro-batches, in alternating order; the first `--warmup` pairs are not counted (the CPU's bf16
kernels are built per shape). Reported: the median of the per-pair time ratios (before / now) and
its quartiles, and each arm's median step time. The trainer is the defaults' (`python -m train`
on the store of `make dump`); the weights move at every step of either arm, as in training.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import infra

infra.configure_environment()

import config  # noqa: E402

config.register()

import torch  # noqa: E402

import model.ttt_attention as ttt_attention  # noqa: E402
import train.logit_blocks as logit_blocks  # noqa: E402
import train.soft_ce as soft_ce  # noqa: E402
import train.topk_ce as topk_ce  # noqa: E402
from bench.machine import machine  # noqa: E402

OUT = infra.REPO_ROOT / "bench" / "results" / "train_kernels.json"
NOW = (ttt_attention._kernel_dtype, logit_blocks.row_argmax)


def _fp32_kernel(q: torch.Tensor) -> torch.dtype:
    return ttt_attention._accumulation_dtype(q)


def _torch_argmax(z: torch.Tensor) -> torch.Tensor:
    return z.argmax(-1)


def use(arm: str) -> None:
    """Point the two kernels at `arm`'s: "now" (the code's) or "before"."""
    ttt_attention._kernel_dtype = NOW[0] if arm == "now" else _fp32_kernel
    argmax = NOW[1] if arm == "now" else _torch_argmax
    logit_blocks.row_argmax = soft_ce.row_argmax = topk_ce.row_argmax = argmax


def measure(pairs: int, warmup: int, store: str | None, run_dir: Path) -> dict[str, Any]:
    from config import compose_config
    from model.batch import PAD_SEGMENT
    from train.batches import PackedRows, make_loader, rank_rows
    from train.loop import WholeStore, start_trainer

    overrides = ["train.export=false"] + ([f"store_dir={store}"] if store else [])
    cfg = compose_config("train", overrides)
    trainer = start_trainer(cfg, run_dir)
    t = cfg.train
    segment = next(iter(WholeStore(trainer.setup, cfg).segments(0)))
    plan = rank_rows(segment.stream, 0, segment.steps, t.micro_batch, t.grad_accum, 0, 1)
    rows = PackedRows(trainer.setup.split.path, segment.refs, [r for _, r in plan], t.max_len,
                      t.loss.last_turn_only)
    loader = make_loader(rows, t.micro_batch, 0, None, t.pad_multiple, trainer.sequence.slicer)
    batches = list(itertools.islice(iter(loader), t.grad_accum * (pairs + warmup)))
    times: dict[str, list[float]] = {"before": [], "now": []}
    for i in range(pairs + warmup):
        step_batches = batches[t.grad_accum * i: t.grad_accum * (i + 1)]
        for arm in (("before", "now") if i % 2 == 0 else ("now", "before")):
            use(arm)
            began = time.perf_counter()
            trainer.step(iter(step_batches), 2 * i)
            if i >= warmup:
                times[arm].append(time.perf_counter() - began)
    use("now")
    trainer.engine.destroy()
    ratios = [b / n for b, n in zip(times["before"], times["now"])]
    tokens = [sum(int((b.segment_ids != PAD_SEGMENT).sum()) for b in batches[t.grad_accum * i: t.grad_accum * (i + 1)])
              for i in range(warmup, pairs + warmup)]
    return {"pairs": pairs, "warmup_pairs": warmup,
            "step_time_ratio_before_over_now": {"median": statistics.median(ratios),
                                                "quartiles": statistics.quantiles(ratios, n=4)},
            "median_step_s": {arm: statistics.median(v) for arm, v in times.items()},
            "median_tokens_per_step": statistics.median(tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--store", default=None, help="default: the store `make dump` writes")
    parser.add_argument("--run", type=Path, default=infra.REPO_ROOT / "runs" / "bench-train-kernels")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    result = {"what": "the trainer's bf16 fused attention and blocked argmax against fp32 and torch's argmax, "
                      "paired optimizer steps in one process",
              "command": f"python -m bench.train_kernels --pairs {args.pairs} --warmup {args.warmup}",
              "date": time.strftime("%Y-%m-%d"), "machine": machine(),
              **measure(args.pairs, args.warmup, args.store, args.run)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
