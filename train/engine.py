"""DeepSpeed around the objective: process group, config, checkpoints, resume, NaN stop, export.

One code path for CPU and GPU: DeepSpeed's accelerator picks the device and the backend (gloo
on CPU, NCCL on CUDA). The DeepSpeed config is conf/deepspeed/<stage>.yaml plus the training
values of conf/train.yaml, each of which has its home there.

Launching (see also the Makefile's `train` target):
    python -m train ...                                        one process
    torchrun --standalone --nproc_per_node N -m train ...      N ranks on this machine
    deepspeed --num_gpus N --module train ...                  the same with DeepSpeed's launcher
    deepspeed --hostfile hostfile --module train ...           several nodes ("host slots=8" lines;
        or torchrun --nnodes M --node_rank i --rdzv_endpoint host:port on each node). Every node
        must see the store and the run folder at the same path (a shared file system): rank 0's
        run folder is the one all ranks write checkpoints into.

Checkpoints: <run dir>/checkpoints/step-XXXXXXXX/ (DeepSpeed's files plus complete.json, written
by rank 0 once every rank has saved: only such a checkpoint is ever resumed from).
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from infra import failpoint
from model.draft import DraftConfig, Eagle3Draft
from train.objective import Eagle3Objective

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
COMPLETE = "complete.json"
_TAG_PREFIX = "step-"


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf: the run stops before the optimizer step, saving nothing."""


# ---- process group -------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int]:
    """(rank, world size). A plain `python -m train` gets single-process defaults, so DeepSpeed
    does not go looking for MPI; launchers (torchrun, deepspeed) set these themselves."""
    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()))
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        # Before any collective: NCCL puts a rank's tensors on its current device.
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(verbose=False)
    return dist.get_rank(), dist.get_world_size()


def broadcast_object(value: Any) -> Any:
    """Rank 0's value on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


# ---- DeepSpeed config ----------------------------------------------------------------------
def deepspeed_config(cfg: DictConfig) -> dict[str, Any]:
    """conf/deepspeed/<stage>.yaml + the training values (batch, precision, optimizer, clipping)."""
    t = cfg.train
    if t.precision not in ("bf16", "fp32"):
        raise ValueError(f"train.precision {t.precision!r}: use bf16 or fp32")
    ds = OmegaConf.to_container(cfg.deepspeed, resolve=True)
    assert isinstance(ds, dict)
    ds.pop("name", None)
    return ds | {
        "train_micro_batch_size_per_gpu": int(t.micro_batch),
        "gradient_accumulation_steps": int(t.grad_accum),
        "gradient_clipping": float(t.grad_clip),
        "bf16": {"enabled": t.precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {
            "lr": float(t.lr), "betas": list(t.betas), "eps": float(t.eps),
            "weight_decay": float(t.weight_decay), "torch_adam": bool(t.torch_adam)}},
        "steps_per_print": 2**31 - 1,          # our own logging; keep DeepSpeed's quiet
        "wall_clock_breakdown": False,
    }


def warmup_steps_of(train: DictConfig, total_steps: int) -> int:
    """Warmup length in optimizer steps: train.warmup_steps, or train.warmup_ratio of the run's
    total_steps rounded up (recipes give one of the two, the other null)."""
    steps, ratio = train.get("warmup_steps"), train.get("warmup_ratio")
    if (steps is None) == (ratio is None):
        raise ValueError(f"set exactly one of train.warmup_steps ({steps}) and train.warmup_ratio "
                         f"({ratio}); the other null")
    if steps is not None:
        return int(steps)
    if not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"train.warmup_ratio {ratio} is not a fraction in [0, 1]")
    return math.ceil(float(ratio) * total_steps)


def lr_factor(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step s (0-based): linear warmup from 1/warmup to 1
    over warmup_steps, then cosine down to min_ratio at the last step."""
    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps - 1)
        progress = min(1.0, (s - warmup_steps) / span)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def initialize(objective: Eagle3Objective, cfg: DictConfig, total_steps: int):
    """The DeepSpeed engine training the draft's trainable parameters."""
    import deepspeed

    ds_config = deepspeed_config(cfg)
    if ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
        # The objective reads the draft's lm_head outside lm_head's own forward (chunked loss).
        deepspeed.zero.register_external_parameter(objective, objective.draft.lm_head.weight)
    if cfg.train.precision == "bf16":
        objective.cast_buffers(torch.bfloat16)
    factor = lr_factor(warmup_steps_of(cfg.train, total_steps), total_steps, float(cfg.train.min_lr_ratio))
    engine, *_ = deepspeed.initialize(
        model=objective,
        model_parameters=[p for p in objective.parameters() if p.requires_grad],
        config=ds_config,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor),
    )
    return engine


