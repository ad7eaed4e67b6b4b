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

from model.batch import Batch
from model.draft import Eagle3Draft, StepOutput


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


def draft_chain(draft: Eagle3Draft, batch: Batch, steps: int) -> Iterator[tuple[int, StepOutput, Tensor]]:
    """(k, step k's output, counted [B, T] bool) for k < steps over a micro-batch, each step reading
    the previous step's hidden states and attention cache."""
    hidden = draft.project_aux(batch.aux.to(draft.fc.weight.dtype))     # [B, T, H]
    cache = None
    for k in range(steps):
        ids, positions, counted = step_inputs(batch, k)
        out = draft.step(ids, hidden, positions, cache, batch.segment_ids, with_logits=False)
        yield k, out, counted
        hidden, cache = out.hidden, out.cache
