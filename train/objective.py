"""The training objective: TTT unrolled over K steps, chunked soft cross-entropy, per-step metrics;
over 500 lines because its two chunked losses (dense soft CE and top-k bucket CE)
share their block maths (_Blocks, _accumulate_grads) and the TTT alignment; split, each half would
import the other's internals.

Alignment, for one sample x[0..T-1] with loss mask l, aux states A and
the verifier's final hidden states F (softmax(lm_head(F_t)) = p(x_{t+1} | x<=t)):

    step k, position t:  input    [embed(x_{t+1+k}), h_k(t)]    h_0 = fc(A_t), h_{k+1} = pre-norm output of step k
                         position position_ids[t] + k
                         target   softmax(lm_head_T(F_{t+1+k})) = p(x_{t+2+k} | x<=t+1+k)
                         counted  iff l[t+2+k] = 1 and t+2+k is inside the sample

The mask is the predicted token's: a position counts iff the token its target distribution
predicts (x_{t+2+k}) was written by the assistant. So the loss covers every assistant token,
from the first of a turn to its closing <|im_end|>, and never the prediction of the next turn's
header. (Public trainers index the mask two positions earlier, l[t], which drops the first two
tokens of every answer and counts two past its end; the shift is tested on a hand-built row.)
Ids, mask and target shift by one more per step and never cross into the next packed sample (model/chain.py runs the chain).

Metrics per step k: soft cross-entropy, and top-1 agreement acc_k (draft argmax == verifier
argmax) over step k's counted positions. Position t of step k is the k-th draft of the chain that
starts after x_{t+1}, so the chain statistics are exact too: chain_k counts step-0 positions whose
steps 0..k are all counted and agree, i.e. what vLLM reports as accepted tokens per position for
greedy chain drafting on this text (train/metrics.py turns both into accept lengths).

Loss: step k's soft cross-entropy -sum_v p_T(v) log q_k(v), averaged over its counted positions
of the micro-batch, weighted w_k = decay^k and summed over steps. With a pruned draft vocabulary
the target is the verifier's distribution restricted to the draft's tokens (t2d) and renormalised;
top-1 agreement always compares with the verifier's argmax over the full vocabulary. Under
sequence parallelism (train/sequence_parallel.py, `split_rows`) a rank runs its slice of each row
and divides by the counted positions of the whole micro-batch: the ranks' losses add up to this one.

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

Target cache: the K steps read the same rows of F shifted by one, so when a micro-batch's
[rows, Vd] fp32 target probabilities fit `target_cache_bytes`, they are computed once
(TargetCache) and every step's forward and backward reads them; otherwise (Kimi's V = 163,840
at 8k-token rows) the loss recomputes them per chunk as below. Same maths either way.

Memory: logits exist only for `chunk` tokens at a time ([chunk, V] fp32 blocks of about
`chunk_bytes`), in the forward and in the backward, which recomputes them (ChunkedSoftCE, and
ChunkedTopKCE with [chunk, Vd] blocks only: no verifier logits). The dense loss reads each step's
target rows of F by index, a chunk at a time. With `recompute` each TTT step's layer runs under
torch.utils.checkpoint (model/chain.py): the forward keeps only the steps' inputs (hidden states,
TTT cache), and the backward holds one step's activations at a time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from config.choices import Acceptance, names
from config.validate import acceptance_problems
from model.batch import Batch
from model.chain import draft_chain, read_rows
from model.draft import Eagle3Draft
from model.vocab import target_ids_of
from train.sequence_parallel import RankShare, SequenceParallel

# -log alpha's floor: alpha is exactly 0 in fp32 when p and q share no mass (one underflows
# wherever the other has mass), and -log 0 = inf would stop the run; its gradient, bounded for
# alpha > 0, would be 0/0. Below the floor the term is the constant 13.8 and the CE alone pulls.
ALPHA_FLOOR = 1e-6


def check_acceptance(kind: str | None) -> None:
    """Refuse an acceptance term other than null, tv, lk or hybrid (the chunked maths treats any other as lk)."""
    if kind is not None and kind not in names(Acceptance):
        raise ValueError(f"acceptance={kind!r}: one of {', '.join(names(Acceptance))} or null")


@dataclass(frozen=True)
class ObjectiveConfig:
    steps: int                 # TTT steps K
    decay: float               # step k weighs decay**k
    chunk_bytes: int           # bytes of one [chunk, V] fp32 logits block
    target_topk: int | None = None   # train final-state batches on the verifier's top-k (module docstring)
    target_cache_bytes: int = 0      # at most this many bytes of target probabilities kept per micro-batch
    acceptance: str | None = None    # acceptance term of the dense loss: None | "tv" | "lk" | "hybrid"
    acceptance_weight: float = 1.0   # its weight per counted position (hybrid: eta)
    # Each TTT step's layer forward under torch.utils.checkpoint (model/chain.py run_step): the
    # backward recomputes it, so only the steps' inputs stay saved. Same loss and gradients.
    recompute: bool = False
    # Training only: gaussian noise of this many times each aux state's RMS (per token) added to the
    # aux states, so the draft learns from states a little off the ones stored (at serving time it
    # reads the verifier's, but after its first draft its own inputs drift). 0: none.
    aux_noise: float = 0.0

    def __post_init__(self) -> None:
        if self.acceptance is None:
            return
        problems = acceptance_problems(self.acceptance, self.acceptance_weight, self.target_topk)
        if problems:
            raise ValueError("; ".join(problems))

    def weights(self, steps: int | None = None) -> list[float]:
        return [self.decay ** k for k in range(steps or self.steps)]

    def chunk_tokens(self, vocab_size: int) -> int:
        return max(1, self.chunk_bytes // (4 * vocab_size))


class StepStats(NamedTuple):
    """Per TTT step sums over the counted positions; add them up over batches and ranks."""

    loss_sum: Tensor   # [K] float64, sum of soft cross-entropies (plus acceptance terms, if set)
    correct: Tensor    # [K] float64, draft top-1 == verifier top-1
    count: Tensor      # [K] float64, counted positions
    chain: Tensor      # [K] float64, step-0 positions whose steps 0..k are all counted and correct

    def stacked(self) -> Tensor:
        return torch.stack((self.loss_sum, self.correct, self.count, self.chain))   # [4, K]

    @staticmethod
    def zeros(steps: int, device: torch.device | str) -> Tensor:
        """An accumulator for `stacked()` values: [4, steps] float64."""
        return torch.zeros(len(StepStats._fields), steps, dtype=torch.float64, device=device)


class ObjectiveOutput(NamedTuple):
    loss: Tensor       # scalar, what is optimised
    stats: StepStats


# ---- top-k targets from final states ------------------------------------------------------
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


# ---- chunked soft cross-entropy -------------------------------------------------------------
# Row counts of the loss's low-precision matmuls are padded up to a multiple of this: the CPU's
# bf16 kernels (oneDNN) build and keep a kernel per shape, and the counted positions of a
# micro-batch are a new number at nearly every step, so unpadded matmuls spend the step compiling
# kernels, and a long run fills the kernel cache (and the memory) with shapes seen once.
ROW_GRID = 64


def on_row_grid(n: int) -> int:
    return -(-n // ROW_GRID) * ROW_GRID


class _Blocks:
    """The [chunk, V] fp32 buffers of one pass, allocated once and reused for every chunk (fresh
    100 MB blocks per chunk cost page faults on the CPU), and the in-place maths on them."""

    def __init__(self, chunk: int, target_vocab: int, draft_vocab: int, pruned: bool, dtype: torch.dtype,
                 device: torch.device, acceptance: bool = False) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        self.target = torch.empty(chunk, target_vocab, **f32)            # verifier logits
        self.kept = torch.empty(chunk, draft_vocab, **f32) if pruned else None   # ... on the draft vocabulary
        self.draft = torch.empty(chunk, draft_vocab, **f32)              # draft logits
        # A third block beside p and z: the acceptance term's q (forward) and d(-alpha)/dz
        # (backward), or p * z where the plain loss takes its gradients in the forward.
        self.accept = torch.empty(chunk, draft_vocab, **f32) if acceptance else None
        # Matmuls in a low precision land here before their fp32 copy, on rows padded to the grid.
        self.grid_rows = on_row_grid(chunk)
        self.scratch = (torch.empty(self.grid_rows * max(target_vocab, draft_vocab), dtype=dtype, device=device)
                        if dtype != torch.float32 else None)
        self.rows: Tensor | None = None          # [grid rows, H] low-precision inputs, zero past the rows

    def padded_rows(self, x: Tensor) -> Tensor:
        """x [c, H] copied into the rows buffer, zero rows up to on_row_grid(c)."""
        n = x.shape[0]
        if self.rows is None or self.rows.shape[1] != x.shape[1]:
            self.rows = x.new_empty(self.grid_rows, x.shape[1])
        rows = self.rows[:on_row_grid(n)]
        rows[:n] = x
        rows[n:].zero_()
        return rows

    def logits(self, out: Tensor, x: Tensor, w: Tensor) -> Tensor:
        """out[:c] = x @ w.T in fp32; x [c, H], w [V, H]."""
        out = out[:x.shape[0]]
        if self.scratch is None:
            return torch.mm(x, w.T, out=out)
        rows = self.padded_rows(x)
        low = self.scratch[:rows.shape[0] * w.shape[0]].view(rows.shape[0], w.shape[0])
        return out.copy_(torch.mm(rows, w.T, out=low)[:x.shape[0]])

    def target_probs(self, target_hidden: Tensor, target_head: Tensor, keep: Tensor | None,
                     with_top: bool = True) -> tuple[Tensor, Tensor | None]:
        """(p [c, Vd] on the draft vocabulary, verifier top-1 [c] target ids or None)."""
        logits = self.logits(self.target, target_hidden, target_head)   # [c, V]
        top = logits.argmax(-1) if with_top else None
        if keep is not None:                                             # restricted to t2d
            logits = torch.index_select(logits, 1, keep, out=self.kept[:logits.shape[0]])
        return softmax_(logits), top

    def cached_probs(self, cache: TargetCache, rows: Tensor) -> tuple[Tensor, Tensor]:
        """target_probs read from a TargetCache: (p [c, Vd] in this block's own buffer, which the
        loss overwrites, top-1 [c]) of the cache rows `rows` [c]."""
        p = torch.index_select(cache.probs, 0, rows, out=self.target[:rows.shape[0], :cache.probs.shape[1]])
        return p, cache.top[rows]


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
    a time through the same maths as the uncached loss (_Blocks.target_probs)."""
    b, t = read.nonzero(as_tuple=True)
    R = b.numel()
    probs = torch.empty(R, draft_vocab, dtype=torch.float32, device=final.device)
    top = torch.empty(R, dtype=torch.long, device=final.device)
    index = torch.full(read.shape, -1, dtype=torch.long, device=final.device)
    index[b, t] = torch.arange(R, device=final.device)
    if R:
        blocks = _Blocks(min(chunk, R), target_head.shape[0], draft_vocab, keep is not None, final.dtype, final.device)
        for c in range(0, R, chunk):
            p, top[c:c + chunk] = blocks.target_probs(final[b[c:c + chunk], t[c:c + chunk]], target_head, keep)
            probs[c:c + chunk] = p
    return TargetCache(probs, top, index)


