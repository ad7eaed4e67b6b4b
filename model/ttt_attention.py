"""The TTT attention of the draft layer: step k's query at position t attends the step-0 keys
K0[s] for s <= t (same sample) plus the diagonal keys K1[t] .. Kk[t] of steps 1..k. `TTTCache`
carries K0/V0 and the diagonal keys; interchangeable kernels compute the attention
(`ATTENTION_IMPLS`, chosen by draft.attention):

- `attention_reference`: keys concatenated to (k+1)T and an explicit [T, (k+1)T] mask;
- `attention_ttt`: causal attention over K0 with its log-sum-exp, merged with the k per-position
  diagonal dot products by log-sum-exp; no (k+1)T key tensor, no T x T x K mask. Its causal part
  runs on torch's fused flash-attention CPU kernel once per packed sample where the inputs allow
  (the CPU, fp32 or bf16), else on plain-PyTorch query blocks (`ttt_blocked` always does).

The blocked causal attention (`causal_attention_with_lse`) is exact and memory-efficient in plain
PyTorch: it walks the queries block by block, each block against the keys up to its own end,
and saves only q, k, v, its output and log-sum-exp; the backward recomputes each block's
probabilities. Memory is O(block x T) per head for one step's scores, O(T) saved per step,
instead of the [B, heads, T, T] scores and probabilities eager attention keeps for the backward.
`attention_ttt` saves its inputs and output in their own dtype (bf16 in training) and one fp32
log-sum-exp per query and head: each block is upcast to fp32 where it is used, so no fp32 copy of
a whole row is kept (at Kimi-K3's 46k-token rows one [T, 64 heads, 192] fp32 copy is 2.1 GiB).

Packed rows: `segment_ids` [B, T] (int, one id per sample in the row; give padding an id no
sample uses) keeps attention inside a sample.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class TTTCache:
    """Keys/values one TTT step leaves for the next.

    k0/v0: [B, T, heads, d] from step 0 (attended causally); diag_k/diag_v: those of steps
    1..k, each [B, T, heads, d], attended only at the query's own position.
    """

    k0: Tensor
    v0: Tensor
    diag_k: tuple[Tensor, ...] = field(default_factory=tuple)
    diag_v: tuple[Tensor, ...] = field(default_factory=tuple)

    def extend(self, k: Tensor, v: Tensor) -> TTTCache:
        """A new cache with step k's keys appended (the old one is left as it was, for autograd)."""
        return TTTCache(self.k0, self.v0, self.diag_k + (k,), self.diag_v + (v,))

    @property
    def num_steps(self) -> int:
        return 1 + len(self.diag_k)

    def tensors(self) -> tuple[Tensor, ...]:
        """(k0, v0, diag_k..., diag_v...): the cache as plain tensors (`from_tensors` undoes it)."""
        return (self.k0, self.v0, *self.diag_k, *self.diag_v)

    @classmethod
    def from_tensors(cls, tensors: tuple[Tensor, ...]) -> TTTCache:
        steps = (len(tensors) - 2) // 2
        return cls(tensors[0], tensors[1], tuple(tensors[2:2 + steps]), tuple(tensors[2 + steps:]))


# A [B, heads, block, T] fp32 score tile is kept near this size (the forward holds one such tile,
# the backward about three): at Kimi-K2's 64 heads and T 8192 that is 128 queries per block.
TILE_BYTES = 256 * 2**20
# Fewer queries per block would leave the GPU's matmuls too thin to be efficient.
MIN_BLOCK = 64
# More gains nothing: a longer block computes more of the masked triangle, and on CPUs its tile
# falls out of cache.
MAX_BLOCK = 256


def attention_block_size(B: int, heads: int, T: int, tile_bytes: int = TILE_BYTES) -> int:
    """Queries per block: as many as keep a [B, heads, block, T] fp32 tile within tile_bytes, in
    multiples of MIN_BLOCK, between MIN_BLOCK and MAX_BLOCK, and at most T."""
    rows = tile_bytes // (B * heads * T * 4) // MIN_BLOCK * MIN_BLOCK
    return min(T, max(MIN_BLOCK, min(MAX_BLOCK, rows)))


