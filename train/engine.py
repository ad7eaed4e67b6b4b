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
by rank 0 once every rank has saved). complete.json records every file of the folder (relative
path: bytes and sha256) and seals itself with the sha256 of its own canonical JSON
(marker_sha256); a checkpoint is resumed from only when the marker and every file it lists
verify, so a partial save, a truncated file or a flipped bit is refused by name, never loaded.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import socket
from collections.abc import Callable, Set
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from infra import FAILPOINTS_ENV, cpu_flags as read_cpu_flags, failpoint
from model.draft import DraftConfig, Eagle3Draft
from train.objective import Eagle3Objective

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
COMPLETE = "complete.json"
MARKER_FORMAT = 1
_MARKER_TMP = f".{COMPLETE}.tmp"
_SEAL = "marker_sha256"
_TAG_PREFIX = "step-"
_CHUNK = 1 << 24
T = TypeVar("T")


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf: the run stops before the optimizer step, saving nothing."""


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded: its save did not finish, or a file changed since."""


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
PRECISIONS = ("auto", "bf16", "fp32")


BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})   # x86 units that run bf16 matmuls natively


def precision_of(precision: str, device_type: str | None = None,
                 cpu_flags: Set[str] | None = None) -> str:
    """train.precision as trained: bf16 | fp32. auto is bf16 on an accelerator, and on a CPU with
    bf16 units (avx512_bf16 or amx_bf16 in cpu_flags; default: this machine's), else fp32:
    - without those units bf16 matmuls take slow fallbacks: on a 2-core x86 machine,
      [2048, 8192] x [8192, 256] took 10.6 s in bf16 against 0.05 s in fp32, a step ~30x longer;
    - with them bf16 is faster: 2,710 against 1,892 tokens/s fp32 (medians of steps 11-100, 2-core
      AMD EPYC with avx512_bf16, the peer setting of bench/recipe.py on `make dump`'s store), held-out
      figures equal within the seed spread. Its memory stays near flat only because micro-batch
      lengths are padded to a grid (train.pad_multiple; free lengths grew 0.78 -> 2.25 GiB over 40
      steps; on a 256-token grid 1.0 GiB at step 20, 1.44-1.56 at 300).
    device_type: default, DeepSpeed's accelerator here."""
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    if device_type is None:
        from deepspeed.accelerator import get_accelerator

        device_type = get_accelerator().device_name()
    if device_type != "cpu":
        return "bf16"
    flags = read_cpu_flags() if cpu_flags is None else cpu_flags
    return "bf16" if BF16_CPU_FLAGS & set(flags) else "fp32"


def deepspeed_config(cfg: DictConfig) -> dict[str, Any]:
    """conf/deepspeed/<stage>.yaml + the training values (batch, precision, optimizer, clipping)."""
    t = cfg.train
    precision = precision_of(t.precision)
    ds = OmegaConf.to_container(cfg.deepspeed, resolve=True)
    assert isinstance(ds, dict)
    ds.pop("name", None)
    return ds | {
        "train_micro_batch_size_per_gpu": int(t.micro_batch),
        "gradient_accumulation_steps": int(t.grad_accum),
        "gradient_clipping": float(t.grad_clip),
        "bf16": {"enabled": precision == "bf16"},
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
    if precision_of(cfg.train.precision) == "bf16":
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


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under root that have a completion marker, oldest first (the marker's
    contents are not checked here: see verify_checkpoint)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(_TAG_PREFIX) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: p.name)


def _digest(path: Path) -> tuple[int, str]:
    """(bytes, sha256) of a file, whose data is also flushed to disk: the marker that records
    it may only exist once what it vouches for would survive a power loss."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return size, h.hexdigest()


def _seal(body: dict[str, Any]) -> bytes:
    """The marker's bytes: body plus the hash of its canonical JSON. Reading back requires these
    exact bytes, so a change of any byte is seen, whitespace included."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    sealed = {**body, _SEAL: hashlib.sha256(canonical).hexdigest()}
    return (json.dumps(sealed, sort_keys=True, indent=1) + "\n").encode()


