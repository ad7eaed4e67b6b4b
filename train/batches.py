"""Packed training rows from the dump's store, read through the store package's StoreReader only.

Each row packs whole samples as model/batch.py's pack_row does (its docstring gives the row's
fields, the padding of a micro-batch and `last_turn_only`, train.loss.last_turn_only); only rows
the loss reads are stored (row j iff loss_mask[j + 1]).

Order. The training rows form an endless stream: epoch e shuffles the training samples with
(seed, e) and packs them next-fit, in that order, into rows. Optimizer step s takes the rows
s*R .. (s+1)*R - 1 of the stream, R = micro_batch * grad_accum * world_size, and rank r at
micro-step m takes rows s*R + (m*world_size + r)*micro_batch + j. The stream depends only on
the store and the seed, so a resumed run picks it up at its step without reading anything
before, and 1 rank with grad_accum 2 sees the same rows per step as 2 ranks with grad_accum 1.
Under sequence parallelism the rank and world here are the data-parallel ones: the ranks of a
sequence-parallel group read the same rows and each keeps its slice (train/sequence_parallel.py).

Split. A sample is held out for evaluation when `data.split.is_held_out` says so for
its conversation (ShareGPT parts "id_3" count as "id", as the dump's own split does), with the
fraction and seed of conf/train.yaml, or when the dump wrote it to a held-out shard (the
conversations it read on for the held-out set, data/heldout_set.py): stable whatever the store's
order or size.

Size. A store too small for the run is caught before the first step (`check_split_sizes`): no
training sample is refused; no held-out sample skips the held-out evaluation (the run still
trains and exports); an epoch of fewer rows than one optimizer step takes repeats samples within
each step, which the endless stream does by design, and is said once.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import multiprocessing
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from data.split import held_out_by
from data.packing import pack_next_fit
from model.batch import Batch, RowSample, collate_rows, pack_row
from store import Sample, SampleRef, StoreReader
from train.parent_death import bind_to_parent


# ---- split -------------------------------------------------------------------------------
def held_out_rule(reader: StoreReader, fraction: float, seed: int) -> Callable[[SampleRef], bool]:
    """Whether a sample of the store is held out: its conversation is, by data/split.py held_out_by
    (with the conversation key of the data the store was dumped from), or the dump recorded it held
    out by writing it to a held-out shard (data/heldout_set.py: the conversations it read past
    data.max_samples for the held-out set, which no rule on ids finds)."""
    data = reader.dump_config.get("data") or {}
    by_id = held_out_by(fraction, seed, data.get("format"))
    heldout_shards = frozenset(entry.name for entry in reader.shards() if entry.heldout)
    return functools.partial(_is_held_out_ref, by_id=by_id, heldout_shards=heldout_shards)


def _is_held_out_ref(ref: SampleRef, by_id: Callable[[str], bool], heldout_shards: frozenset[str]) -> bool:
    return ref.shard in heldout_shards or by_id(ref.sample_id)


def split_samples(refs: Sequence[SampleRef], heldout: Callable[[SampleRef], bool]) -> tuple[list[SampleRef], list[SampleRef]]:
    """(train, held-out) refs, in store order."""
    train, held = [], []
    for ref in refs:
        (held if heldout(ref) else train).append(ref)
    return train, held


# ---- packing (rows: data/packing.py pack_next_fit) ---------------------------------------
class RowStream:
    """The endless stream of training rows: epoch after epoch, each shuffled with (seed, epoch)."""

    def __init__(self, lengths: Sequence[int], max_len: int, seed: int) -> None:
        if not lengths:
            raise ValueError("no training samples: the store is empty or all of it is held out")
        self.lengths, self.max_len, self.seed = list(lengths), max_len, seed
        self._epochs: list[list[list[int]]] = []
        self._starts: list[int] = [0]               # stream index of each epoch's first row

    def epoch(self, e: int) -> list[list[int]]:
        """The rows (sample indices) of epoch e, in stream order."""
        while len(self._epochs) <= e:
            order = list(range(len(self.lengths)))
            random.Random(f"{self.seed}:{len(self._epochs)}").shuffle(order)
            packed = pack_next_fit([self.lengths[i] for i in order], self.max_len)
            self._epochs.append([[order[i] for i in row] for row in packed])
            self._starts.append(self._starts[-1] + len(self._epochs[-1]))
        return self._epochs[e]

    def row(self, i: int) -> tuple[int, list[int]]:
        """(epoch, sample indices) of stream row i."""
        e = 0
        while True:
            rows = self.epoch(e)
            if i < self._starts[e + 1]:
                return e, rows[i - self._starts[e]]
            e += 1


def rank_rows(stream: RowStream, start_step: int, end_step: int, micro_batch: int, grad_accum: int,
              rank: int, world_size: int) -> list[tuple[int, list[int]]]:
    """This rank's rows for optimizer steps [start_step, end_step), in the order it consumes them."""
    per_step = micro_batch * grad_accum * world_size
    out = []
    for step in range(start_step, end_step):
        for m in range(grad_accum):
            first = step * per_step + (m * world_size + rank) * micro_batch
            out += [stream.row(first + j) for j in range(micro_batch)]
    return out