def _hidden(segment_ids: Tensor | None, B: int, start: int, end: int, device: torch.device,
            first: int = 0) -> Tensor:
    """[B, 1, end - start, end - first] bool: True where query start + i may NOT see key first + s
    (a later key, or another sample). The diagonal is always visible, so no query row is entirely
    hidden: a padding position attends the padding before it, as eager attention over the same mask
    does."""
    queries = torch.arange(start, end, device=device)[:, None]
    future = torch.arange(first, end, device=device)[None, :] > queries           # [n, end - first]
    if segment_ids is None:
        return future.expand(B, 1, end - start, end - first)
    other = segment_ids[:, start:end, None] != segment_ids[:, None, first:end]    # [B, n, end - first]
    return (future | other)[:, None]


def _first_keys(segment_ids: Tensor | None, blocks: list[tuple[int, int]]) -> list[int]:
    """Per query block, the first key any of its queries may see: the start of the sample (segment)
    its first query is in, lowest over the batch. Keys before it are hidden from the whole block, so
    a packed row of several samples skips their scores (segments are contiguous runs of a row).
    On the meta device (train/plan.py) nothing is known of the samples: every key, the bound."""
    if segment_ids is None or segment_ids.is_meta:
        return [0] * len(blocks)
    B, T = segment_ids.shape
    idx = torch.arange(T, device=segment_ids.device).expand(B, T)
    is_start = torch.ones_like(segment_ids, dtype=torch.bool)
    is_start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    seg_start = torch.where(is_start, idx, torch.zeros_like(idx)).cummax(dim=1).values     # [B, T]
    return seg_start[:, [start for start, _ in blocks]].amin(0).tolist()


def _accumulation_dtype(x: Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (what a float64 gradcheck needs)."""
    return torch.promote_types(x.dtype, torch.float32)


def _heads_first(x: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, T, heads, d] -> [B, heads, T, d] in dtype, contiguous: batched matmuls over slices of T
    then need no copy. (`to` alone returns the transposed view itself when x has the dtype.)"""
    return x.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format).contiguous()


def _blocks(T: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(start + block, T)) for start in range(0, T, block)]


def query_blocks(T: int, block: int, segment_ids: Tensor | None) -> list[tuple[int, int, int]]:
    """(start, end, lo) of each query block of the block-wise attention: queries [start, end)
    score keys [lo, end), lo from `_first_keys` (what the kernels compute, and what a FLOP count
    of them counts)."""
    blocks = _blocks(T, block)
    return [(start, end, lo) for (start, end), lo in zip(blocks, _first_keys(segment_ids, blocks))]


def _scores(q_blk: Tensor, k_pre: Tensor, scale: float, hidden: Tensor) -> Tensor:
    """q_blk [B, h, n, dqk], k_pre [B, h, end, dqk] -> [B, h, n, end] scores, -inf where hidden."""
    scores = torch.matmul(q_blk, k_pre.transpose(-1, -2)).mul_(scale)
    return scores.masked_fill_(hidden, float("-inf"))


def _causal_block(q_blk: Tensor, kf: Tensor, vf: Tensor, scale: float, hidden: Tensor) -> tuple[Tensor, Tensor]:
    """One query block q_blk [B, h, n, dqk] against its keys kf, vf [B, h, m, d] (fp32) -> (out
    [B, h, n, dv], lse [B, h, n])."""
    scores = _scores(q_blk, kf, scale, hidden)                                   # [B, h, n, m]
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(lse[..., None]).exp_()
    return torch.matmul(probs, vf), lse


def _causal_block_grads(q_blk: Tensor, do_blk: Tensor, kf: Tensor, vf: Tensor, lse: Tensor, shift: Tensor,
                        scale: float, hidden: Tensor, dk: Tensor, dv: Tensor) -> Tensor:
    """The backward of one query block against its keys: adds into dk (without the scale) and dv
    [B, h, m, d] and returns the block's dq [B, h, n, dqk]. lse [B, h, n]: what the rows'
    probabilities are normalised by; shift [B, h, n]: D - dlse, the term all of a row's dS share."""
    probs = _scores(q_blk, kf, scale, hidden).sub_(lse[..., None]).exp_()       # P [B, h, n, m]
    _add_matmul_(dv, probs.transpose(-1, -2), do_blk)
    ds = torch.matmul(do_blk, vf.transpose(-1, -2))                              # dP [B, h, n, m]
    ds = ds.sub_(shift[..., None]).mul_(probs)
    del probs
    _add_matmul_(dk, ds.transpose(-1, -2), q_blk)
    return torch.matmul(ds, kf).mul_(scale)


