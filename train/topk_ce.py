"""The loss from top-k targets: chunked bucket cross-entropy (train/objective.py runs it per TTT
step, on a top-k store's batches or on final states turned into their top-k).

Loss from top-k targets. A store may keep, instead of F, the verifier's k most likely next
tokens and their log-probabilities (Batch fields target_ids, target_logprobs; model/batch.py),
read at the same row t+1+k. The target is then known on its top-k only, so step k's loss is the
cross-entropy between the (k+1)-bucket coarsenings of target and draft, the buckets being each
token of S (the top-k ids the draft vocabulary has) and "any other token":

    p_i = p_T(i) for i in S,  r = max(0, 1 - sum_S p_i),  q = softmax(draft logits),  Q = sum_S q_i
    loss = -sum_S p_i log q_i - r log(1 - Q)            (the r term is 0 when r = 0)

It is the cross-entropy the stored targets determine: with k = V and the full vocabulary it is
the dense loss above, and its gradient w.r.t. the draft logits, q - p~ with p~ = p on S and
p~_v = r q_v / (1 - Q) off S, pulls the draft to the target's probability on every token of S and
to its mass r on the rest, which it spreads the draft's own way (nothing more is known of it).
Unlike the dense loss it does not renormalise the target over a pruned draft vocabulary: the mass
of top-k tokens the draft lacks stays in r, the "other" bucket. Where S covers the whole draft
vocabulary the draft has no other token, and the r term is dropped. Top-1 agreement compares with
target_ids[..., 0], the verifier's argmax over the full vocabulary, as in the dense case. Merging
tokens lowers both entropy and KL, so this loss is at most the dense one on the same positions:
compare losses only between runs with the same kind of targets (top-1 agreement compares across).

Top-k targets from final states (`target_topk` k): the objective turns a batch's final states
into the verifier's top-k once per micro-batch, on the rows some step reads (row r where the
token r+1 is counted), and trains with the bucket cross-entropy above. The dense loss evaluates
the verifier's [rows, V] logits 2K times per micro-batch (each step's forward, and again in its
backward); this evaluates them once and never again, at the price of knowing the target on its
top-k only, the same approximation a top-k store makes.
"""
from __future__ import annotations

import torch
from torch import Tensor

from model.batch import Batch
from model.chain import read_rows
from train.logit_blocks import LogitBlocks, accumulate_grads, logsumexp_, row_argmax


