"""The dense loss: chunked soft cross-entropy of the draft against the verifier's distribution
(train/objective.py runs it per TTT step).

Per counted position: -sum_v p_T(v) log q_k(v), the verifier's distribution p_T against the
draft's q_k. With a pruned draft vocabulary the target is the verifier's distribution restricted
to the draft's tokens (t2d) and renormalised; top-1 agreement always compares with the verifier's
argmax over the full vocabulary.

Acceptance term (`acceptance`, dense loss only). Speculative sampling accepts a token drawn from
the draft q with probability alpha = sum_v min(p_v, q_v) = 1 - TV(p, q), which the soft CE only
raises indirectly (it weighs every token by p, also those where q already covers p). `tv` adds
acceptance_weight * (1 - alpha) per counted position, `lk` acceptance_weight * -log max(alpha,
1e-6), which pushes hardest where acceptance is lowest; `hybrid` replaces the row's soft CE by
lambda CE + (1 - lambda)(1 - alpha), lambda = exp(-eta alpha) held constant in the backward, eta =
acceptance_weight: the CE's steady gradients where acceptance is low, acceptance itself where it
is high (the LK losses' adaptive mix of KL and TV). p is the CE's target: on a pruned
vocabulary, restricted and renormalised. The gradient w.r.t. the draft logits of -alpha is
-q_j ([q_j < p_j] - A), A = sum_{v: q_v < p_v} q_v (a tie q_j = p_j counts as q_j >= p_j: min is
then p_j, constant in z); -log alpha divides it by alpha. Both need the whole p, so the term is
refused with top-k targets. The loss and loss_sum then hold CE + term, what is optimised.

Target cache: the K steps read the same rows of F shifted by one, so when a micro-batch's
[rows, Vd] fp32 target probabilities fit `target_cache_bytes`, they are computed once
(TargetCache) and every step's forward and backward reads them; otherwise (Kimi's V = 163,840
at 8k-token rows) the loss recomputes them per chunk as below. Same maths either way.

Memory: the verifier's and the draft's logits exist for a chunk of rows at a time, in the forward
and in the backward, which recomputes them (train/logit_blocks.py). The loss reads each step's
target rows of F by index, a chunk at a time.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from config.choices import Acceptance, names
from train.logit_blocks import LogitBlocks, accumulate_grads, row_argmax, softmax_

# -log alpha's floor: alpha is exactly 0 in fp32 when p and q share no mass (one underflows
# wherever the other has mass), and -log 0 = inf would stop the run; its gradient, bounded for
# alpha > 0, would be 0/0. Below the floor the term is the constant 13.8 and the CE alone pulls.
ALPHA_FLOOR = 1e-6


def check_acceptance(kind: str | None) -> None:
    """Refuse an acceptance term other than null, tv, lk or hybrid (the chunked maths treats any other as lk)."""
    if kind is not None and kind not in names(Acceptance):
        raise ValueError(f"acceptance={kind!r}: one of {', '.join(names(Acceptance))} or null")


class TargetCache(NamedTuple):
    """The verifier's target on every row of a micro-batch some TTT step reads, computed once: the
    K steps read the same rows shifted by one, so each row's [V] logits are computed once instead
    of twice per step (forward, and the backward's recomputation)."""

    probs: Tensor     # [R, Vd] fp32: p on the draft vocabulary (restricted and renormalised when pruned)
    top: Tensor       # [R] the verifier's top-1 (target ids)
    index: Tensor     # [B, T] int64: row r of sample position (b, t) in probs, -1 where no step reads it


def build_target_cache(final: Tensor, read: Tensor, target_head: Tensor, keep: Tensor | None,
                       draft_vocab: int, chunk: int) -> TargetCache:
    """final [B, T, H], read [B, T] bool (rows some step reads) -> TargetCache, a chunk of rows at
    a time through the same maths as the uncached loss (LogitBlocks.target_probs)."""
    b, t = read.nonzero(as_tuple=True)
    R = b.numel()
    probs = torch.empty(R, draft_vocab, dtype=torch.float32, device=final.device)
    top = torch.empty(R, dtype=torch.long, device=final.device)
    index = torch.full(read.shape, -1, dtype=torch.long, device=final.device)
    index[b, t] = torch.arange(R, device=final.device)
    if R:
        blocks = LogitBlocks(min(chunk, R), target_head.shape[0], draft_vocab, keep is not None, final.dtype, final.device)
        for c in range(0, R, chunk):
            p, top[c:c + chunk] = blocks.target_probs(final[b[c:c + chunk], t[c:c + chunk]], target_head, keep)
            probs[c:c + chunk] = p
    return TargetCache(probs, top, index)


def _cached_probs(blocks: LogitBlocks, cache: TargetCache, rows: Tensor) -> tuple[Tensor, Tensor]:
    """target_probs read from a TargetCache: (p [c, Vd] in the blocks' own target buffer, which the
    loss overwrites, top-1 [c]) of the cache rows `rows` [c]."""
    p = torch.index_select(cache.probs, 0, rows, out=blocks.target[:rows.shape[0], :cache.probs.shape[1]])
    return p, cache.top[rows]


class ChunkedSoftCE(torch.autograd.Function):
    """sum_n -sum_v p_T(v | n) log softmax(normed_n @ head.T)_v over N rows, a chunk at a time,
    plus, with `acceptance`, weight * (1 - alpha_n) (tv) or weight * -log max(alpha_n, ALPHA_FLOOR)
    (lk) per row, alpha_n = sum_v min(p_T(v | n), q(v | n)) (module docstring).

    Saves only its inputs (and alpha [N] with the acceptance term); the backward recomputes each
    chunk's logits, so no [N, V] tensor exists in either pass (peak: about three [chunk, V] fp32
    blocks, four with the acceptance term). Gradient w.r.t. the draft logits: softmax(z) - p
    (p sums to 1), plus the acceptance term's c_n q (A - [q < p]) (_acceptance_grad_).
    """

    @staticmethod
    def forward(ctx, normed: Tensor, head: Tensor, target_hidden: Tensor | None, target_head: Tensor,
                keep: Tensor | None, chunk: int, cache: TargetCache | None = None,
                rows: Tensor | None = None, acceptance: str | None = None,
                acceptance_weight: float = 1.0, recording: bool = False) -> tuple[Tensor, Tensor]:
        loss = torch.zeros((), dtype=torch.float64, device=normed.device)
        N = normed.shape[0]
        correct = torch.zeros(N, dtype=torch.bool, device=normed.device)
        alpha = None if acceptance is None else torch.empty(N, dtype=torch.float32, device=normed.device)
        # The plain soft CE's gradients are known once a chunk's softmax is: computed here, they
        # spare the backward its second pass over the logits (a matmul and a softmax per chunk).
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        eager = recording and acceptance is None and (want_x or want_w)
        blocks = _target_blocks(normed, head, target_head, keep, chunk, cache, acceptance is not None or eager)
        grad_x = torch.empty_like(normed) if eager and want_x else None
        grad_w = torch.zeros(head.shape, dtype=torch.float32, device=head.device) if eager and want_w else None
        for c in range(0, N, chunk):
            p, top = (_cached_probs(blocks, cache, rows[c:c + chunk]) if cache is not None
                      else blocks.target_probs(_chunk_rows(target_hidden, rows, c, chunk), target_head, keep))
            z = blocks.logits(blocks.draft, normed[c:c + chunk], head)    # [c, Vd]
            pred = row_argmax(z)
            correct[c:c + chunk] = (keep[pred] if keep is not None else pred) == top
            if acceptance is not None:
                row_loss, alpha[c:c + chunk] = _ce_and_alpha_(p, z, blocks.accept[:z.shape[0]])
                a = alpha[c:c + chunk]
                if acceptance == "hybrid":
                    lam = _hybrid_lambda(a, acceptance_weight)
                    row_loss = lam * row_loss + (1 - lam) * (1 - a)
                else:
                    row_loss += acceptance_weight * _acceptance_term(a, acceptance)
                loss += row_loss.sum().double()
                continue
            # -sum p log q = lse(z) - sum p z   (p sums to 1)
            if eager:
                pz = torch.mul(p, z, out=blocks.accept[:z.shape[0]]).sum(-1)
                m = z.amax(-1)
                e = z.sub_(m[:, None]).exp_()
                total = e.sum(-1)
                loss += (total.log() + m - pz).sum().double()
                dz = e.div_(total[:, None]).sub_(p)                         # [c, Vd] softmax(z) - p
                accumulate_grads(blocks, dz, normed[c:c + chunk], head,
                                  grad_x[c:c + chunk] if want_x else None, grad_w)
                continue
            pz = p.mul_(z).sum(-1)
            m = z.amax(-1)
            lse = z.sub_(m[:, None]).exp_().sum(-1).log_().add_(m)
            loss += (lse - pz).sum().double()
        if eager:
            ctx.save_for_backward(grad_x, grad_w)
            ctx.eager, ctx.head_dtype = True, head.dtype
            ctx.mark_non_differentiable(correct)
            return loss, correct
        ctx.eager = False
        ctx.save_for_backward(normed, head, target_hidden, target_head, keep, rows, alpha)
        ctx.chunk, ctx.cache = chunk, cache
        ctx.acceptance, ctx.acceptance_weight = acceptance, acceptance_weight
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:
        rest = (None,) * 9
        if ctx.eager:                                           # gradients of the loss sum, from the forward
            grad_x, grad_w = ctx.saved_tensors
            g = grad_loss.float()
            return (None if grad_x is None else grad_x * g.to(grad_x.dtype),
                    None if grad_w is None else (grad_w * g).to(ctx.head_dtype), *rest)
        normed, head, target_hidden, target_head, keep, rows, alpha = ctx.saved_tensors
        cache, acceptance = ctx.cache, ctx.acceptance
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N, chunk = normed.shape[0], ctx.chunk
        grad_x = torch.empty_like(normed) if want_x else None
        grad_w = torch.zeros(head.shape, dtype=torch.float32, device=head.device) if want_w else None
        blocks = _target_blocks(normed, head, target_head, keep, chunk, cache, acceptance is not None)
        g = grad_loss.float()
        scale = None if acceptance is None else _acceptance_scale(alpha, acceptance, ctx.acceptance_weight)
        for c in range(0, N, chunk):
            x = normed[c:c + chunk]
            p, _ = (_cached_probs(blocks, cache, rows[c:c + chunk]) if cache is not None
                    else blocks.target_probs(_chunk_rows(target_hidden, rows, c, chunk), target_head, keep,
                                             with_top=False))
            if acceptance is None:
                dz = softmax_(blocks.logits(blocks.draft, x, head)).sub_(p).mul_(g)   # [c, Vd] d loss / d z
            else:
                q = softmax_(blocks.logits(blocks.draft, x, head))                    # [c, Vd]
                d_alpha = _acceptance_grad_(q, p, blocks.accept[:q.shape[0]])        # [c, Vd] d(-alpha)/dz
                dz = q.sub_(p)
                if acceptance == "hybrid":                                           # lambda is held constant
                    dz.mul_(_hybrid_lambda(alpha[c:c + chunk], ctx.acceptance_weight)[:, None])
                dz.addcmul_(d_alpha, scale[c:c + chunk, None]).mul_(g)
            accumulate_grads(blocks, dz, x, head, grad_x[c:c + chunk] if want_x else None, grad_w)
        return grad_x, None if grad_w is None else grad_w.to(head.dtype), None, None, None, None, None, None, None, None, None


def _chunk_rows(target_hidden: Tensor, rows: Tensor | None, c: int, chunk: int) -> Tensor:
    """The verifier states [c, H] of rows c..c+chunk: the next rows of target_hidden, or those
    `rows` names in it."""
    return target_hidden[c:c + chunk] if rows is None else target_hidden[rows[c:c + chunk]]


def _ce_and_alpha_(p: Tensor, z: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """(soft CE [c], alpha [c] = sum_v min(p_v, q_v)) of p [c, Vd] (target) and z [c, Vd] (draft
    logits); q [c, Vd] is a buffer for the draft's softmax. Overwrites all three."""
    m = z.amax(-1)
    q = torch.sub(z, m[:, None], out=q).exp_()
    s = q.sum(-1)
    alpha = torch.minimum(q.div_(s[:, None]), p, out=q).sum(-1)
    pz = p.mul_(z).sum(-1)
    return s.log_().add_(m) - pz, alpha                              # lse(z) - sum p z, as above


def _acceptance_term(alpha: Tensor, kind: str) -> Tensor:
    """[c] -> [c]: the per-row acceptance term before its weight."""
    return 1 - alpha if kind == "tv" else -alpha.clamp(min=ALPHA_FLOOR).log()


def _hybrid_lambda(alpha: Tensor, eta: float) -> Tensor:
    """[c] -> [c] the hybrid's weight of the soft CE, exp(-eta alpha): the CE's steady gradients
    while acceptance is low, the acceptance itself (TV) as it grows."""
    return torch.exp(-eta * alpha)


def _acceptance_scale(alpha: Tensor, kind: str, weight: float) -> Tensor:
    """[N] -> [N] c_n: d(weight * term) / d(-alpha) per row; lk's is 0 below the floor, where the
    clamped term is constant; the hybrid's TV weighs 1 - lambda."""
    if kind == "tv":
        return torch.full_like(alpha, weight)
    if kind == "hybrid":
        return 1 - _hybrid_lambda(alpha, weight)
    return torch.where(alpha >= ALPHA_FLOOR, weight / alpha.clamp(min=ALPHA_FLOOR), torch.zeros_like(alpha))


def _acceptance_grad_(q: Tensor, p: Tensor, out: Tensor) -> Tensor:
    """d(-alpha)/dz [c, Vd] = q (A - [q < p]) into out, A = sum_{v: q_v < p_v} q_v [c]. A tie
    q_v = p_v is outside the set, as min(p_v, q_v) = p_v there; the set is the same for A and
    the indicator, so each row of the gradient sums to 0, as softmax's must."""
    below = torch.lt(q, p, out=out)                                  # [c, Vd] 1.0 where q < p
    below.mul_(q)                                                    # q [q < p]
    A = below.sum(-1, keepdim=True)                                  # [c, 1]
    return below.neg_().addcmul_(q, A)


def _target_blocks(normed: Tensor, head: Tensor, target_head: Tensor, keep: Tensor | None, chunk: int,
                   cache: TargetCache | None, acceptance: bool = False) -> LogitBlocks | None:
    """The blocks of one ChunkedSoftCE pass: with a cache, p is copied into a [chunk, Vd] block
    and no verifier logits are computed."""
    N = normed.shape[0]
    if not N:
        return None
    if cache is not None:
        return LogitBlocks(min(chunk, N), head.shape[0], head.shape[0], False, normed.dtype, normed.device, acceptance)
    return LogitBlocks(min(chunk, N), target_head.shape[0], head.shape[0], keep is not None, normed.dtype,
                   normed.device, acceptance)


def soft_cross_entropy(normed: Tensor, head: Tensor, target_hidden: Tensor | None, target_head: Tensor,
                       keep: Tensor | None, chunk: int, cache: TargetCache | None = None,
                       rows: Tensor | None = None, acceptance: str | None = None,
                       acceptance_weight: float = 1.0) -> tuple[Tensor, Tensor]:
    """(sum of soft cross-entropies, [N] bool: draft top-1 == verifier top-1) over N rows.

    normed [N, H]: the draft's norm output; head [Vd, H]: draft lm_head; target_hidden [N, H]:
    the verifier's final hidden states; target_head [V, H]: its lm_head; keep [Vd]: target id
    of each draft id (pruned vocabulary) or None. With a TargetCache, rows [N] (its row of each
    of the N) replace target_hidden, and no verifier logits are computed. Without one, rows [N]
    may name each one's row in target_hidden [R, H] instead: the loss then reads them a chunk at
    a time and keeps no [N, H] copy for the backward. acceptance "tv" | "lk":
    the sum also holds acceptance_weight times each row's acceptance term (module docstring).
    """
    check_acceptance(acceptance)
    # Whether autograd records this call: inside forward grad mode is always off, and
    # needs_input_grad says only which inputs require grad.
    return ChunkedSoftCE.apply(normed, head, target_hidden, target_head, keep, chunk, cache, rows,
                               acceptance, acceptance_weight, torch.is_grad_enabled())
