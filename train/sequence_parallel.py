"""Sequence parallelism (DeepSpeed-Ulysses): every packed row of a micro-batch split over a group of
SP ranks (train.sequence_parallel), so a rank holds the activations of T/SP of its tokens.

Groups. The world's ranks form world/SP sequence-parallel groups of SP consecutive ranks (rank r:
group r // SP, place r % SP). The ranks of one group train the same micro-batches; group g is
data-parallel rank g of DP = world/SP and takes the rows a rank of a DP-rank run takes
(train/batches.py rank_rows with the data-parallel rank and world). The groups are DeepSpeed's own
(deepspeed.runtime.sequence_parallel.parallel_state_sp, the model-parallel unit its Ulysses
training passes to deepspeed.initialize as `mpu`).

Gradients. A rank's loss is its slice's share of the micro-batch's loss: train/objective.py
divides each step's sum by the counted positions of the whole micro-batch (`RankShare.counted`),
so the shares add up to the loss of one rank on the whole rows, and the micro-batch's gradient is
the sum of its group's gradients. With that mpu, DeepSpeed reduces gradients, and ZeRO partitions
parameters, gradients and optimizer states, over all world ranks (its "sequence data parallel"
group), dividing the sum by DP: the sum over each SP group, the mean over the DP groups. (ZeRO-3's
reduce-scatter divides by every rank instead; the loss is scaled for its backward to match,
`SequenceParallel.backward_scale`.)

Rows. Micro-batches are padded to a multiple of SP x train.pad_multiple tokens (T = SP x L). Rank
r of a group keeps positions [r L, (r+1) L) of every row and the `halo` rows after them
(`RowSlice`): TTT step k at position t reads the id at t+1+k, the loss mask at t+2+k and the
target at row t+1+k, so K+1 rows past the slice suffice (the halo is max TTT steps + 1, the larger
of the training and the held-out chain). The draft runs on the L positions only
(model/chain.py draft_chain's span), with ids, positions, segments and counted mask shifted on
rows that reach past the slice: the TTT masks are exactly those of the whole row. Around the
attention the ranks exchange q, k, v over heads (model/ulysses.py, DeepSpeed's all-to-all).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from model.batch import Batch, collate_rows
from model.chain import step_inputs


def check_sequence_parallel(size: int, world: int, heads: int) -> None:
    """Refuse a train.sequence_parallel the ranks or the draft's attention heads cannot split by."""
    problems = []
    if size < 1:
        problems.append("at least 1 (1: off)")
    else:
        if world % size:
            problems.append(f"it must divide the {world} rank(s) into sequence-parallel groups")
        if heads % size:
            problems.append(f"it must divide the draft's {heads} attention heads (each rank attends "
                            f"heads/{size} of them over the whole row)")
    if problems:
        raise ValueError(f"cannot train with train.sequence_parallel={size}: " + "; ".join(problems))


@dataclass(frozen=True)
class RowSlice:
    """One rank's cut of a micro-batch: positions [rank L, (rank+1) L) of each row (L = T / size)
    and the `halo` rows after them, padded past the row's end as collate_rows pads. A plain value,
    so DataLoader workers cut (train/batches.py make_loader)."""

    rank: int
    size: int
    halo: int

    def __call__(self, batch: Batch) -> Batch:
        if self.size == 1:
            return batch
        B, T = batch.input_ids.shape
        if T % self.size:
            raise ValueError(f"a micro-batch of {T} tokens does not split over {self.size} ranks: pad "
                             f"it to a multiple of train.sequence_parallel x train.pad_multiple")
        L = T // self.size
        start = self.rank * L
        stop = min(start + L + self.halo, T)
        rows = [batch.map(lambda t, b=b: t[b, start:stop]) for b in range(B)]
        return collate_rows(rows, multiple=L + self.halo)         # the last rank's halo: padding

    def span(self, cut: Batch) -> int:
        """The positions of a cut micro-batch that are this rank's (all but the halo)."""
        return cut.input_ids.shape[1] - self.halo


class RankShare(NamedTuple):
    span: int               # this rank's positions of each row of the cut micro-batch
    counted: list[int]      # per TTT step, the counted positions of the whole micro-batch


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place: in its sequence-parallel group (`size` ranks; 1: off) and among the
    data-parallel groups."""

    size: int
    rank: int                               # place in the sequence-parallel group
    group: dist.ProcessGroup | None         # None when size is 1
    data_rank: int
    data_world: int
    halo: int

    @property
    def slicer(self) -> RowSlice:
        return RowSlice(self.rank, self.size, self.halo)

    def mpu(self) -> ModuleType | None:
        """What deepspeed.initialize takes as `mpu` (None: plain data parallelism)."""
        if self.size == 1:
            return None
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        return parallel_state_sp

    def share(self, cut: Batch, steps: int) -> RankShare:
        """This rank's positions of a cut micro-batch, and what each TTT step's loss is averaged
        over: its counted positions summed over the group (a collective)."""
        if steps + 1 > self.halo:
            raise ValueError(f"{steps} TTT steps read {steps + 1} rows past a rank's slice; the "
                             f"slices carry {self.halo}")
        span = self.slicer.span(cut)
        counted = torch.stack([step_inputs(cut, k)[2][:, :span].sum() for k in range(steps)])
        dist.all_reduce(counted, group=self.group)
        return RankShare(span, counted.tolist())

    def backward_scale(self, engine) -> float:
        """What a rank's loss is multiplied by for engine.backward, so that DeepSpeed's reduction
        sums each SP group and averages the DP groups. ZeRO-1/2 divide the sum over every rank by
        DP; ZeRO-3's reduce-scatter (DeepSpeed 0.19, its default) divides by every rank, leaving
        out the sequence-parallel correction its all-reduce path applies: there, `size`. ZeRO-3
        without reduce-scatter takes either path per bucket (the all-reduce one only for buckets
        within reduce_bucket_size), so it is refused."""
        if self.size == 1 or engine.zero_optimization_stage() != 3:
            return 1.0
        if not engine.zero_reduce_scatter():
            raise ValueError("train.sequence_parallel > 1 with ZeRO-3 needs zero_optimization.reduce_scatter "
                             "(its default): without it DeepSpeed scales the gradients of large and small "
                             "parameters differently")
        return float(self.size)

    def tokens(self, cut: Batch) -> Tensor:
        """The real tokens of this rank's positions (a 0-dim tensor; summed over the world: every
        token of the DP groups' micro-batches once)."""
        return cut.real[:, :self.slicer.span(cut)].sum()


def init_sequence_parallel(size: int, heads: int, max_steps: int) -> SequenceParallel:
    """This rank's SequenceParallel in the initialized process group, building DeepSpeed's
    sequence-parallel groups when size > 1; refuses (before any compute) a size the world or the
    heads do not split by. max_steps: the longest TTT chain a forward runs (the slices' halo)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_sequence_parallel(size, world, heads)
    if size == 1:
        return SequenceParallel(1, 0, None, rank, world, 0)
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    try:
        group = parallel_state_sp.get_sequence_parallel_group()       # built by an earlier run here
    except AssertionError:
        parallel_state_sp.initialize_sequence_parallel(size)
        group = parallel_state_sp.get_sequence_parallel_group()
    if dist.get_world_size(group) != size:
        raise RuntimeError(f"this process already has sequence-parallel groups of "
                           f"{dist.get_world_size(group)} ranks, not {size}")
    return SequenceParallel(size, dist.get_rank(group), group, rank // size, world // size, max_steps + 1)