def topk_targets(batch: Batch, target_head: Tensor, k: int, chunk_bytes: int) -> Batch:
    """A final-state batch trained towards the verifier's top-k instead: target_ids [B, T, k] (-1
    on unread rows) and target_logprobs [B, T, k] (-inf there) on every row some TTT step reads,
    row r of a sample whose next token r+1 is in the loss mask (model/chain.py's step_inputs counts
    t iff loss_mask[t+2+k], reading row t+1+k). Shapes and fills are those of a top-k store's
    batches."""
    rows = read_rows(batch)                                                     # [B, T]
    b, t = rows.nonzero(as_tuple=True)
    B, T = rows.shape
    ids = torch.full((B, T, k), -1, dtype=torch.int64, device=rows.device)
    logprobs = torch.full((B, T, k), float("-inf"), dtype=torch.float32, device=rows.device)
    if b.numel():
        # Here, not at the top: importing store.encoding runs the store package (zarr, numcodecs,
        # crc32c), which a step on final states never needs (bench/gpu_train.py runs without it).
        from store.encoding import verifier_topk

        ids[b, t], logprobs[b, t] = verifier_topk(batch.final[b, t], target_head, k, chunk_bytes // 4)
    return batch.with_topk(ids, logprobs)


def draft_ids_of(target_ids: Tensor, keep: Tensor | None, draft_vocab: int) -> Tensor:
    """Target ids [...] (-1: none) -> draft ids [...], -1 where the draft vocabulary lacks the token.

    keep [Vd]: target id of each draft id (pruned vocabulary), or None (draft id == target id)."""
    if keep is None:
        return torch.where((target_ids >= 0) & (target_ids < draft_vocab), target_ids, -1)
    kept, order = keep.sort()                                            # [Vd] ascending target ids
    pos = torch.searchsorted(kept, target_ids.clamp(min=0)).clamp_(max=kept.numel() - 1)
    hit = (kept[pos] == target_ids) & (target_ids >= 0)
    return torch.where(hit, order[pos], -1)


def _mask_set_(z: Tensor, in_set: Tensor, idx: Tensor) -> Tensor:
    """z [c, Vd] with the columns idx [c, k] where in_set [c, k] set to -inf, in place."""
    rows, cols = in_set.nonzero(as_tuple=True)
    return z.index_put_((rows, idx[rows, cols]), z.new_tensor(float("-inf")))


def _draft_blocks(normed: Tensor, head: Tensor, chunk: int) -> LogitBlocks | None:
    """The draft-logits block (and low-precision scratch) of one pass; no verifier block: the top-k
    loss never forms verifier logits. None without rows."""
    N = normed.shape[0]
    return LogitBlocks(min(chunk, N), 0, head.shape[0], False, normed.dtype, normed.device) if N else None


class ChunkedTopKCE(torch.autograd.Function):
    """sum_n -sum_S p_i log q_i - r log(1 - Q) over N rows (module docstring), a chunk at a time.

    draft_ids [N, k]: the target's top-k as draft ids, -1 where the draft lacks the token (or the
    row is padding); probs [N, k]: their target probabilities. Saves its inputs, three [N, k] and
    three [N] tensors; the backward recomputes each chunk's logits, so the peak is one [chunk, Vd]
    fp32 block (plus its low-precision copy). log(1 - Q) = lse(z off S) - lse(z), with z off S summed on
    its own, so a draft that puts almost all its mass on S loses no precision. Gradient w.r.t. the
    logits: (P + r) q - p~, p~ = p on S and r q_v / (1 - Q) off S (P = sum_S p; P + r = 1 unless
    rounding pushes P past 1).
    """

    @staticmethod
    def forward(ctx, normed: Tensor, head: Tensor, draft_ids: Tensor, probs: Tensor, top: Tensor,
                keep: Tensor | None, chunk: int) -> tuple[Tensor, Tensor]:
        N, device = normed.shape[0], normed.device
        in_set = draft_ids >= 0                                          # [N, k] i in S
        idx = draft_ids.clamp(min=0)                                     # [N, k] gatherable
        p = torch.where(in_set, probs.float(), 0.0)                      # [N, k] 0 off S
        r = (1 - p.sum(-1)).clamp_(min=0)                                # [N] target mass off S
        lse = torch.zeros(N, dtype=torch.float32, device=device)         # [N] lse(z)
        lse_off = torch.zeros(N, dtype=torch.float32, device=device)     # [N] lse(z off S)
        on_set = torch.zeros(N, dtype=torch.float32, device=device)      # [N] -sum_S p log q
        correct = torch.zeros(N, dtype=torch.bool, device=device)
        blocks = _draft_blocks(normed, head, chunk)
        for c in range(0, N, chunk):
            s = slice(c, c + chunk)
            z = blocks.logits(blocks.draft, normed[s], head)             # [c, Vd]
            pred = row_argmax(z)
            correct[s] = (keep[pred] if keep is not None else pred) == top[s]
            z_set = z.gather(1, idx[s])                                  # [c, k] (column 0 off S)
            lse_off[s] = logsumexp_(_mask_set_(z, in_set[s], idx[s]))
            set_lse = z_set.masked_fill(~in_set[s], float("-inf")).logsumexp(-1)
            lse[s] = torch.logaddexp(set_lse, lse_off[s])
            on_set[s] = (p[s] * (lse[s, None] - z_set)).sum(-1)          # p is 0 off S: z_set's 0 there is finite
        # No draft token off S: the draft has no "other" bucket to put r in; drop the term.
        r = torch.where(lse_off > float("-inf"), r, torch.zeros_like(r))
        off_set = torch.where(r > 0, r * (lse - lse_off), torch.zeros_like(r))   # -r log(1 - Q)
        ctx.save_for_backward(normed, head, idx, in_set, p, r, lse, lse_off)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(correct)
        return (on_set + off_set).double().sum(), correct

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:
        normed, head, idx, in_set, p, r, lse, lse_off = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N, chunk = normed.shape[0], ctx.chunk
        grad_x = torch.empty_like(normed) if want_x else None
        grad_w = torch.zeros(head.shape, dtype=torch.float32, device=head.device) if want_w else None
        blocks = _draft_blocks(normed, head, chunk)
        g = grad_loss.float()
        weight = p.sum(-1) + r                                           # [N] P + r
        # Off S: dz_v = (P + r) q_v - r exp(z_v - lse_off) = e_v * ((P + r)(1 - Q) - r) with
        # e_v = exp(z_v - lse_off) <= 1 and 1 - Q = exp(lse_off - lse): no overflow when Q -> 1.
        has_off = lse_off > float("-inf")
        base = torch.where(has_off, lse_off, lse)                        # [N] e = q where nothing is off S
        off_coef = weight * torch.exp(lse_off - lse) - r                 # [N] (0 where nothing is off S)
        for c in range(0, N, chunk):
            s = slice(c, c + chunk)
            x = normed[s]
            z = blocks.logits(blocks.draft, x, head)                     # [c, Vd]
            on = weight[s, None] * (z.gather(1, idx[s]) - lse[s, None]).exp() - p[s]   # [c, k] on S
            dz = z.sub_(base[s, None]).exp_().mul_(off_coef[s, None])     # [c, Vd] off S
            rows, cols = in_set[s].nonzero(as_tuple=True)
            dz.index_put_((rows, idx[s][rows, cols]), on[rows, cols]).mul_(g)
            accumulate_grads(blocks, dz, x, head, grad_x[s] if want_x else None, grad_w)
        return grad_x, None if grad_w is None else grad_w.to(head.dtype), None, None, None, None, None


def topk_cross_entropy(normed: Tensor, head: Tensor, target_ids: Tensor, target_logprobs: Tensor,
                       keep: Tensor | None, chunk: int) -> tuple[Tensor, Tensor]:
    """(sum of bucket cross-entropies, [N] bool: draft top-1 == verifier top-1) over N rows.

    normed [N, H]: the draft's norm output; head [Vd, H]: draft lm_head; target_ids [N, k]: the
    verifier's top-k next tokens (target ids, most likely first; -1 none); target_logprobs [N, k]:
    their log-probabilities (-inf none); keep [Vd]: target id of each draft id or None.
    The target is not renormalised over the draft vocabulary (module docstring).
    """
    draft_ids = draft_ids_of(target_ids, keep, head.shape[0])            # [N, k]
    probs = target_logprobs.float().exp()                                # [N, k], -inf -> 0
    return ChunkedTopKCE.apply(normed, head, draft_ids, probs, target_ids[:, 0], keep, chunk)
