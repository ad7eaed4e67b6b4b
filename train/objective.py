"""The training objective: TTT unrolled over K steps, the chunked loss of each step
(train/soft_ce.py on final states, train/topk_ce.py on top-k targets), per-step metrics.

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

Loss: step k's cross-entropy (the dense soft CE, or the bucket CE of top-k targets), averaged over
its counted positions of the micro-batch, weighted w_k = decay^k and summed over steps. Under
sequence parallelism (train/sequence_parallel.py, `split_rows`) a rank runs its slice of each row
and divides by the counted positions of the whole micro-batch: the ranks' losses add up to this one.

Memory: with `recompute` each TTT step's layer runs under torch.utils.checkpoint (model/chain.py):
the forward keeps only the steps' inputs (hidden states, TTT cache), and the backward holds one
step's activations at a time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from config.validate import acceptance_problems
from model.batch import Batch
from model.chain import draft_chain, read_rows
from model.draft import Eagle3Draft
from model.vocab import target_ids_of
from train.sequence_parallel import RankShare, SequenceParallel
from train.soft_ce import TargetCache, build_target_cache, soft_cross_entropy
from train.topk_ce import topk_cross_entropy, topk_targets


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