def softmax_(z: Tensor) -> Tensor:
    """Softmax over the last dim, in place (no temporary of z's size)."""
    z.sub_(z.amax(-1, keepdim=True)).exp_()
    return z.div_(z.sum(-1, keepdim=True))


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
            p, top = (blocks.cached_probs(cache, rows[c:c + chunk]) if cache is not None
                      else blocks.target_probs(_chunk_rows(target_hidden, rows, c, chunk), target_head, keep))
            z = blocks.logits(blocks.draft, normed[c:c + chunk], head)    # [c, Vd]
            pred = z.argmax(-1)
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
                _accumulate_grads(blocks, dz, normed[c:c + chunk], head,
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
            p, _ = (blocks.cached_probs(cache, rows[c:c + chunk]) if cache is not None
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
            _accumulate_grads(blocks, dz, x, head, grad_x[c:c + chunk] if want_x else None, grad_w)
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
                   cache: TargetCache | None, acceptance: bool = False) -> _Blocks | None:
    """The blocks of one ChunkedSoftCE pass: with a cache, p is copied into a [chunk, Vd] block
    and no verifier logits are computed."""
    N = normed.shape[0]
    if not N:
        return None
    if cache is not None:
        return _Blocks(min(chunk, N), head.shape[0], head.shape[0], False, normed.dtype, normed.device, acceptance)
    return _Blocks(min(chunk, N), target_head.shape[0], head.shape[0], keep is not None, normed.dtype,
                   normed.device, acceptance)


def _accumulate_grads(blocks: _Blocks, dz: Tensor, x: Tensor, head: Tensor, grad_x: Tensor | None,
                      grad_w: Tensor | None) -> None:
    """One chunk's gradients from dz [c, Vd] = d loss / d logits: grad_x [c, H] = dz @ head
    (written), grad_w [Vd, H] += dz.T @ x (fp32); the matmuls in x's dtype (a low one on rows
    padded to the grid, zero past c)."""
    if x.dtype == torch.float32:
        if grad_x is not None:
            torch.mm(dz, head, out=grad_x)
        if grad_w is not None:
            grad_w.addmm_(dz.T, x)
        return
    n = dz.shape[0]
    low = blocks.scratch[:on_row_grid(n) * dz.shape[1]].view(-1, dz.shape[1])
    low[:n].copy_(dz)
    low[n:].zero_()
    if grad_x is not None:
        grad_x.copy_(torch.mm(low, head)[:n])
    if grad_w is not None:
        grad_w += (low.T @ blocks.padded_rows(x)).float()


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


# ---- chunked top-k (bucket) cross-entropy ---------------------------------------------------
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


def _logsumexp_(z: Tensor) -> Tensor:
    """[c, V] -> [c] logsumexp, overwriting z; -inf for a row that is all -inf."""
    m = z.amax(-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return z.sub_(m[:, None]).exp_().sum(-1).log_().add_(m)


def _draft_blocks(normed: Tensor, head: Tensor, chunk: int) -> _Blocks | None:
    """The draft-logits block (and low-precision scratch) of one pass; no verifier block: the top-k
    loss never forms verifier logits. None without rows."""
    N = normed.shape[0]
    return _Blocks(min(chunk, N), 0, head.shape[0], False, normed.dtype, normed.device) if N else None


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
            pred = z.argmax(-1)
            correct[s] = (keep[pred] if keep is not None else pred) == top[s]
            z_set = z.gather(1, idx[s])                                  # [c, k] (column 0 off S)
            lse_off[s] = _logsumexp_(_mask_set_(z, in_set[s], idx[s]))
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
            _accumulate_grads(blocks, dz, x, head, grad_x[s] if want_x else None, grad_w)
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


# ---- the module DeepSpeed trains -------------------------------------------------------------
def noisy_aux(aux: Tensor, num_aux: int, scale: float) -> Tensor:
    """aux [B, T, n_aux*H] plus normal noise of `scale` x each aux state's RMS at its token."""
    states = aux.unflatten(-1, (num_aux, -1)).float()                       # [B, T, n_aux, H]
    rms = states.pow(2).mean(-1, keepdim=True).sqrt()
    return (states + scale * rms * torch.randn_like(states)).flatten(-2).to(aux.dtype)


class Eagle3Objective(nn.Module):
    """The draft plus its frozen target head; forward(batch, steps) -> ObjectiveOutput.

    The verifier's lm_head is a non-persistent buffer: never trained, never checkpointed, not
    partitioned by ZeRO-3. A draft whose lm_head is the verifier's (full vocabulary, frozen:
    Eagle3Draft.shares_verifier_head, passed here as `target_head`) keeps the one tensor, held by
    the draft alone: one [V, H] instead of two, which stays one when the module moves to a GPU.
    Otherwise the draft's own lm_head is read directly (not through its forward), so under ZeRO-3
    the engine registers it as an external parameter of this module.
    A batch with final states trains with the dense soft cross-entropy (needs target_head); one
    with top-k targets (target_ids, target_logprobs) with the bucket cross-entropy, which needs
    no verifier head: target_head may then be None. The acceptance term (cfg.acceptance) is refused
    without a head (an objective for a top-k store) and on a batch of top-k targets.
    """

    def __init__(self, draft: Eagle3Draft, target_head: Tensor | None, cfg: ObjectiveConfig) -> None:
        super().__init__()
        if cfg.acceptance is not None and target_head is None:
            raise ValueError(_no_acceptance_on_topk(cfg.acceptance))
        self.draft = draft
        self.cfg = cfg
        self.shares_head = target_head is not None and target_head is draft.lm_head.weight
        self.register_buffer("verifier_head", None if self.shares_head else target_head, persistent=False)  # [V, H]
        self.chunk = cfg.chunk_tokens(draft.config.vocab_size)
        self.sequence: SequenceParallel | None = None                 # split_rows

    @property
    def target_head(self) -> Tensor | None:
        """The verifier's lm_head [V, H] the targets come from (the draft's own when it shares it)."""
        return self.draft.lm_head.weight if self.shares_head else self.verifier_head

    def split_rows(self, sequence: SequenceParallel) -> None:
        """Train every row split over `sequence`'s group (train/sequence_parallel.py): the batches
        are its RowSlice cuts, each rank's loss its slice's share, and the attention exchanges
        over the group. A group of one rank changes nothing."""
        if sequence.size > 1:
            self.sequence = sequence
            self.draft.midlayer.self_attn.sequence_group = sequence.group

    def _share(self, batch: Batch, steps: int) -> RankShare | None:
        """Under sequence parallelism, this rank's positions of the cut batch and what each
        step's loss is averaged over (the whole micro-batch's counted positions); else None."""
        return None if self.sequence is None else self.sequence.share(batch, steps)

    @torch.no_grad()
    def cast_buffers(self, dtype: torch.dtype) -> None:
        """The frozen verifier tensors (embedding, lm_head) to the training dtype: DeepSpeed's
        bf16 mode casts parameters only, and these meet bf16 activations."""
        for module in self.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and buffer.is_floating_point():
                    module._buffers[name] = buffer.to(dtype)

    def _target_cache(self, batch: Batch, final: Tensor, keep: Tensor | None) -> TargetCache | None:
        """The micro-batch's TargetCache when its [rows, Vd] fp32 fit target_cache_bytes, else None
        (the loss then recomputes the verifier's logits per step, in [chunk, V] blocks)."""
        if final.is_meta:                       # train/plan.py: the uncached loss is the bound
            return None
        read = read_rows(batch)                                             # row r: token r+1 counted
        draft_vocab = self.draft.config.draft_vocab_size
        if int(read.sum()) * draft_vocab * 4 > self.cfg.target_cache_bytes:
            return None
        with torch.no_grad():
            return build_target_cache(final, read, self.target_head, keep, draft_vocab, self.chunk)

    def forward(self, batch: Batch, steps: int | None = None) -> ObjectiveOutput:
        steps = steps or self.cfg.steps
        draft = self.draft
        dtype = draft.fc.weight.dtype
        if self.training and self.cfg.aux_noise:
            batch = dataclasses.replace(batch, aux=noisy_aux(batch.aux, draft.config.num_aux, self.cfg.aux_noise))
        keep = None if draft.d2t is None else target_ids_of(draft.d2t)
        topk = batch.topk                                                    # top-k targets instead
        if topk and self.cfg.acceptance is not None:
            raise ValueError(_no_acceptance_on_topk(self.cfg.acceptance))
        # Passed only when set: without it the dense loss runs exactly as it always has.
        accept = ({} if self.cfg.acceptance is None else
                  {"acceptance": self.cfg.acceptance, "acceptance_weight": self.cfg.acceptance_weight})
        if not topk and self.cfg.target_topk and self.target_head is not None:
            batch = topk_targets(batch, self.target_head, self.cfg.target_topk, self.cfg.chunk_bytes)
            topk = True
        if not topk and self.target_head is None:
            raise ValueError("a batch with final states needs the verifier's lm_head: this objective "
                             "was built without one (for a store of top-k targets)")
        final = None if topk else batch.final.to(dtype)                  # [B, T, H]
        cache = None if topk else self._target_cache(batch, final, keep)
        device = batch.input_ids.device
        loss = torch.zeros((), dtype=torch.float32, device=device)
        sums, correct, counts, chain = [], [], [], []
        alive = None              # [B, T] chains started at step 0 and still all correct
        share = self._share(batch, steps)
        span = None if share is None else share.span
        for (k, out, counted), weight in zip(draft_chain(draft, batch, steps, span, recompute=self.cfg.recompute),
                                             self.cfg.weights(steps)):
            b, t = counted.nonzero(as_tuple=True)                           # counted positions
            if topk:                                                        # rows t+1+k: [n, k_top]
                loss_sum, agree = topk_cross_entropy(out.normed[b, t], draft.lm_head.weight,
                                                     batch.target_ids[b, t + 1 + k],
                                                     batch.target_logprobs[b, t + 1 + k], keep, self.chunk)
            elif cache is not None:                                         # rows t+1+k from the cache
                loss_sum, agree = soft_cross_entropy(out.normed[b, t], draft.lm_head.weight, None,
                                                     self.target_head, keep, self.chunk, cache,
                                                     cache.index[b, t + 1 + k], **accept)
            else:
                # final's rows t+1+k by index: no [n, H] copy of them per step kept for the backward
                loss_sum, agree = soft_cross_entropy(out.normed[b, t], draft.lm_head.weight,
                                                     final.flatten(0, 1), self.target_head, keep, self.chunk,
                                                     None, b * final.shape[1] + t + 1 + k, **accept)
            n = b.numel()
            loss = loss + weight * loss_sum.float() / max(n if share is None else share.counted[k], 1)
            sums.append(loss_sum.detach())
            correct.append(agree.sum().double())
            counts.append(torch.tensor(float(n), dtype=torch.float64, device=device))
            right = torch.zeros_like(counted)
            right[b, t] = agree
            alive = right if alive is None else alive & right
            chain.append(alive.sum().double())
        return ObjectiveOutput(loss, StepStats(torch.stack(sums), torch.stack(correct), torch.stack(counts),
                                               torch.stack(chain)))


def _no_acceptance_on_topk(kind: str) -> str:
    return (f"acceptance={kind!r} needs the verifier's whole distribution (alpha = sum_v min(p, q)), "
            "and top-k targets keep only its top-k: train a top-k store without it (acceptance: null)")


def simulated_accept_length(acceptance: Tensor | list[float]) -> float:
    """1 + sum_k prod_{i<=k} a_i: expected tokens per verifier pass with chain drafting when draft
    position i is accepted with probability a_i given the earlier ones were."""
    total, run = 1.0, 1.0
    for a in torch.as_tensor(acceptance, dtype=torch.float64).tolist():
        run *= a
        total += run
    return total