def _add_matmul_(out: Tensor, a: Tensor, b: Tensor) -> None:
    """out [B, h, m, d] += a [B, h, m, n] @ b [B, h, n, d], in place: no [B, h, m, d] temporary,
    which for the keys of a long row is as large as the keys' own gradient."""
    B, h, m, d = out.shape
    out.view(B * h, m, d).baddbmm_(a.reshape(B * h, m, a.shape[-1]), b.reshape(B * h, b.shape[-2], d))


class _CausalAttentionWithLse(torch.autograd.Function):
    """Block-wise exact causal attention returning out and lse, both differentiable.

    Saves q, k, v (as given), out and lse; the backward recomputes each block's probabilities P
    from the saved lse. Gradients, with dO and dlse flowing in and D = rowsum(dO * O):
    dP = dO V^T, dS = P * (dP - D + dlse), dq = scale dS K, dk = scale dS^T Q, dv = P^T dO."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float, segment_ids: Tensor | None,
                block: int) -> tuple[Tensor, Tensor]:
        B, T, h = q.shape[:3]
        acc = _accumulation_dtype(q)
        kf, vf = _heads_first(k, acc), _heads_first(v, acc)                      # [B, h, T, d]
        out = torch.empty(B, T, h, v.shape[-1], dtype=acc, device=q.device)
        lse = torch.empty(B, T, h, dtype=acc, device=q.device)
        for start, end, lo in query_blocks(T, block, segment_ids):
            hidden = _hidden(segment_ids, B, start, end, q.device, lo)
            out_blk, lse_blk = _causal_block(_heads_first(q[:, start:end], acc), kf[:, :, lo:end],
                                             vf[:, :, lo:end], scale, hidden)
            out[:, start:end] = out_blk.transpose(1, 2)
            lse[:, start:end] = lse_blk.transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.segment_ids, ctx.block = scale, segment_ids, block
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out: Tensor, d_lse: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        B, T = q.shape[:2]
        acc = out.dtype
        d_out = d_out.to(acc)
        shift = ((d_out * out).sum(-1) - d_lse.to(acc)).transpose(1, 2)        # D - dlse [B, h, T]
        lse_h = lse.transpose(1, 2)                                              # [B, h, T]
        kf, vf = _heads_first(k, acc), _heads_first(v, acc)                      # [B, h, T, d]
        dq = torch.empty_like(q)                                                 # a block's rows are final
        dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)                      # every later block adds
        for start, end, lo in query_blocks(T, ctx.block, ctx.segment_ids):
            hidden = _hidden(ctx.segment_ids, B, start, end, q.device, lo)
            dq_blk = _causal_block_grads(_heads_first(q[:, start:end], acc), _heads_first(d_out[:, start:end], acc),
                                         kf[:, :, lo:end], vf[:, :, lo:end], lse_h[:, :, start:end],
                                         shift[:, :, start:end], ctx.scale, hidden, dk[:, :, lo:end], dv[:, :, lo:end])
            dq[:, start:end] = dq_blk.transpose(1, 2)
        dk = dk.mul_(ctx.scale).transpose(1, 2).to(k.dtype)
        return dq, dk, dv.transpose(1, 2).to(v.dtype), None, None, None


class _TTTAttention(torch.autograd.Function):
    """attention_ttt's kernel: each query block's causal attention over K0 (as
    _CausalAttentionWithLse), merged in the same pass with its own rows of the diagonal keys
    K1..Kk by log-sum-exp: O = (exp(lse0 - L) O0 + sum_j exp(s_j - L) V_j), L = lse(lse0, s_1..s_k).

    Saves q, the keys and values as given (the training dtype), the output O (in q's dtype: the
    tensor o_proj keeps anyway) and L [B, T, heads] fp32: no fp32 copy of a full row; every block
    is upcast to fp32 where it is used. The backward is that of one softmax over the causal and
    the diagonal keys, with P = exp(S - L) and D = rowsum(dO * O): dS = P * (dP - D) for both kinds
    of keys (the causal part through _causal_block_grads, the diagonal one per row)."""

    @staticmethod
    def forward(ctx, q: Tensor, scale: float, segment_ids: Tensor | None, block: int, k0: Tensor, v0: Tensor,
                *diag: Tensor) -> Tensor:
        B, T, h = q.shape[:3]
        acc = _accumulation_dtype(q)
        diag_k, diag_v = diag[:len(diag) // 2], diag[len(diag) // 2:]
        ctx.scale, ctx.segment_ids, ctx.block = scale, segment_ids, block
        if block == FLASH:
            out, lse = _flash_ttt_forward(q, k0, v0, diag_k, diag_v, scale, segment_ids)
            ctx.save_for_backward(q, out, lse, k0, v0, *diag)
            return out
        kf, vf = _heads_first(k0, acc), _heads_first(v0, acc)                    # [B, h, T, d]
        out = torch.empty(B, T, h, v0.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(B, T, h, dtype=acc, device=q.device)
        for start, end, lo in query_blocks(T, block, segment_ids):
            rows = slice(start, end)
            hidden = _hidden(segment_ids, B, start, end, q.device, lo)
            q_blk = _heads_first(q[:, rows], acc)                                # [B, h, n, dqk]
            out_blk, lse_blk = _causal_block(q_blk, kf[:, :, lo:end], vf[:, :, lo:end], scale, hidden)
            if diag_k:
                # Diagonal logits: query t against step j's key at the same t.    each [B, h, n]
                s = [(q_blk * _heads_first(kj[:, rows], acc)).sum(-1).mul_(scale) for kj in diag_k]
                lse_blk, lse0 = torch.logsumexp(torch.stack((lse_blk, *s)), dim=0), lse_blk
                out_blk = out_blk.mul_(torch.exp(lse0 - lse_blk)[..., None])
                for s_j, vj in zip(s, diag_v):
                    out_blk.addcmul_(_heads_first(vj[:, rows], acc), torch.exp(s_j - lse_blk)[..., None])
            out[:, rows] = out_blk.transpose(1, 2)
            lse[:, rows] = lse_blk.transpose(1, 2)
        ctx.save_for_backward(q, out, lse, k0, v0, *diag)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out: Tensor) -> tuple[Tensor | None, ...]:
        q, out, lse, k0, v0, *diag = ctx.saved_tensors
        diag_k, diag_v = diag[:len(diag) // 2], diag[len(diag) // 2:]
        if ctx.block == FLASH:
            dq, dk0, dv0, d_diag_k, d_diag_v = _flash_ttt_backward(d_out, q, out, lse, k0, v0, diag_k, diag_v,
                                                                   ctx.scale, ctx.segment_ids)
            return (dq, None, None, None, dk0, dv0, *d_diag_k, *d_diag_v)
        B, T = q.shape[:2]
        acc, scale = lse.dtype, ctx.scale
        kf, vf = _heads_first(k0, acc), _heads_first(v0, acc)                    # [B, h, T, d]
        dq = torch.empty_like(q)                                                 # a block's rows are final
        dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)                      # every later block adds
        d_diag_k = [torch.empty_like(kj) for kj in diag_k]                       # rows are final, too
        d_diag_v = [torch.empty_like(vj) for vj in diag_v]
        for start, end, lo in query_blocks(T, ctx.block, ctx.segment_ids):
            rows = slice(start, end)
            hidden = _hidden(ctx.segment_ids, B, start, end, q.device, lo)
            q_blk = _heads_first(q[:, rows], acc)                                # [B, h, n, dqk]
            do_blk = _heads_first(d_out[:, rows], acc)                           # [B, h, n, dv]
            lse_blk = lse[:, rows].transpose(1, 2)                               # L [B, h, n]
            shift = (do_blk * _heads_first(out[:, rows], acc)).sum(-1)           # D [B, h, n]
            dq_blk = _causal_block_grads(q_blk, do_blk, kf[:, :, lo:end], vf[:, :, lo:end], lse_blk, shift,
                                         scale, hidden, dk[:, :, lo:end], dv[:, :, lo:end])
            for kj, vj, dkj, dvj in zip(diag_k, diag_v, d_diag_k, d_diag_v):
                k_blk, v_blk = _heads_first(kj[:, rows], acc), _heads_first(vj[:, rows], acc)
                p = torch.exp((q_blk * k_blk).sum(-1).mul_(scale) - lse_blk)     # [B, h, n]
                ds = p * ((do_blk * v_blk).sum(-1) - shift)
                dq_blk.addcmul_(k_blk, ds[..., None], value=scale)
                dkj[:, rows] = (q_blk * ds[..., None]).mul_(scale).transpose(1, 2)
                dvj[:, rows] = (do_blk * p[..., None]).transpose(1, 2)
            dq[:, rows] = dq_blk.transpose(1, 2)
        dk = dk.mul_(scale).transpose(1, 2).to(k0.dtype)
        return (dq, None, None, None, dk, dv.transpose(1, 2).to(v0.dtype), *d_diag_k, *d_diag_v)



# ---- the causal part on torch's fused CPU kernel ----------------------------------------------
# `block` value of _TTTAttention that selects torch's fused flash-attention CPU kernel for the
# causal part, run once per packed sample (is_causal within it, so no mask is built), instead of the
# plain-PyTorch query blocks. The kernel returns the log-sum-exp the diagonal keys merge with, and
# its backward recomputes the probabilities from whatever (output, log-sum-exp) it is handed: given
# the merged ones it yields the causal keys' share of the merged softmax's gradients.
FLASH = -1


def flash_available(q: Tensor) -> bool:
    """Whether torch's fused CPU attention kernel takes q: a CPU tensor in fp32 or bf16 (the blocked
    kernel serves other devices and fp64, which gradcheck uses)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)


