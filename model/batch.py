"""The draft's input contract: a packed row or micro-batch of rows (Batch), and how samples are
packed into a row (pack_row) and rows into a micro-batch (collate_rows). The trainer and the
evaluation both feed the draft through it.

A row concatenates whole samples (each cut to `max_len` tokens) up to `max_len` tokens; a
micro-batch stacks rows, the same fields with a leading [B]:

    input_ids       [L] int64
    loss_mask       [L] bool      1 iff the token was written by the assistant (as stored)
    aux             [L, n_aux*H]  bf16, the aux layers concatenated in aux_layer_ids order
    position_ids    [L] int64     restart at 0 in every sample
    segment_ids     [L] int64     0, 1, ... one id per sample of the row

and what the draft is trained towards, either

    final           [L, H]        bf16, the verifier's post-norm final hidden state

or, from a store that keeps the verifier's top-k next-token distribution instead of its final
state:

    target_ids      [L, k] int64    the verifier's k most likely next tokens after each position,
                                    most likely first, target vocabulary ids; -1 on rows not stored
    target_logprobs [L, k] float32  their log-probabilities (full-vocabulary softmax, temperature
                                    1); -inf on rows not stored

A row and a micro-batch hold one kind of targets (the objective picks its loss by `Batch.topk`).

A micro-batch's rows are padded at the end to its longest, rounded up to a multiple of tokens:
padding has segment id PAD_SEGMENT (no sample uses it, so attention never mixes it with a sample),
loss_mask False, and target ids -1 with log-probabilities -inf (never read: no counted position
points at them).

With `last_turn_only` a sample's loss_mask keeps only its last contiguous run of assistant tokens,
the last assistant turn, found on the whole sample before it is cut to max_len (a cut that drops
the last turn leaves the sample without loss).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

PAD_SEGMENT = -1
# What a sample is trained towards: its final states [T, H], or its top-k targets
# (target_ids [T, k], target_logprobs [T, k]).
Targets = Tensor | tuple[Tensor, Tensor]


class RowSample(NamedTuple):
    """One sample as pack_row takes it (a plain 4-tuple in this order is one too)."""

    input_ids: Tensor    # [T] int
    loss_mask: Tensor    # [T] bool
    aux: Tensor          # [T, n_aux, H] (or already [T, n_aux*H])
    targets: Targets     # final [T, H], or (target_ids [T, k], target_logprobs [T, k])


@dataclass
class Batch:
    """A packed row ([L] leading shapes) or a micro-batch of rows ([B, L]); the module docstring
    gives each field. Exactly one kind of targets is set: `final`, or both top-k fields."""

    input_ids: Tensor                        # [B, L] int64
    loss_mask: Tensor                        # [B, L] bool
    aux: Tensor                              # [B, L, n_aux*H]
    position_ids: Tensor                     # [B, L] int64
    segment_ids: Tensor                      # [B, L] int64, PAD_SEGMENT on padding
    final: Tensor | None = None              # [B, L, H]
    target_ids: Tensor | None = None         # [B, L, k] int64, -1 where not stored
    target_logprobs: Tensor | None = None    # [B, L, k] float32, -inf where not stored

    def __post_init__(self) -> None:
        topk = (self.target_ids is not None, self.target_logprobs is not None)
        if (self.final is not None) == any(topk) or all(topk) != any(topk):
            raise ValueError("a batch holds either final states or both top-k fields (target_ids, "
                             f"target_logprobs): got final {self.final is not None}, target_ids "
                             f"{topk[0]}, target_logprobs {topk[1]}")

    @property
    def topk(self) -> bool:
        """Whether it is trained towards top-k targets rather than final states."""
        return self.final is None

    @property
    def real(self) -> Tensor:
        """[B, L] bool: the positions that hold a sample's token (not padding)."""
        return self.segment_ids >= 0

    def tokens(self) -> Tensor:
        """The number of real (non-padding) tokens, a 0-dim int64 tensor where the batch lies (no
        host sync)."""
        return self.real.sum()

    def tensors(self) -> dict[str, Tensor]:
        """Field name -> tensor of the fields that are set, in field order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def map(self, fn: Callable[[Tensor], Tensor]) -> Batch:
        """The batch with `fn` applied to each tensor it holds."""
        return Batch(**{name: fn(t) for name, t in self.tensors().items()})

    def to(self, device: torch.device | str, non_blocking: bool = True) -> Batch:
        """The batch on `device` (asynchronous from pinned memory)."""
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """Called by the DataLoader's pinning thread (pin_memory=True): a pinned copy."""
        return self.map(Tensor.pin_memory)

    def with_topk(self, target_ids: Tensor, target_logprobs: Tensor) -> Batch:
        """The batch trained towards these top-k targets instead of its final states."""
        return dataclasses.replace(self, final=None, target_ids=target_ids, target_logprobs=target_logprobs)


