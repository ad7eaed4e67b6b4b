"""Per-rank memory plan of a draft training run, from the meta-device model: before anyone
allocates GPUs.

    python -m train plan [hydra overrides of conf/train.yaml] [plan.world_size=8] [--json FILE]
    python -m train plan verifier=kimi_k2 draft=kimi_k2 deepspeed=zero3 plan.world_size=16
    python -m train plan ... plan.world_size=8 train.max_len=131072 train.sequence_parallel=8

The model, the batch and one training micro-step (forward with train.ttt.steps TTT steps, the
chunked loss, backward) run on the meta device: shapes and dtypes are real, no memory and no
compute is spent, so the plan for a 7168-wide draft on 8192-token rows takes seconds on a laptop.

Rows, bytes per rank. Psi = trainable parameters, N = world size (with sequence parallelism too,
below), p = bytes of the training dtype (2 in bf16, 4 in fp32). ZeRO stages as DeepSpeed's
stage-1/2 and stage-3 optimizers hold them;
stage 0 is no ZeRO (one process, or plain data parallel with mixed-precision AdamW, as
bench/gpu_train.py's plain step):

  parameters      trainable weights: p*Psi; ZeRO-3: p*Psi/N, plus the full weights of tensors
                  under stage3_param_persistence_threshold (the norms), which stay whole
  gradients       p*Psi (stage 0/1: every rank accumulates whole gradients); ZeRO-2/3: the rank's
                  partition p*Psi/N plus one reduce bucket (reduce_bucket_size elements)
  optimizer       AdamW: fp32 master copy 4*Psi and two fp32 moments 8*Psi, divided by N at ZeRO
                  stages 1-3 (stage 0 in fp32 has no master copy: the weights are the master)
  frozen verifier the draft's frozen embedding [V, H] and the verifier's lm_head [V, H] (buffers:
                  never partitioned, whole on every rank at every stage; a draft of the full
                  vocabulary with a frozen head reads the verifier's lm_head itself, so it is one
                  tensor), the draft's frozen final norm, and a pruned or trained draft lm_head
                  (parameters; ZeRO-3 partitions them, but the objective reads lm_head outside its
                  module, so it is gathered whole for the entire forward and backward: counted
                  whole). On a GPU each rank holds its copy; ranks on one CPU machine map the
                  verifier's files and share one (train/loop.py build_objective)
  micro-batch     the packed rows on the device: aux [B, T, n_aux*H] and final [B, T, H] in bf16,
                  ids, loss mask, positions, segments; with SP, the rank's T/SP positions of each
                  row and the halo after them (the longest TTT chain + 1 rows, read ahead)
  activations     tensors autograd saves for the backward, at the end of the forward: measured by
                  running the real objective on meta tensors under saved_tensors_hooks and summing
                  the bytes of their storages (deduplicated; weights and the batch excluded). Every
                  position is counted by the loss (an upper bound: real rows count only the
                  assistant's tokens). Split in two, for reference: the attention cores' (the TTT
                  cache k/v, q, out, lse and the fp32 copies attention saves) and the per-token
                  parts' (fc, embedding, norms, projections, MLP, loss)
  loss chunk      the chunked loss's [chunk, V] blocks (train/logit_blocks.py), for
                  reference: they are part of the forward/backward peak
  forward/backward peak
                  the step's own tensors at their highest over forward and backward: activations,
                  temporaries, the loss chunk, each parameter gradient until DeepSpeed moves it
                  into its buffers; measured on meta by following every storage the step creates
                  until it is freed
  all-to-all buffers
                  with SP: the send and receive buffers of the largest all-to-all (inside the peak)
  ZeRO-3 gathers  the largest trainable module gathered whole plus one prefetch bucket
                  (stage3_prefetch_bucket_size elements), held during forward and backward
  optimizer step  the fp32 gradient partition DeepSpeed builds for the step (4*Psi/N; stage 0:
                  the fp32 gradients of the master copy), after the backward has freed the rest

  total = parameters + gradients + optimizer + frozen + micro-batch
          + max(forward/backward peak + ZeRO-3 gathers, optimizer step)

Sequence parallelism (train.sequence_parallel = SP, DeepSpeed-Ulysses, train/sequence_parallel.py):
the world forms world/SP data-parallel groups of SP ranks, each rank of a group running the draft on
T/SP positions of every row. ZeRO partitions over every rank of the world, as the trainer's
DeepSpeed does (its sequence-data-parallel group): N stays the world size. The step is measured as
one rank of the group runs it (train/plan_ulysses.py): the per-token parts on T/SP positions, the
attention core over the full T for heads/SP heads behind an all-to-all over heads, the TTT cache k/v
kept in that layout (full T, heads/SP); the all-to-all's buffers are allocated on meta like the
rest. The plan refuses an SP that does not divide the world size or the draft's heads.

Not counted: the CUDA context and NCCL buffers (a few hundred MB to ~1 GB per GPU), the caching
allocator's fragmentation, DeepSpeed's flat-buffer alignment padding, the DataLoader's pinned
host memory.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.fx.experimental._config  # noqa: F401  (meta nonzero switch used in measure_step)
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from config.stages import TrainJob
from model.batch import Batch
from model.draft import DraftConfig, build_draft
from model.verifier_weights import VerifierHead
from train.deepspeed_setup import precision_of
from train.logit_blocks import LogitBlocks
from train.objective import Eagle3Objective, ObjectiveConfig
from train import sequence_parallel
from train.plan_ulysses import MetaAttentionCore, install_attention_cores

GIB = 1024**3
# DeepSpeed's defaults where a conf/deepspeed file leaves the key out.
DS_REDUCE_BUCKET = 500_000_000
DS_PREFETCH_BUCKET = 50_000_000
DS_PERSISTENCE_THRESHOLD = 100_000


# ---- measuring one micro-step ----------------------------------------------------------------
def _storage_key(t: Tensor) -> int:
    """Identity of a tensor's storage (views share it); meta storages have no data pointer."""
    return t.untyped_storage()._cdata