def sample_spans(segment_ids: Tensor | None, B: int, T: int) -> list[tuple[int, int, int]]:
    """(row, start, end) of every run of equal segment ids (a packed sample, or the padding) in
    each row; the whole row when segment_ids is None."""
    if segment_ids is None:
        return [(b, 0, T) for b in range(B)]
    change = torch.ones_like(segment_ids, dtype=torch.bool)
    change[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    spans = []
    for b in range(B):
        starts = change[b].nonzero().flatten().tolist() + [T]
        spans += [(b, s, e) for s, e in zip(starts[:-1], starts[1:])]
    return spans


def _kernel_dtype(q: Tensor) -> torch.dtype:
    """The dtype the fused kernel runs in: bf16 where the training runs in bf16 (the kernel
    accumulates in fp32 and returns an fp32 log-sum-exp; on a CPU with bf16 units it is faster
    than in fp32: bench/results/train_kernels.json), else fp32. The merge with the diagonal keys and
    every gradient buffer stay in fp32."""
    return torch.bfloat16 if q.dtype == torch.bfloat16 else _accumulation_dtype(q)


# The fused kernel in bf16 keeps state for every sequence length it meets (on a CPU with AMX its
# matmul kernels are built per shape), and packed samples come in every length: the trainer's
# memory grew by 2 GiB over 100 steps. In bf16 a sample's span is therefore zero-padded at its end to
# a multiple of this many positions; under the causal mask no real query sees a padded key, and the
# padded queries' outputs are dropped (their zero output gradient gives the keys nothing).
FLASH_LENGTH_MULTIPLE = 64


def _kernel_length(n: int, dtype: torch.dtype) -> int:
    """The length a span of n positions runs at on the fused kernel in `dtype` (see above)."""
    if dtype != torch.bfloat16:
        return n
    return -(-n // FLASH_LENGTH_MULTIPLE) * FLASH_LENGTH_MULTIPLE


def _kernel_spans(segment_ids: Tensor | None, B: int, T: int, dtype: torch.dtype
                  ) -> list[tuple[int, int, int, int, int]]:
    """(row, start, end, n, m) of every packed sample (sample_spans): its n positions and the m it
    runs at on the fused kernel in `dtype` (_kernel_length)."""
    return [(b, start, end, end - start, _kernel_length(end - start, dtype))
            for b, start, end in sample_spans(segment_ids, B, T)]


def _flash_heads(x: Tensor, b: int, start: int, end: int, dtype: torch.dtype, width: int, length: int) -> Tensor:
    """x[b, start:end] [n, h, d] -> [1, h, length, width] in dtype, zero-padded to width (the fused
    kernel wants one head size for q, k and v; MLA's values are narrower than its keys) and to length
    positions at the end (_kernel_length)."""
    y = x[b, start:end].transpose(0, 1).to(dtype)[None]
    pad_d, pad_n = max(0, width - y.shape[-1]), length - y.shape[-2]
    return F.pad(y, (0, pad_d, 0, pad_n)) if pad_d or pad_n else y


def _flash_ttt_forward(q: Tensor, k0: Tensor, v0: Tensor, diag_k: tuple[Tensor, ...], diag_v: tuple[Tensor, ...],
                       scale: float, segment_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """_TTTAttention's forward with the causal part per sample on the fused kernel, merged with the
    diagonal keys over the whole row: (out [B, T, h, dv] in q's dtype, L [B, T, h] fp32)."""
    B, T, h, dqk = q.shape
    dv = v0.shape[-1]
    acc, kern = _accumulation_dtype(q), _kernel_dtype(q)
    out0 = torch.empty(B, T, h, dv, dtype=acc, device=q.device)
    lse0 = torch.empty(B, T, h, dtype=acc, device=q.device)
    for b, start, end, n, m in _kernel_spans(segment_ids, B, T, kern):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _flash_heads(q, b, start, end, kern, dqk, m), _flash_heads(k0, b, start, end, kern, dqk, m),
            _flash_heads(v0, b, start, end, kern, dqk, m), 0.0, True, scale=scale)
        out0[b, start:end] = o[0, :, :n, :dv].transpose(0, 1)
        lse0[b, start:end] = lse[0, :, :n].transpose(0, 1)
    if not diag_k:
        return out0.to(q.dtype), lse0
    qf = q.to(acc)
    s = [(qf * kj.to(acc)).sum(-1).mul_(scale) for kj in diag_k]                 # each [B, T, h]
    lse_all = torch.logsumexp(torch.stack((lse0, *s)), dim=0)
    out = out0.mul_(torch.exp(lse0 - lse_all)[..., None])
    for s_j, vj in zip(s, diag_v):
        out.addcmul_(vj.to(acc), torch.exp(s_j - lse_all)[..., None])
    return out.to(q.dtype), lse_all


def _flash_ttt_backward(d_out: Tensor, q: Tensor, out: Tensor, lse: Tensor, k0: Tensor, v0: Tensor,
                        diag_k: tuple[Tensor, ...], diag_v: tuple[Tensor, ...], scale: float,
                        segment_ids: Tensor | None) -> tuple[Tensor, Tensor, Tensor, list[Tensor], list[Tensor]]:
    """The gradients of _flash_ttt_forward: (dq, dK0, dV0, [dK_j], [dV_j]), each in its input's
    dtype. With P = exp(S - L) and D = rowsum(dO * O) over the merged softmax: the fused backward
    handed the merged (O, L) gives the causal keys' part, the diagonal keys' part is per row."""
    B, T, h, dqk = q.shape
    dv = v0.shape[-1]
    acc, kern = lse.dtype, _kernel_dtype(q)
    dq = torch.empty(B, T, h, dqk, dtype=acc, device=q.device)
    dk0 = torch.empty(B, T, h, dqk, dtype=acc, device=q.device)
    dv0 = torch.empty(B, T, h, dv, dtype=acc, device=q.device)
    for b, start, end, n, m in _kernel_spans(segment_ids, B, T, kern):
        g = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _flash_heads(d_out, b, start, end, kern, dqk, m), _flash_heads(q, b, start, end, kern, dqk, m),
            _flash_heads(k0, b, start, end, kern, dqk, m), _flash_heads(v0, b, start, end, kern, dqk, m),
            _flash_heads(out, b, start, end, kern, dqk, m),
            F.pad(lse[b, start:end].transpose(0, 1)[None], (0, m - n)).contiguous(),
            0.0, True, scale=scale)
        dq[b, start:end] = g[0][0, :, :n].transpose(0, 1)
        dk0[b, start:end] = g[1][0, :, :n].transpose(0, 1)
        dv0[b, start:end] = g[2][0, :, :n, :dv].transpose(0, 1)
    d_diag_k, d_diag_v = [], []
    if diag_k:
        qf, do = q.to(acc), d_out.to(acc)
        shift = (do * out.to(acc)).sum(-1)                                       # D [B, T, h]
        for kj, vj in zip(diag_k, diag_v):
            kf, vf = kj.to(acc), vj.to(acc)
            p = torch.exp((qf * kf).sum(-1).mul_(scale) - lse)                   # [B, T, h]
            ds = p * ((do * vf).sum(-1) - shift)
            dq.addcmul_(kf, ds[..., None], value=scale)
            d_diag_k.append((qf * ds[..., None]).mul_(scale).to(kj.dtype))
            d_diag_v.append((do * p[..., None]).to(vj.dtype))
    return dq.to(q.dtype), dk0.to(k0.dtype), dv0.to(v0.dtype), d_diag_k, d_diag_v


def causal_attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, scale: float, segment_ids: Tensor | None = None,
    block_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal (per-sample) attention and its log-sum-exp, differentiable in both.

    q, k: [B, T, heads, dqk]; v: [B, T, heads, dv] -> out [B, T, heads, dv] fp32, lse [B, T, heads] fp32
    (fp64 for fp64 inputs). Exact, block_size queries at a time (default `attention_block_size`),
    each against the keys up to its own end, in fp32: O(block_size x T) memory per head for the
    scores, O(T) saved for the backward. Gradients come back in the inputs' dtypes.
    """
    B, T, h = q.shape[:3]
    block = attention_block_size(B, h, T) if block_size is None else block_size
    if block < 1:
        raise ValueError(f"block_size {block_size}: at least 1 query per block")
    return _CausalAttentionWithLse.apply(q, k, v, scale, segment_ids, block)


def attention_ttt(q: Tensor, cache: TTTCache, scale: float, segment_ids: Tensor | None = None,
                  block_size: int | None = None, fused: bool = True) -> Tensor:
    """Memory-efficient TTT attention. q: [B, T, heads, dqk] -> [B, T, heads, dv] in q's dtype.

    Exact, accumulated in fp32; saves for the backward q, the cache's keys and values, the output
    and one log-sum-exp per query and head. With `fused`, the causal part runs on torch's fused CPU
    kernel, once per packed sample, where `flash_available` (the CPU in fp32 or bf16) and no
    block_size is given, with bf16 operands for bf16 inputs (`_kernel_dtype`); else block_size
    queries at a time (default `attention_block_size`) in plain PyTorch, upcast to fp32."""
    B, T, h = q.shape[:3]
    if fused and block_size is None and flash_available(q):
        block = FLASH
    else:
        block = attention_block_size(B, h, T) if block_size is None else block_size
        if block < 1:
            raise ValueError(f"block_size {block_size}: at least 1 query per block")
    return _TTTAttention.apply(q, scale, segment_ids, block, cache.k0, cache.v0, *cache.diag_k, *cache.diag_v)


def ttt_mask(T: int, num_steps: int, segment_ids: Tensor | None, B: int, device: torch.device) -> Tensor:
    """[B, 1, T, num_steps*T] bool, the TTT mask over keys concatenated step by step:
    (kv < T and q >= kv and same sample) or (kv >= T and (kv - q) % T == 0)."""
    qi = torch.arange(T, device=device)[:, None]
    kv = torch.arange(num_steps * T, device=device)[None, :]
    causal = (kv < T) & (qi >= kv)
    diagonal = (kv >= T) & ((kv - qi) % T == 0)
    if segment_ids is None:
        return (causal | diagonal).expand(B, 1, T, num_steps * T)
    kv_seg = segment_ids.repeat(1, num_steps)                            # [B, num_steps*T]
    same = segment_ids[:, :, None] == kv_seg[:, None, :]
    return ((causal & same) | diagonal)[:, None]


def attention_reference(q: Tensor, cache: TTTCache, scale: float, segment_ids: Tensor | None = None) -> Tensor:
    """TTT attention with the explicit mask (O(T^2 * K)); the ground truth for `attention_ttt`."""
    B, T = q.shape[:2]
    keys = torch.cat((cache.k0, *cache.diag_k), dim=1).float()          # [B, (k+1)T, heads, dqk]
    values = torch.cat((cache.v0, *cache.diag_v), dim=1).float()        # [B, (k+1)T, heads, dv]
    scores = torch.einsum("bthd,bshd->bhts", q.float(), keys) * scale   # [B, h, T, (k+1)T]
    scores = scores.masked_fill(~ttt_mask(T, cache.num_steps, segment_ids, B, q.device), float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), values)
    return out.to(q.dtype)


ATTENTION_IMPLS = {"ttt": attention_ttt, "ttt_blocked": partial(attention_ttt, fused=False),
                   "reference": attention_reference}