def last_turn_mask(loss_mask: Tensor) -> Tensor:
    """loss_mask [T] with only its last contiguous run of True kept (the last assistant turn)."""
    mask = loss_mask.bool()
    kept = torch.zeros_like(mask)
    marked = mask.nonzero()
    if len(marked) == 0:
        return kept
    end = int(marked[-1]) + 1
    gaps = (~mask[:end]).nonzero()
    start = int(gaps[-1]) + 1 if len(gaps) else 0
    kept[start:end] = True
    return kept


def _is_topk(targets: Targets) -> bool:
    return isinstance(targets, tuple)


def pack_row(samples: Sequence[RowSample], max_len: int, last_turn_only: bool = False) -> Batch:
    """Samples (each cut to max_len tokens) -> one row of at most max_len tokens; their targets
    must all be of one kind."""
    topk = bool(samples) and _is_topk(samples[0][3])
    if any(_is_topk(s[3]) != topk for s in samples):
        raise ValueError("a row mixes samples with final states and samples with top-k targets")
    target_keys = ("target_ids", "target_logprobs") if topk else ("final",)
    parts: dict[str, list[Tensor]] = {k: [] for k in ("input_ids", "loss_mask", "aux", *target_keys,
                                                      "position_ids", "segment_ids")}
    for seg, (ids, mask, aux, targets) in enumerate(samples):
        T = min(len(ids), max_len)
        if last_turn_only:  # on the whole sample: the cut must not promote an earlier turn
            mask = last_turn_mask(mask)
        parts["input_ids"].append(ids[:T].long())
        parts["loss_mask"].append(mask[:T].bool())
        parts["aux"].append(aux[:T].flatten(1))                       # [T, n_aux*H]
        if topk:
            parts["target_ids"].append(targets[0][:T].long())         # [T, k]
            parts["target_logprobs"].append(targets[1][:T].float())   # [T, k]
        else:
            parts["final"].append(targets[:T])
        parts["position_ids"].append(torch.arange(T))
        parts["segment_ids"].append(torch.full((T,), seg, dtype=torch.long))
    row = Batch(**{k: torch.cat(v) for k, v in parts.items()})
    if len(row.input_ids) > max_len:
        raise ValueError(f"a packed row of {len(row.input_ids)} tokens exceeds max_len {max_len}")
    return row


_PAD = {"input_ids": 0, "loss_mask": False, "aux": 0.0, "position_ids": 0, "segment_ids": PAD_SEGMENT,
        "final": 0.0, "target_ids": -1, "target_logprobs": float("-inf")}


def collate_rows(rows: Sequence[Batch], multiple: int = 1) -> Batch:
    """Rows -> a micro-batch [B, L, ...], padded at the end to the longest row, rounded up to a
    multiple of `multiple` tokens.

    Why round: CPU kernels (oneDNN's bf16 matmuls, attention) build and cache a primitive per
    shape, so a run whose every micro-batch has a new length grows its memory step after step;
    lengths on a grid of `multiple` bound the shapes a run meets. Padding is inert: its segment
    is PAD_SEGMENT, its mask False."""
    if any(r.topk != rows[0].topk for r in rows):
        raise ValueError("a micro-batch mixes rows with final states and rows with top-k targets")
    L = max(len(r.input_ids) for r in rows)
    L = -(-L // multiple) * multiple
    out = {}
    for key, first in rows[0].tensors().items():
        batch = first.new_full((len(rows), L, *first.shape[1:]), _PAD[key])
        for b, r in enumerate(rows):
            value = getattr(r, key)
            batch[b, :len(value)] = value
        out[key] = batch
    return Batch(**out)
