"""The trainer's process group, and the decisions every rank takes together.

One code path for CPU and GPU: DeepSpeed's accelerator picks the device and the backend (gloo
on CPU, NCCL on CUDA).

Launching (see also the Makefile's `train` target):
    python -m train ...                                        one process
    torchrun --standalone --nproc_per_node N -m train ...      N ranks on this machine
    deepspeed --num_gpus N --module train ...                  the same with DeepSpeed's launcher
    deepspeed --hostfile hostfile --module train ...           several nodes ("host slots=8" lines;
        or torchrun --nnodes M --node_rank i --rdzv_endpoint host:port on each node). Every node
        must see the store and the run folder at the same path (a shared file system): rank 0's
        run folder is the one all ranks write checkpoints into.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf: the run stops before the optimizer step, saving nothing."""


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


def on_rank0(compute: Callable[[], T]) -> T:
    """compute() on rank 0 only, its value (or its exception) on every rank: a decision that
    reads the shared run folder is taken once, and a refusal stops all ranks together."""
    value, error = None, None
    if dist.get_rank() == 0:
        try:
            value = compute()
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
    value, error = broadcast_object((value, error))
    if error is not None:
        raise error
    return value


def check_finite(loss: torch.Tensor, step: int, last_checkpoint: Path | None) -> None:
    """Stop every rank together when any rank's loss is NaN or Inf."""
    bad = torch.tensor([0.0 if torch.isfinite(loss).item() else 1.0], device=loss.device)
    if all_reduce_sum(bad).item() > 0:
        kept = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved yet"
        raise NonFiniteLossError(
            f"non-finite training loss ({loss.item()} on rank {dist.get_rank()}) at step {step + 1}: "
            f"stopped before the optimizer step, nothing saved; {kept}. Lower train.lr or check "
            "the store (`python -m dump inspect`), then resume with train.resume=auto.")