def _write_marker(folder: Path, record: dict[str, Any]) -> None:
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith((COMPLETE, _MARKER_TMP))):
        size, digest = _digest(path)
        files[path.relative_to(folder).as_posix()] = {"bytes": size, "sha256": digest}
    tmp = folder / _MARKER_TMP
    with open(tmp, "wb") as f:
        f.write(_seal({"format": MARKER_FORMAT, **record, "files": files}))
        f.flush()
        os.fsync(f.fileno())
    failpoint("train.checkpoint.marker_unrenamed")
    os.replace(tmp, folder / COMPLETE)                    # the checkpoint exists from here on
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _read_marker(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(marker, None), or (None, what is wrong with complete.json)."""
    try:
        raw = (folder / COMPLETE).read_bytes()
    except FileNotFoundError:
        return None, f"file {COMPLETE} is missing: the save did not finish (a partial checkpoint)"
    try:
        marker = json.loads(raw)
    except ValueError as e:
        return None, f"file {COMPLETE} is not valid JSON ({e})"
    if not isinstance(marker, dict) or _SEAL not in marker:
        return None, (f"file {COMPLETE} carries no {_SEAL} (damaged, or written by an older version "
                      "that recorded no file hashes)")
    if _seal({k: v for k, v in marker.items() if k != _SEAL}) != raw:
        return None, f"file {COMPLETE} does not match its own checksum ({_SEAL}): it changed after the save"
    return marker, None


def checkpoint_problem(folder: Path) -> str | None:
    """What keeps a checkpoint folder from loading, or None: its marker must be intact and every
    file it lists must still have the recorded size and sha256 (files it does not list, such as
    an export written into the folder later, are not its concern)."""
    marker, problem = _read_marker(folder)
    if marker is None:
        return problem
    for rel, want in marker["files"].items():
        path = folder / rel
        if not path.is_file():
            return f"file {rel} is missing ({COMPLETE} lists it with {want['bytes']} bytes)"
        if path.stat().st_size != want["bytes"]:
            return f"file {rel} has {path.stat().st_size} bytes, {COMPLETE} recorded {want['bytes']}"
        size, digest = _digest(path)
        if (size, digest) != (want["bytes"], want["sha256"]):
            return (f"file {rel} has sha256 {digest[:16]}..., {COMPLETE} recorded {want['sha256'][:16]}...: "
                    "its contents changed after the save")
    return None


def _refusal(folder: Path, problem: str) -> CheckpointError:
    older = [p for p in complete_checkpoints(folder.parent) if p.name < folder.name]
    previous = next((p for p in reversed(older) if checkpoint_problem(p) is None), None)
    hint = (f"the previous complete checkpoint is {previous}; resume from it with train.resume={previous}"
            if previous else "no earlier complete checkpoint verifies (train.resume=null starts over)")
    return CheckpointError(f"checkpoint {folder}: {problem}; {hint}")


def verify_checkpoint(folder: Path) -> dict[str, Any]:
    """The marker of a checkpoint that may be loaded; CheckpointError naming the first file that
    is missing, resized or changed, and the newest older checkpoint that verifies."""
    problem = checkpoint_problem(folder)
    if problem is not None:
        raise _refusal(folder, problem)
    return _read_marker(folder)[0] or {}


def _newest_verified(root: Path) -> Path | None:
    """train.resume=auto: the newest checkpoint that verifies. Newer corrupt ones are logged and
    skipped; when checkpoints exist and none verifies it raises rather than start over."""
    if not root.is_dir():
        return None
    found = complete_checkpoints(root)
    newest = found[-1].name if found else ""
    for partial in sorted(p for p in root.iterdir() if p.name.startswith(_TAG_PREFIX) and p.name > newest
                          and not (p / COMPLETE).exists()):
        logger.warning("checkpoint %s has no %s (its save did not finish): not resumed from", partial, COMPLETE)
    skipped = []
    for folder in reversed(found):
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder
        logger.error("checkpoint %s: %s; skipped, trying an older one", folder, problem)
        skipped.append(f"{folder.name}: {problem}")
    if skipped:
        raise CheckpointError(
            f"train.resume=auto: none of the {len(found)} complete checkpoints under {root} verifies "
            f"({'; '.join(skipped)}); not starting over from scratch: move them aside or set "
            "train.resume=null to train from the beginning")
    return None


def resolve_resume(resume: str | None, root: Path) -> Path | None:
    """train.resume -> the verified checkpoint folder to load, or None for a fresh start.

    null / "never": fresh; "auto": the newest checkpoint under root that verifies, fresh if there
    is none; a path: that checkpoint folder, or the newest complete one in that checkpoints
    folder or run, which must verify. A checkpoint without its marker is never returned."""
    if resume in (None, "never", False):
        return None
    if resume == "auto":
        return _newest_verified(root)
    path = Path(str(resume))
    if (path / COMPLETE).exists() or (path.name.startswith(_TAG_PREFIX) and path.is_dir()):
        verify_checkpoint(path)
        return path
    for folder in (path, path / CHECKPOINTS):
        found = complete_checkpoints(folder)
        if found:
            verify_checkpoint(found[-1])
            return found[-1]
    raise FileNotFoundError(f"train.resume={resume}: no complete checkpoint there")


def _failpoint_after_each_file(engine) -> None:
    """A failpoint between the files DeepSpeed writes (model states, then optimizer states), for
    the fault suite; installed only when failpoints are armed."""
    ckpt = engine.checkpoint_engine
    if FAILPOINTS_ENV not in os.environ or getattr(ckpt, "_failpoint_installed", False):
        return
    save = ckpt.save

    def save_then_failpoint(state_dict: Any, path: str) -> None:
        save(state_dict, path)
        failpoint("train.checkpoint.file_saved")

    ckpt.save, ckpt._failpoint_installed = save_then_failpoint, True


def save_checkpoint(engine, root: Path, step: int, keep: int, client_state: dict[str, Any]) -> Path:
    """Every rank saves its part; rank 0 then records every file's size and sha256 in the marker
    (which makes the checkpoint complete) and prunes old checkpoints."""
    tag = tag_of(step)
    folder = root / tag
    if dist.get_rank() == 0 and root.is_dir():
        # This step's folder and later ones are a killed save's leftovers or checkpoints of a
        # trajectory this run went back from (it resumed from an older checkpoint, or a newer
        # one did not verify): no stale file may mix with the new ones, and once this run has
        # moved on, train.resume=auto must not pick up the abandoned trajectory again.
        for stale in sorted(p for p in root.iterdir() if p.name.startswith(_TAG_PREFIX) and p.name >= tag):
            if (stale / COMPLETE).exists():
                logger.warning("removing checkpoint %s: this run is saving step %d of another trajectory", stale, step)
            shutil.rmtree(stale)
    dist.barrier()
    _failpoint_after_each_file(engine)
    engine.save_checkpoint(str(root), tag=tag, client_state={"step": step, **client_state})
    dist.barrier()
    failpoint("train.checkpoint.before_marker")
    if dist.get_rank() == 0:
        _write_marker(folder, {"step": step, **client_state})
        failpoint("train.checkpoint.after_marker")
        for old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        for partial in root.iterdir():                   # unfinished saves before this one
            if partial.name.startswith(_TAG_PREFIX) and partial.name < tag and not (partial / COMPLETE).exists():
                shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    return folder


def load_checkpoint(engine, folder: Path) -> int:
    """Restore module, optimizer, lr schedule and step from a checkpoint folder that
    resolve_resume returned (hence verified); the step."""
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