class LiveStorageBytes(TorchDispatchMode):
    """Bytes of the storages that operators create under this mode and that are still alive, and
    their peak. Views and in-place results alias an existing storage and add nothing; a storage is
    released when its last tensor (autograd's saved copies included) is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = [r.alias_info is None for r in func._schema.returns]
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for is_fresh, value in zip(fresh, outputs):
            if not is_fresh:
                continue
            for t in tree_leaves(value):
                if isinstance(t, Tensor):
                    self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.live += self._sizes[key]
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)


@dataclass(frozen=True)
class StepMemory:
    saved_bytes: int                 # storages autograd holds for backward at the end of the forward
    live_after_forward: int          # every storage the forward created and still holds
    peak_bytes: int                  # the step's own storages at their peak, forward + backward
    largest_saved: list[dict[str, Any]] = field(default_factory=list)   # biggest saved shapes
    attention_saved_bytes: int = 0   # of saved_bytes, the attention cores' (cores given) and their inputs
    largest_exchange: int = 0        # bytes of the largest tensor a sequence-parallel all-to-all sent


def _drop_grad(p: Tensor) -> None:
    # DeepSpeed copies each gradient into its bucket / partition as soon as it is accumulated.
    p.grad = None


def measure_step(objective: Eagle3Objective, batch: Batch, steps: int | None = None,
                 cores: Sequence[MetaAttentionCore] = ()) -> StepMemory:
    """One training micro-step (objective forward, backward) with its memory accounted for.

    Runs on any device: on meta it costs neither memory nor compute (the loss then counts every
    position: torch's meta nonzero assumes all elements set). Weights, buffers and the batch exist
    before and are not the step's; parameter gradients are dropped as soon as they are accumulated
    (they are the gradients row). With the objective's attention cores (install_attention_cores),
    what they save and the q and TTT cache they read are counted apart too."""
    owned = {_storage_key(t) for t in (*objective.parameters(), *objective.buffers(), *batch.tensors().values())}
    saved: dict[int, int] = {}
    in_attention: set[int] = set()
    shapes: Counter[tuple[tuple[int, ...], torch.dtype]] = Counter()

    def pack(t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key not in owned and key not in saved:
            saved[key] = t.untyped_storage().nbytes()
            shapes[(tuple(t.shape), t.dtype)] += 1
            if any(core.running for core in cores):
                in_attention.add(key)
        return t

    hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in objective.parameters() if p.requires_grad]
    live = LiveStorageBytes()
    try:
        with torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True), live:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = objective(batch, steps)
            live_after_forward = live.live
            attention = {key for key in saved if key in in_attention or any(key in c.read for c in cores)}
            out.loss.backward()
            del out
    finally:
        for hook in hooks:
            hook.remove()
    largest = [{"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "count": n,
                "bytes_each": math.prod(shape) * dtype.itemsize} for (shape, dtype), n in shapes.items()]
    largest.sort(key=lambda r: -r["bytes_each"] * r["count"])
    return StepMemory(sum(saved.values()), live_after_forward, live.peak, largest[:6],
                      sum(saved[key] for key in attention), max((c.largest_exchange for c in cores), default=0))


# ---- the model and batch on meta -------------------------------------------------------------
def meta_objective(draft_cfg: DraftConfig, objective_cfg: ObjectiveConfig, dtype: torch.dtype) -> Eagle3Objective:
    """The training module as DeepSpeed holds it: weights in the training dtype, the frozen
    verifier tensors in it too, the lm_head the draft's and the targets' where the draft shares the
    verifier's (train/loop.py build_objective)."""
    draft = build_draft(draft_cfg, "meta")
    V, H = draft_cfg.vocab_size, draft_cfg.hidden_size
    head = VerifierHead(torch.empty(V, H, dtype=dtype, device="meta"), torch.empty(H, dtype=dtype, device="meta"),
                        torch.empty(V, H, dtype=dtype, device="meta"))
    draft.take_verifier_head(head)
    target_head = draft.lm_head.weight if draft.lm_head.weight is head.lm_head else head.lm_head
    objective = Eagle3Objective(draft, target_head, objective_cfg).to(dtype)
    objective.cast_buffers(dtype)
    return objective


def meta_batch(draft_cfg: DraftConfig, rows: int, max_len: int, device: torch.device | str = "meta"
               ) -> Batch:
    """A micro-batch of `rows` full rows of max_len tokens (model/batch.py's fields and dtypes)."""
    B, T, H = rows, max_len, draft_cfg.target_hidden_size
    long = dict(dtype=torch.long, device=device)
    return Batch(input_ids=torch.zeros(B, T, **long), loss_mask=torch.ones(B, T, dtype=torch.bool, device=device),
                 aux=torch.zeros(B, T, draft_cfg.num_aux * H, dtype=torch.bfloat16, device=device),
                 position_ids=torch.zeros(B, T, **long), segment_ids=torch.zeros(B, T, **long),
                 final=torch.zeros(B, T, H, dtype=torch.bfloat16, device=device))


def loss_chunk_bytes(draft_cfg: DraftConfig, objective_cfg: ObjectiveConfig, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of the chunked loss's blocks for `tokens` counted positions (one pass)."""
    chunk = min(objective_cfg.chunk_tokens(draft_cfg.draft_vocab_size), tokens)
    blocks = LogitBlocks(chunk, draft_cfg.vocab_size, draft_cfg.draft_vocab_size, draft_cfg.pruned, dtype,
                     torch.device("meta"))
    return sum(t.untyped_storage().nbytes() for t in vars(blocks).values() if isinstance(t, Tensor))


# ---- the plan ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanSpec:
    """What the plan depends on besides the draft's shapes."""

    world_size: int
    zero_stage: int                   # 0 (no ZeRO), 1, 2, 3
    max_len: int                      # tokens per packed row
    micro_batch: int                  # rows per rank per micro-step
    precision: str                    # bf16 | fp32
    ttt_steps: int
    ttt_decay: float
    chunk_bytes: int
    reduce_bucket_size: int = DS_REDUCE_BUCKET           # elements
    prefetch_bucket_size: int = DS_PREFETCH_BUCKET       # elements (ZeRO-3)
    param_persistence_threshold: int = DS_PERSISTENCE_THRESHOLD   # elements (ZeRO-3)
    sequence_parallel: int = 1        # ranks splitting each row (Ulysses)
    halo: int = 0                     # rows past its slice a sequence-parallel rank's cut carries
    recompute: bool = False           # each TTT step recomputed in the backward (train.recompute)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    @property
    def data_parallel(self) -> int:
        """The data-parallel groups, which take different rows: the world divided by the SP group."""
        return self.world_size // self.sequence_parallel

    @property
    def tokens_per_rank(self) -> int:
        """Positions of each row a rank of the sequence-parallel group runs the draft on (T/SP,
        rounded up: the trainer pads the rows to a multiple of SP)."""
        return -(-self.max_len // self.sequence_parallel)

    def objective_config(self) -> ObjectiveConfig:
        return ObjectiveConfig(steps=self.ttt_steps, decay=self.ttt_decay, chunk_bytes=self.chunk_bytes,
                               recompute=self.recompute)


def spec_from_cfg(cfg: TrainJob, world_size: int) -> PlanSpec:
    """The plan's inputs from a composed conf/train.yaml (its deepspeed group gives the stage)."""
    t = cfg.train
    # DeepSpeed's own table, as written: a key it leaves out takes DeepSpeed's default.
    zero = OmegaConf.to_container(cfg.deepspeed.zero_optimization, resolve=True)
    # A plan sizes GPU runs: auto is what it resolves to on an accelerator.
    return PlanSpec(world_size=world_size, zero_stage=zero["stage"], max_len=t.max_len,
                    micro_batch=t.micro_batch, precision=precision_of(t.precision, "cuda"), ttt_steps=t.ttt.steps,
                    ttt_decay=t.ttt.decay, chunk_bytes=t.loss.chunk_bytes,
                    reduce_bucket_size=zero.get("reduce_bucket_size", DS_REDUCE_BUCKET),
                    prefetch_bucket_size=zero.get("stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET),
                    param_persistence_threshold=zero.get("stage3_param_persistence_threshold",
                                                         DS_PERSISTENCE_THRESHOLD),
                    sequence_parallel=t.sequence_parallel, recompute=t.recompute,
                    halo=_halo(cfg))


def _halo(cfg: TrainJob) -> int:
    """The rows past its slice each cut carries (train/sequence_parallel.py RowSlice): the longest
    TTT chain, training's or the held-out one's, reads that far ahead."""
    if cfg.train.sequence_parallel == 1:
        return 0
    return max(cfg.train.ttt.steps, cfg.eval.ttt_steps) + 1


@dataclass
class PlanRow:
    name: str
    bytes: int
    note: str
    in_total: bool = True             # false: shown for reference, already inside another row


@dataclass
class MemoryPlan:
    draft: str
    spec: PlanSpec
    trainable_params: int
    frozen_params: int
    rows: list[PlanRow]
    total_bytes: int
    step: StepMemory

    def to_json(self) -> dict[str, Any]:
        # ZeRO partitions over zero_ranks (every rank, with sequence parallelism too); the
        # data_parallel groups (world_size / sequence_parallel) take different rows.
        spec = {**asdict(self.spec), "zero_ranks": self.spec.world_size, "data_parallel": self.spec.data_parallel,
                "tokens_per_rank": self.spec.tokens_per_rank}
        return {"draft": self.draft, "spec": spec, "trainable_params": self.trainable_params,
                "frozen_params": self.frozen_params, "rows": [asdict(r) for r in self.rows],
                "total_bytes": self.total_bytes, "total_gib": self.total_bytes / GIB,
                "step": asdict(self.step)}

    def table(self) -> str:
        s = self.spec
        ranks = f"{s.world_size} rank{'' if s.world_size == 1 else 's'}"
        zero = f"ZeRO-{s.zero_stage}"
        if s.sequence_parallel > 1:
            ranks += f" = sequence parallel {s.sequence_parallel} x {s.data_parallel} data-parallel"
            zero += (f" over all {s.world_size} ranks, {s.tokens_per_rank} positions of each row per rank")
        head = (f"{self.draft}: {ranks}, {zero}, {s.precision}, T {s.max_len} x "
                f"micro-batch {s.micro_batch}, TTT {s.ttt_steps}; trainable {self.trainable_params / 1e6:.1f} M, "
                f"frozen {self.frozen_params / 1e6:.1f} M parameters")
        width = max(len(r.name) for r in self.rows)
        lines = [head, f"  {'per rank':<{width}}  {'GiB':>9}", f"  {'-' * width}  {'-' * 9}"]
        for r in self.rows:
            gib = f"{r.bytes / GIB:9.2f}" if r.in_total else f"({r.bytes / GIB:7.2f})"
            lines.append(f"  {r.name:<{width}}  {gib}  {r.note}")
        lines.append(f"  {'total (peak)':<{width}}  {self.total_bytes / GIB:9.2f}")
        lines.append("  largest saved activations: " + "; ".join(
            f"{r['count']} x {r['shape']} {r['dtype']} ({r['bytes_each'] / GIB:.2f} GiB each)"
            for r in self.step.largest_saved[:3]))
        return "\n".join(lines)


def _module_param_bytes(objective: nn.Module, itemsize: int) -> int:
    """The largest trainable module's own weights (ZeRO-3 gathers a module's weights whole)."""
    sizes = [sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad) for m in objective.modules()]
    return max(sizes, default=0) * itemsize


class PlanRefused(ValueError):
    """A training layout no run can have (python -m train plan prints the reason)."""


def check_sequence_parallel(draft_cfg: DraftConfig, spec: PlanSpec) -> None:
    """Refuse what the trainer refuses: an SP group that does not divide the world or the draft's
    attention heads."""
    try:
        sequence_parallel.check_sequence_parallel(spec.sequence_parallel, spec.world_size,
                                                  draft_cfg.num_attention_heads)
    except ValueError as error:
        raise PlanRefused(f"plan.world_size={spec.world_size}: {error}") from None


def memory_plan(draft_cfg: DraftConfig, spec: PlanSpec, name: str = "") -> MemoryPlan:
    """The per-rank plan; the micro-step is measured on meta (with sequence parallelism, as one rank
    of the group runs it: train/plan_ulysses.py)."""
    if spec.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {spec.zero_stage}: 0 (none), 1, 2 or 3")
    check_sequence_parallel(draft_cfg, spec)
    N, stage, p = spec.world_size, spec.zero_stage, spec.dtype.itemsize
    objective = meta_objective(draft_cfg, spec.objective_config(), spec.dtype)
    cores = install_attention_cores(objective, spec.sequence_parallel)
    trainable = [t for t in objective.parameters() if t.requires_grad]
    frozen = [t for t in objective.parameters() if not t.requires_grad]
    psi = sum(t.numel() for t in trainable)
    shard = -(-psi // N) if stage >= 1 else psi                         # DeepSpeed pads to N shards

    if stage == 3:
        persistent = sum(t.numel() for t in trainable if t.numel() <= spec.param_persistence_threshold)
        params = p * (-(-(psi - persistent) // N) + persistent)
        params_note = "trainable, partitioned (small tensors whole)"
    else:
        params, params_note = p * psi, "trainable, whole on every rank"
    if stage >= 2:
        bucket = min(spec.reduce_bucket_size, psi)
        grads, grads_note = p * (shard + bucket), f"partition + reduce bucket of {bucket / 1e6:.0f} M"
    else:
        grads, grads_note = p * psi, "whole on every rank"
    master = 0 if (stage == 0 and spec.dtype == torch.float32) else 4 * shard
    optimizer = master + 8 * shard
    optimizer_note = ("fp32 master + 2 fp32 moments" if master else "2 fp32 moments") + (
        ", partitioned" if stage >= 1 else "")
    frozen_storages = {_storage_key(t): t.untyped_storage().nbytes() for t in (*objective.buffers(), *frozen)}
    frozen_bytes = sum(frozen_storages.values())
    # The draft runs on the rank's positions only; the halo rows are read by the shifts alone.
    batch = meta_batch(draft_cfg, spec.micro_batch, spec.tokens_per_rank)
    cut = meta_batch(draft_cfg, spec.micro_batch, spec.tokens_per_rank + spec.halo)
    batch_bytes = sum(t.untyped_storage().nbytes() for t in cut.tensors().values())
    step = measure_step(objective, batch, spec.ttt_steps, cores)
    tokens = spec.micro_batch * spec.tokens_per_rank
    chunk_tokens = min(spec.objective_config().chunk_tokens(draft_cfg.draft_vocab_size), tokens)
    chunk = loss_chunk_bytes(draft_cfg, spec.objective_config(), tokens, spec.dtype)
    gathers = (_module_param_bytes(objective, p) + p * spec.prefetch_bucket_size) if stage == 3 else 0
    step_grad = 4 * shard

    rows = [
        PlanRow("parameters", params, params_note),
        PlanRow("gradients", grads, grads_note),
        PlanRow("optimizer states", optimizer, optimizer_note),
        PlanRow("frozen verifier tensors", frozen_bytes,
                "embedding, lm_head (one, where the draft's is the verifier's), norm: whole on every rank"),
        PlanRow("micro-batch", batch_bytes, "aux + final states (bf16), ids, masks" + (
            f": {spec.tokens_per_rank} positions of each row + {spec.halo} read ahead"
            if spec.sequence_parallel > 1 else "")),
        PlanRow("activations (saved)", step.saved_bytes, "saved for backward, every position counted",
                in_total=False),
        PlanRow("  per-token parts", step.saved_bytes - step.attention_saved_bytes,
                f"fc, embedding, norms, projections, MLP, loss: {spec.tokens_per_rank} tokens", in_total=False),
        PlanRow("  attention core", step.attention_saved_bytes,
                f"TTT cache k/v + attention's saved tensors: T {spec.tokens_per_rank * spec.sequence_parallel}, "
                f"{draft_cfg.num_attention_heads // spec.sequence_parallel} heads", in_total=False),
        PlanRow("loss chunk", chunk, f"[{chunk_tokens}, V] blocks", in_total=False),
        PlanRow("forward/backward peak", step.peak_bytes, "activations + temporaries + loss chunk + one grad"
                + (" + all-to-all buffers" if spec.sequence_parallel > 1 else "")),
    ]
    if spec.sequence_parallel > 1:
        rows.insert(-1, PlanRow("all-to-all buffers", 2 * step.largest_exchange,
                                "send + receive of the largest exchange (q, k, v, out, their grads)",
                                in_total=False))
    if stage == 3:
        rows.append(PlanRow("ZeRO-3 gathers", gathers, "largest module whole + prefetch bucket"))
    rows.append(PlanRow("optimizer step (fp32 grads)", step_grad, "after backward: max with the peak above",
                        in_total=False))
    persistent_total = params + grads + optimizer + frozen_bytes + batch_bytes
    total = persistent_total + max(step.peak_bytes + gathers, step_grad)
    name = name or f"draft H {draft_cfg.hidden_size}, V {draft_cfg.vocab_size}"
    frozen_numel = {_storage_key(t): t.numel() for t in (*objective.buffers(), *frozen) if t.is_floating_point()}
    return MemoryPlan(name, spec, psi, sum(frozen_numel.values()), rows, total, step)


# ---- command line ------------------------------------------------------------------------------
def plan_config(overrides: list[str]) -> DictConfig:
    """conf/plan.yaml (conf/train.yaml plus `plan.world_size`, `plan.json`) with these overrides; a
    mistyped plan option is refused naming the ones there are."""
    from config import ConfigError, compose_config
    from config.stages import PlanConf

    try:
        return compose_config("plan", overrides)
    except ConfigError as error:
        if any(item.lstrip("+").startswith("plan.") for item in overrides):
            options = ", ".join(f"plan.{f.name}" for f in fields(PlanConf))
            raise SystemExit(f"python -m train plan: {error} (the plan options: {options})") from None
        raise


def main(argv: list[str], out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(prog="python -m train plan",
                                     description="Per-rank memory plan of a training run (meta device).")
    parser.add_argument("--json", type=Path, help="also write the plan as JSON to this file ('-': stdout); "
                                                  "the same as plan.json=FILE")
    parser.add_argument("overrides", nargs="*",
                        help="hydra overrides of conf/plan.yaml: conf/train.yaml's keys, plan.world_size=N")
    args = parser.parse_args(argv)
    cfg = plan_config(args.overrides)
    try:
        plan = memory_plan(DraftConfig.from_conf(cfg.draft), spec_from_cfg(cfg, cfg.plan.world_size), cfg.draft.name)
    except PlanRefused as refused:
        raise SystemExit(f"python -m train plan: {refused}") from None
    json_path = args.json or (Path(cfg.plan.json) if cfg.plan.json is not None else None)
    training_overrides = [item for item in args.overrides if not item.lstrip("+").startswith("plan.")]
    document = json.dumps({**plan.to_json(), "overrides": training_overrides}, indent=2)
    if json_path is not None and str(json_path) == "-":
        out(document)
        return 0
    out(plan.table())
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(document + "\n")
        out(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
