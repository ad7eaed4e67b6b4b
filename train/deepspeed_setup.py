"""The DeepSpeed engine around the objective: its config, the trained precision, the lr schedule.

The DeepSpeed config is conf/deepspeed/<stage>.yaml plus the training values of conf/train.yaml,
each of which has its home there.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Set
from typing import Any

import torch
from omegaconf import OmegaConf

from config.choices import Precision, names
from config.stages import TrainConf, TrainJob
from config.validate import warmup_problems
from infra import has_bf16_units
from train.objective import Eagle3Objective

def precision_of(precision: str, device_type: str | None = None,
                 cpu_flags: Set[str] | None = None) -> str:
    """train.precision as trained: bf16 | fp32. auto is bf16 on an accelerator, and on a CPU with
    bf16 units (avx512_bf16 or amx_bf16 in cpu_flags; default: this machine's), else fp32:
    without those units bf16 matmuls take slow fallbacks, with them bf16 trains faster to the same
    held-out figures (docs/benchmarks.md, "Which CPUs"). Its memory stays near flat only because
    micro-batch lengths are padded to a grid (train.pad_multiple).
    device_type: default, DeepSpeed's accelerator here."""
    if precision not in names(Precision):
        raise ValueError(f"train.precision {precision!r}: use one of {', '.join(names(Precision))}")
    if precision != "auto":
        return precision
    if device_type is None:
        from deepspeed.accelerator import get_accelerator

        device_type = get_accelerator().device_name()
    if device_type != "cpu":
        return "bf16"
    return "bf16" if has_bf16_units(cpu_flags) else "fp32"


def peak_lr(train: TrainConf, total_steps: int | None) -> float:
    """The lr after warmup: train.lr, or for a run of more than train.lr_tuned_steps steps
    lr x sqrt(lr_tuned_steps / total_steps). With a cosine schedule the best peak falls as a run
    grows longer (at kimi-tiny's 300 steps 1.7e-3 against the 3e-3 tuned at 100, both seeds:
    bench/results/lr_horizon.json); a run of unknown length (train.follow) keeps train.lr."""
    if train.lr_tuned_steps is None or total_steps is None or total_steps <= train.lr_tuned_steps:
        return train.lr
    return train.lr * math.sqrt(train.lr_tuned_steps / total_steps)


def deepspeed_config(cfg: TrainJob, total_steps: int | None = None) -> dict[str, Any]:
    """conf/deepspeed/<stage>.yaml + the training values (batch, precision, optimizer, clipping);
    total_steps: the run's length, for its peak lr (peak_lr)."""
    t = cfg.train
    precision = precision_of(t.precision)
    ds = OmegaConf.to_container(cfg.deepspeed, resolve=True)
    assert isinstance(ds, dict)
    ds.pop("name", None)
    return ds | {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "bf16": {"enabled": precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {
            "lr": peak_lr(t, total_steps), "betas": list(t.betas), "eps": t.eps,
            "weight_decay": t.weight_decay, "torch_adam": t.torch_adam,
            # torch's fused kernel: on a CPU the default single-tensor step makes two temporaries
            # the size of the fp32 weights (ZeRO keeps them in one flat tensor): 5 GB for the
            # Kimi-K2 draft, besides the moments, and it is slower.
            **({"fused": True} if t.torch_adam else {})}},
        "steps_per_print": 2**31 - 1,          # our own logging; keep DeepSpeed's quiet
        "wall_clock_breakdown": False,
    }


def warmup_steps_of(train: TrainConf, total_steps: int | None) -> int:
    """Warmup length in optimizer steps: train.warmup_steps, or train.warmup_ratio of the run's
    total_steps rounded up (recipes give one of the two, the other null)."""
    steps, ratio = train.warmup_steps, train.warmup_ratio
    problems = warmup_problems(steps, ratio)
    if problems:
        raise ValueError("; ".join(problems))
    if steps is not None:
        return steps
    if total_steps is None:
        raise ValueError(f"train.warmup_ratio {ratio} needs the run's length, which a run following a dump "
                         "(train.follow) does not know: set train.warmup_steps (and train.warmup_ratio=null), "
                         "or train.steps")
    return math.ceil(ratio * total_steps)


def lr_factor(warmup_steps: int, total_steps: int | None, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step s (0-based): linear warmup from 1/warmup to 1
    over warmup_steps, then cosine down to min_ratio at the last step. total_steps None (a run that
    follows a dump, its length unknown): the peak after warmup."""
    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        if total_steps is None:
            return 1.0
        span = max(1, total_steps - warmup_steps - 1)
        progress = min(1.0, (s - warmup_steps) / span)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def param_groups(objective: Eagle3Objective, lr: float, head_lr_scale: float) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: the trainable parameters at `lr`, a trainable lm_head at
    lr x head_lr_scale (one group while the scale is 1 or the head is frozen). The schedule
    (LambdaLR) scales each group's own lr."""
    head = objective.draft.lm_head.weight
    trainable = [p for p in objective.parameters() if p.requires_grad]
    if head_lr_scale == 1.0 or not any(p is head for p in trainable):
        return [{"params": trainable}]
    return [{"params": [p for p in trainable if p is not head]},
            {"params": [head], "lr": lr * head_lr_scale}]


def initialize(objective: Eagle3Objective, cfg: TrainJob, total_steps: int | None, mpu: Any = None):
    """The DeepSpeed engine training the draft's trainable parameters. mpu: DeepSpeed's
    sequence-parallel groups (train/sequence_parallel.py SequenceParallel.mpu), None without: with
    them ZeRO reduces and partitions over every rank and averages over the data-parallel groups."""
    import deepspeed

    ds_config = deepspeed_config(cfg, total_steps)
    head = objective.draft.lm_head.weight
    if ds_config.get("zero_optimization", {}).get("stage", 0) == 3 and isinstance(head, torch.nn.Parameter):
        # The objective reads the draft's lm_head outside lm_head's own forward (chunked loss); a
        # head that is the verifier's is a buffer, which ZeRO-3 leaves whole.
        deepspeed.zero.register_external_parameter(objective, head)
    if precision_of(cfg.train.precision) == "bf16":
        objective.cast_buffers(torch.bfloat16)
    factor = lr_factor(warmup_steps_of(cfg.train, total_steps), total_steps, cfg.train.min_lr_ratio)
    engine, *_ = deepspeed.initialize(
        model=objective,
        model_parameters=param_groups(objective, ds_config["optimizer"]["params"]["lr"], cfg.train.head_lr_scale),
        config=ds_config,
        mpu=mpu,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor),
    )
    return engine


def zero_stage(engine) -> int:
    return int(engine.zero_optimization_stage())
