"""The draft's TTT chain over a Batch, as training and the accept-length simulation both run it.

Step k at position t of a sample reads the token x_{t+1+k}, at position position_ids[t] + k, and
the hidden state step k-1 left at t (step 0: fc of the aux states at t). It predicts x_{t+2+k},
whose verifier distribution sits at row t+1+k (the final state there, or its stored top-k), and
is counted iff loss_mask[t+2+k]: the token was written by the assistant. Ids and the counted mask
shift by one more per step and never cross into the next packed sample (nor into padding).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from model.batch import Batch
from model.draft import Eagle3Draft, StepOutput
from model.ttt_attention import TTTCache


def shift_in_sample(x: Tensor, segment_ids: Tensor, shift: int, fill: float | int | bool) -> Tensor:
    """[B, T] -> [B, T]: out[b, t] = x[b, t + shift] when t + shift < T lies in the same sample
    (segment) as t, else `fill`."""
    out = torch.full_like(x, fill)
    T = x.shape[1]
    if shift < T:
        same = segment_ids[:, shift:] == segment_ids[:, :T - shift]
        out[:, :T - shift] = torch.where(same, x[:, shift:], out[:, :T - shift])
    return out


def step_inputs(batch: Batch, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Step k's (input ids [B, T], positions [B, T], counted [B, T] bool) of a micro-batch."""
    seg = batch.segment_ids
    ids = shift_in_sample(batch.input_ids, seg, 1 + k, 0)
    counted = shift_in_sample(batch.loss_mask, seg, 2 + k, False) & (seg >= 0)
    return ids, batch.position_ids + k, counted


def read_rows(batch: Batch) -> Tensor:
    """[B, T] bool: the rows some TTT step reads its target from, row r where token r+1 is counted."""
    seg = batch.segment_ids
    return shift_in_sample(batch.loss_mask, seg, 1, False) & (seg >= 0)


def run_step(draft: Eagle3Draft, recompute: bool, input_ids: Tensor, hidden: Tensor, positions: Tensor,
             cache: TTTCache | None, segment_ids: Tensor) -> StepOutput:
    """draft.step without logits. With recompute, while autograd records, under a non-reentrant
    torch.utils.checkpoint: the step keeps only its inputs (hidden, the cache of the earlier steps)
    for the backward, which runs its forward again; the loss and gradients are the same, for one
    more forward per step. No RNG state is kept: the layer draws no random numbers."""
    if not (recompute and torch.is_grad_enabled()):
        return draft.step(input_ids, hidden, positions, cache, segment_ids, with_logits=False)
    # The cache goes in as plain tensors: checkpoint saves its tensor arguments as autograd saves
    # any tensor (through the saved-tensor hooks train/plan.py counts with), other objects it only
    # holds.
    flat = () if cache is None else cache.tensors()
    return checkpoint(_step_of_tensors, draft, input_ids, hidden, positions, segment_ids, *flat,
                      use_reentrant=False, preserve_rng_state=False)


def _step_of_tensors(draft: Eagle3Draft, input_ids: Tensor, hidden: Tensor, positions: Tensor,
                     segment_ids: Tensor, *cache: Tensor) -> StepOutput:
    return draft.step(input_ids, hidden, positions, TTTCache.from_tensors(cache) if cache else None,
                      segment_ids, with_logits=False)


def draft_chain(draft: Eagle3Draft, batch: Batch, steps: int, span: int | None = None,
                recompute: bool = False) -> Iterator[tuple[int, StepOutput, Tensor]]:
    """(k, step k's output, counted [B, T] bool) for k < steps over a micro-batch, each step reading
    the previous step's hidden states and attention cache.

    span: the draft runs on the first `span` positions of each row only (sequence parallelism,
    train/sequence_parallel.py: this rank's slice; the rows after it are only read by the shifts,
    so ids and the counted mask are those of the whole row); outputs and counted are [B, span].
    recompute: each step runs under torch.utils.checkpoint when autograd records (`run_step`)."""
    n = batch.input_ids.shape[1] if span is None else span
    hidden = draft.project_aux(batch.aux[:, :n].to(draft.fc.weight.dtype))     # [B, n, H]
    cache = None
    for k in range(steps):
        ids, positions, counted = (x[:, :n] for x in step_inputs(batch, k))
        out = run_step(draft, recompute, ids, hidden, positions, cache, batch.segment_ids[:, :n])
        yield k, out, counted
        hidden, cache = out.hidden, out.cache
