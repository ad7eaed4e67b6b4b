"""The exchanges of DeepSpeed-Ulysses sequence parallelism around the draft's attention.

Under sequence parallelism a group of SP ranks splits every packed row of a micro-batch: rank r
holds positions [r T/SP, (r+1) T/SP). Everything per token (fc, embedding, norms, the MLA
projections, the MLP, the loss) runs on those positions as it would on the whole row; attention
needs every position. Around it (model/mla.py MLAttention.forward), an all-to-all trades the rank's
q, k, v [B, T/SP, heads, d] for [B, T, heads/SP, d] (every position, heads [r h/SP, (r+1) h/SP)),
so the TTT attention of those heads is computed exactly as on one rank, over the row's segment ids
gathered whole; a second all-to-all brings its output back to [B, T/SP, heads, dv].

The all-to-all is DeepSpeed's (deepspeed.sequence.layer._SeqAllToAll, the differentiable exchange
its DistributedAttention runs; the backward is the inverse exchange). DistributedAttention itself
does not fit: it exchanges one step's q, k and v and hands them to a local attention, while TTT
step k also attends the keys of steps 0..k-1, which the TTT cache keeps already in the head layout.
So each step exchanges its own q, k, v (in one all-to-all, concatenated along the head dim) and
joins its keys to the cache.

deepspeed is imported where it is used: the model is also used where no process group exists.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# _SeqAllToAll's layout arguments for [B, T, heads, d] tensors (batch first).
_BATCH_DIM, _SEQ_DIM, _HEAD_DIM = 0, 1, 2


def _all_to_all(x: Tensor, group: dist.ProcessGroup, scatter: int, gather: int) -> Tensor:
    from deepspeed.sequence.layer import _SeqAllToAll

    return _SeqAllToAll.apply(group, x.contiguous(), scatter, gather, _BATCH_DIM)


def to_heads(tensors: tuple[Tensor, ...], group: dist.ProcessGroup) -> tuple[Tensor, ...]:
    """Tensors [B, T/SP, heads, d_i] of this rank's positions -> [B, T, heads/SP, d_i]: the whole
    row, this rank's heads; one all-to-all for all of them."""
    widths = [t.shape[-1] for t in tensors]
    exchanged = _all_to_all(torch.cat(tensors, dim=-1), group, _HEAD_DIM, _SEQ_DIM)
    return tuple(exchanged.split(widths, dim=-1))


def to_positions(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[B, T, heads/SP, d] of this rank's heads -> [B, T/SP, heads, d]: this rank's positions,
    every head (the inverse of to_heads)."""
    return _all_to_all(x, group, _SEQ_DIM, _HEAD_DIM)


def gather_positions(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[B, T/SP] of this rank's positions (segment ids: no gradient) -> [B, T], the whole row."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)