def zero_stage(engine) -> int:
    return int(engine.zero_optimization_stage())


# ---- checkpoints ---------------------------------------------------------------------------
def tag_of(step: int) -> str:
    return f"{_TAG_PREFIX}{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under root whose every rank finished saving, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(_TAG_PREFIX) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_resume(resume: str | None, root: Path) -> Path | None:
    """train.resume -> the checkpoint folder to load, or None for a fresh start.

    null / "never": fresh; "auto": the newest complete checkpoint under root, fresh if none;
    a path: that checkpoint folder, or the newest complete one in that checkpoints folder or run.
    """
    if resume in (None, "never", False):
        return None
    if resume == "auto":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    path = Path(str(resume))
    if (path / COMPLETE).is_file():
        return path
    for folder in (path, path / CHECKPOINTS):
        found = complete_checkpoints(folder)
        if found:
            return found[-1]
    raise FileNotFoundError(f"train.resume={resume}: no complete checkpoint there")


def save_checkpoint(engine, root: Path, step: int, keep: int, client_state: dict[str, Any]) -> Path:
    """Every rank saves its part; rank 0 marks the checkpoint complete, then prunes old ones."""
    tag = tag_of(step)
    engine.save_checkpoint(str(root), tag=tag, client_state={"step": step, **client_state})
    dist.barrier()
    failpoint("train.checkpoint.before_marker")
    folder = root / tag
    if dist.get_rank() == 0:
        tmp = folder / f".{COMPLETE}.tmp"
        tmp.write_text(json.dumps({"step": step, **client_state}) + "\n")
        os.replace(tmp, folder / COMPLETE)                # the checkpoint exists from here on
        failpoint("train.checkpoint.after_marker")
        for old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return folder


def load_checkpoint(engine, folder: Path) -> int:
    """Restore module, optimizer, lr schedule and step from a checkpoint folder; the step."""
    _, client = engine.load_checkpoint(str(folder.parent), tag=folder.name)
    if client is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint {folder}")
    return int(client["step"])


def check_finite(loss: torch.Tensor, step: int, last_checkpoint: Path | None) -> None:
    """Stop every rank together when any rank's loss is NaN or Inf."""
    bad = torch.tensor([0.0 if torch.isfinite(loss).item() else 1.0], device=loss.device)
    if all_reduce_sum(bad).item() > 0:
        kept = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved yet"
        raise NonFiniteLossError(
            f"non-finite training loss ({loss.item()} on rank {dist.get_rank()}) at step {step + 1}: "
            f"stopped before the optimizer step, nothing saved; {kept}. Lower train.lr or check "
            "the store (`python -m dump inspect`), then resume with train.resume=auto.")


# ---- export --------------------------------------------------------------------------------
def gathered_draft_state(engine) -> dict[str, torch.Tensor]:
    """The draft's state_dict in fp32 on the CPU, on every rank (collective under ZeRO-3)."""
    import deepspeed

    draft = engine.module.draft
    with deepspeed.zero.GatheredParameters(list(draft.parameters()), enabled=zero_stage(engine) == 3):
        return {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype, copy=True)
                for k, v in draft.state_dict().items()}


def draft_from_state(cfg: DraftConfig, state: dict[str, torch.Tensor], d2t: torch.Tensor | None) -> Eagle3Draft:
    """A CPU fp32 draft holding `state` (keys as Eagle3Draft.state_dict names them)."""
    draft = Eagle3Draft(cfg)
    wanted = draft.state_dict()
    missing = [k for k in wanted if k not in state and k not in ("d2t", "t2d")]
    if missing:
        raise KeyError(f"the training state lacks {missing}")
    draft.load_state_dict({k: state[k] for k in wanted if k in state}, strict=False)
    if d2t is not None:
        draft.set_vocab(d2t)
    return draft


def consolidated_checkpoint_state(folder: Path) -> dict[str, torch.Tensor]:
    """The draft's fp32 weights from a DeepSpeed checkpoint folder (any ZeRO stage, any ranks)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    prefix = "draft."
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