# ---- reading rows ------------------------------------------------------------------------
class PackedRows(Dataset):
    """Rows of samples read from the store; each DataLoader worker opens its own reader."""

    def __init__(self, store: Path, refs: Sequence[SampleRef], rows: Sequence[Sequence[int]],
                 max_len: int, last_turn_only: bool = False) -> None:
        self.store, self.refs, self.rows, self.max_len = Path(store), list(refs), list(rows), max_len
        self.last_turn_only = last_turn_only
        self._reader: StoreReader | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Batch:
        if self._reader is None:  # opened lazily: in the worker process, not pickled into it
            self._reader = StoreReader(self.store)
        samples = [self._reader.read_sample(self.refs[j]) for j in self.rows[i]]
        return pack_row([row_sample(s) for s in samples], self.max_len, self.last_turn_only)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_reader": None}


def row_sample(sample: Sample) -> RowSample:
    """A store sample (store.Sample) as pack_row takes it: its final states, or its top-k targets
    when the store keeps those instead (final None)."""
    if sample.final is not None:
        return RowSample(sample.input_ids, sample.loss_mask, sample.aux, sample.final)
    target_ids = getattr(sample, "target_ids", None)
    target_logprobs = getattr(sample, "target_logprobs", None)
    if target_ids is None or target_logprobs is None:
        raise ValueError(f"sample {sample.sample_id!r} has neither final states nor top-k targets")
    return RowSample(sample.input_ids, sample.loss_mask, sample.aux, (target_ids, target_logprobs))


def _worker_init(_: int) -> None:
    bind_to_parent()          # dies with the fork server, which dies with the rank
    torch.set_num_threads(1)  # workers decode and copy; the trainer's threads do the math


