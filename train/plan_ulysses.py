"""The TTT attention core as one rank of a sequence-parallel (Ulysses) group runs it, on the meta
device, for the memory plan (train/plan.py).

With sequence parallelism SP (model/ulysses.py), each rank of an SP group holds T/SP consecutive
tokens of every row of the micro-batch. The per-token parts of the step (fc, embedding, norms, the
MLA projections, the MLP, the loss) run on those tokens unchanged. Around the attention core, an
all-to-all over heads trades the rank's q, k, v [B, T/SP, heads, d] for [B, T, heads/SP, d]: every
position of heads/SP heads, so the TTT attention sees every key it would see on one rank, and the
masks read the row's segment ids gathered whole [B, T]. A second all-to-all brings the output back
to [B, T/SP, heads, dv]. The TTT cache (K0/V0 and the diagonal keys) stays in the head layout: each
step's new k and v cross once, and their token-layout copies are freed.

`MetaAttentionCore` wraps a meta objective's attention core (MLAttention's attention function) to
run it that way, and marks while the core runs, so the plan tells the tensors the core saves for
backward from those of the per-token parts (at SP 1 it only marks). Its all-to-all moves no data
(there is none on meta); it allocates what DeepSpeed's exchange holds (`_exchange`), in the
forward and, for the gradient, in the backward.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from model.mla import MLAttention
from model.ttt_attention import TTTCache

Attention = Callable[..., Tensor]          # (q, cache, scale, segment_ids) -> out


def _exchange(x: Tensor, sp: int, to_heads: bool) -> Tensor:
    """[B, t, h, d] -> [B, t*sp, h/sp, d] (to_heads) or [B, T, h, d] -> [B, T/sp, h*sp, d], holding
    what DeepSpeed's batch-first all-to-all holds until it returns: x permuted into one block per
    peer (the send buffer), the receive buffer, and the received blocks permuted into the output.
    A permutation that moves only a dimension of size 1 (the batch of one row) copies nothing:
    then the send buffer is x (to_positions) or the output is the receive buffer (to_heads)."""
    if not x.is_meta:
        raise RuntimeError("the plan's all-to-all only models memory: it runs on the meta device")
    B, t, h, d = x.shape
    shape = (B, t * sp, h // sp, d) if to_heads else (B, t // sp, h * sp, d)
    send = x.new_empty(x.shape) if to_heads or B > 1 else x
    received = torch.empty_like(send)
    return received.new_empty(shape) if B > 1 or not to_heads else received.view(shape)


class _AllToAll(torch.autograd.Function):
    """The all-to-all over heads; its gradient is the inverse exchange. Saves nothing."""

    @staticmethod
    def forward(ctx, x: Tensor, sp: int, to_heads: bool) -> Tensor:
        ctx.sp, ctx.to_heads = sp, to_heads
        return _exchange(x, sp, to_heads)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return _exchange(grad, ctx.sp, not ctx.to_heads), None, None


class MetaAttentionCore:
    """`inner` (q, cache, scale, segment_ids -> out) as one rank of an SP group of `sp` runs it.

    Each call exchanges q and the step's new k and v (the cache's last, still in the token layout)
    in one all-to-all, concatenated along the head dim, and gathers the row's segment ids, as
    model/ulysses.py's to_heads and gather_positions do in MLAttention.forward; the output goes
    back with the inverse exchange (to_positions).

    running: true while the core itself runs (the exchanges around it excluded); read: the storages
    of the q and the TTT cache it was given that are still alive (a TTT step recomputed in the
    backward saves none itself: the cache k/v it reads are kept by the steps around it);
    largest_exchange: bytes of the largest tensor an all-to-all sent, whose send and receive buffers
    it held at once."""

    def __init__(self, inner: Attention, sp: int) -> None:
        self.inner, self.sp = inner, sp
        self.running = False
        self.read: set[int] = set()
        self.largest_exchange = 0

    def __call__(self, q: Tensor, cache: TTTCache, scale: float, segment_ids: Tensor | None = None) -> Tensor:
        if self.sp > 1:
            q = self._step_to_heads(q, cache)
            if segment_ids is not None:
                segment_ids = segment_ids.new_empty(segment_ids.shape[0], q.shape[1])
        self._note_read(q, cache.k0, cache.v0, *cache.diag_k, *cache.diag_v)
        self.running = True
        try:
            out = self.inner(q, cache, scale, segment_ids)
        finally:
            self.running = False
        return out if self.sp == 1 else self._all_to_all(out, to_heads=False)

    def _note_read(self, *tensors: Tensor) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in self.read:
                self.read.add(key)
                # A freed storage's address may be reused by another: forget it when freed.
                weakref.finalize(storage, self.read.discard, key)

    def _step_to_heads(self, q: Tensor, cache: TTTCache) -> Tensor:
        """q and the cache's newest k, v in the head layout, exchanged together; the cache
        MLAttention hands on to the next step then holds only the head layout."""
        first = not cache.diag_k
        k, v = (cache.k0, cache.v0) if first else (cache.diag_k[-1], cache.diag_v[-1])
        widths = [t.shape[-1] for t in (q, k, v)]
        q, k, v = self._all_to_all(torch.cat((q, k, v), dim=-1), to_heads=True).split(widths, dim=-1)
        if first:
            cache.k0, cache.v0 = k, v
        else:
            cache.diag_k, cache.diag_v = cache.diag_k[:-1] + (k,), cache.diag_v[:-1] + (v,)
        return q

    def _all_to_all(self, x: Tensor, to_heads: bool) -> Tensor:
        self.largest_exchange = max(self.largest_exchange, x.untyped_storage().nbytes())
        return _AllToAll.apply(x, self.sp, to_heads)


def install_attention_cores(objective: nn.Module, sp: int) -> list[MetaAttentionCore]:
    """Wrap every MLA attention core of a meta objective as a rank of an SP group of `sp` runs it
    (sp 1: marked only); the wrappers, for measure_step. sp must divide the heads (train/plan.py
    refuses other plans)."""
    cores = []
    for module in objective.modules():
        if isinstance(module, MLAttention):
            module._attend = MetaAttentionCore(module._attend, sp)
            cores.append(module._attend)
    return cores