def _worker_context() -> multiprocessing.context.BaseContext:
    """Workers forked from a small server process, not from the trainer: a worker forked from a
    trainer keeps every page the trainer writes after the fork (its optimizer states, master
    weights), 3.2 GiB per worker for the Kimi-K2 draft on 2 ranks, which took the machine into
    reclaim. The server (train/worker_server.py) imports this module once and dies with the rank;
    each worker then forks from it in milliseconds."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["train.worker_server"])
    return context


def _collate(rows: Sequence[Batch], multiple: int, cut: Callable[[Batch], Batch] | None) -> Batch:
    batch = collate_rows(rows, multiple)
    return batch if cut is None else cut(batch)


def make_loader(dataset: PackedRows, micro_batch: int, num_workers: int, prefetch_factor: int,
                pad_multiple: int = 1, cut: Callable[[Batch], Batch] | None = None) -> DataLoader:
    """In-order micro-batches, their length padded to a multiple of pad_multiple (collate_rows);
    workers read ahead so reading overlaps compute. cut: applied to each micro-batch in the
    workers (sequence parallelism: this rank's slice, train/sequence_parallel.py RowSlice)."""
    extra = {"prefetch_factor": prefetch_factor, "persistent_workers": False, "worker_init_fn": _worker_init,
             "multiprocessing_context": _worker_context()} if num_workers > 0 else {}
    return DataLoader(dataset, batch_size=micro_batch, shuffle=False, num_workers=num_workers,
                      collate_fn=functools.partial(_collate, multiple=pad_multiple, cut=cut), drop_last=False,
                      pin_memory=torch.cuda.is_available(), **extra)


@dataclass
class StoreSplit:
    """The store opened once: its samples split into training and held-out refs."""

    path: Path
    reader: StoreReader
    train: list[SampleRef]
    heldout: list[SampleRef]

    @classmethod
    def open(cls, path: Path, heldout_fraction: float, heldout_seed: int) -> StoreSplit:
        reader = StoreReader(path)
        train, heldout = split_samples(reader.samples(), held_out_rule(reader, heldout_fraction, heldout_seed))
        return cls(Path(path), reader, train, heldout)

    def with_train_fraction(self, fraction: float) -> StoreSplit:
        """The same split training on a share of its training samples only (learning curves over
        data size): the first ceil(fraction x n) by sha256 of sample id, so a smaller share is a
        subset of a larger one and the held-out samples never change."""
        if not 0 < fraction <= 1:
            raise ValueError(f"train.train_fraction {fraction}: use a share in (0, 1]")
        if fraction == 1:
            return self
        order = sorted(self.train, key=lambda r: hashlib.sha256(r.sample_id.encode()).hexdigest())
        return dataclasses.replace(self, train=order[:math.ceil(fraction * len(order))])

    def train_stream(self, max_len: int, seed: int) -> RowStream:
        return RowStream([r.num_tokens for r in self.train], max_len, seed)

    def sizes(self, max_len: int, seed: int, rows_per_step: int, world_size: int) -> SplitSizes:
        epoch_rows = len(self.train_stream(max_len, seed).epoch(0)) if self.train else 0
        return SplitSizes(self.path, len(self.train), len(self.heldout), epoch_rows, rows_per_step, world_size)

    def eval_rows(self, rank: int, world_size: int) -> list[tuple[int, bool]]:
        """(held-out sample index, counted) pairs, one sample per row (its sums are kept apart:
        train/heldout.py), rank r taking every world_size-th. Every rank gets the same number of
        rows (ZeRO-3 gathers weights in every forward, all ranks together): the short ones repeat
        a row with counted False."""
        if not self.heldout:
            raise ValueError("no held-out samples: raise eval.heldout_fraction or use a larger store")
        mine = [(i, True) for i in range(len(self.heldout))[rank::world_size]]
        per_rank = math.ceil(len(self.heldout) / world_size)
        filler = mine[0][0] if mine else 0
        return mine + [(filler, False)] * (per_rank - len(mine))


class SplitTooSmallError(ValueError):
    """The store's split cannot feed the run (raised before the first step)."""


@dataclass(frozen=True)
class SplitSizes:
    """A run's split against what its steps take (`StoreSplit.sizes`)."""

    store: Path
    train: int              # training samples (after train.train_fraction)
    heldout: int            # held-out samples
    epoch_rows: int         # packed rows of one epoch of the training samples (epoch 0)
    rows_per_step: int      # train.micro_batch x train.grad_accum x ranks
    world_size: int


def check_split_sizes(sizes: SplitSizes, heldout_fraction: float, max_len: int) -> list[str]:
    """The warnings of a split the run can train on; refuses (SplitTooSmallError) one it cannot.

    - No training sample: nothing to train; refused (the stream would raise after the engine is
      built, the pruned vocabulary would count nothing).
    - No held-out sample: warned; the caller skips the held-out evaluation and still exports. The
      held-out numbers report on the draft, they are not part of it (and `make eval` measures the
      accept length on conversations no dump's train split holds); a trainer given no validation
      data trains without validating.
    - Fewer rows per epoch than one optimizer step takes (fewer samples than ranks is one case):
      warned. The stream repeats epochs, so each step still gets its rows, some of them the same
      sample, as a distributed sampler pads a short data set by repeating it."""
    where = f"store {sizes.store}"
    if sizes.train == 0:
        held = (f"all {sizes.heldout} of its samples are held out at eval.heldout_fraction="
                f"{heldout_fraction}: lower it" if sizes.heldout else "it holds no samples: dump some")
        raise SplitTooSmallError(f"{where} has no training samples ({held}, or point store_dir= at a "
                                 f"larger store)")
    warnings = []
    if sizes.heldout == 0:
        warnings.append(f"{where}: none of its {sizes.train} samples is held out at eval.heldout_fraction="
                        f"{heldout_fraction}: the held-out evaluation is skipped (the draft is still "
                        f"exported); raise eval.heldout_fraction or use a larger store to have one")
    if sizes.epoch_rows < sizes.rows_per_step:
        warnings.append(f"{where}: its {sizes.train} training samples pack into {sizes.epoch_rows} row(s) of "
                        f"train.max_len={max_len} tokens, fewer than the {sizes.rows_per_step} rows one "
                        f"optimizer step takes (train.micro_batch x train.grad_accum x {sizes.world_size} "
                        f"rank(s)): each step repeats samples; use a larger store or lower those settings")
    return warnings


def store_keeps_topk(reader: StoreReader) -> bool:
    """Whether the store's samples carry the verifier's top-k targets instead of its final states
    (its storage settings say so: store.json's final encoding)."""
    return reader.final_encoding == "topk"


def iterate_token_masks(reader: StoreReader, refs: Sequence[SampleRef]) -> Iterator[tuple[Tensor, Tensor]]:
    """(input_ids [T], loss_mask [T]) of each sample (for the pruned vocabulary's counts), read
    without the hidden states (38 KB a token at Kimi-K2's width)."""
    for ref in refs:
        yield reader.read_tokens(ref)
