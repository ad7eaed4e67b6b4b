"""Accept length of chain drafting (topk 1, K drafts per verifier pass), from per-position facts.

Alignment (train/objective.py): the chain at position t drafts x_{t+2}, ..., x_{t+1+K} once
x_{<=t+1} is verified; draft k of that chain is TTT step k at position t.

Greedy decoding is deterministic, so a generated text can be replayed exactly: the pass whose
chain sits at t accepts a(t) drafts (the leading run of drafts equal to the verifier's argmax),
the verifier adds its own next token, and the next pass's chain sits at t + a(t) + 1. The first
pass of an answer whose first token is x_P (made by the prefill, not drafted) has its chain at
P - 1, and the passes end once the last token of the text is verified. That is what vLLM counts
(num_drafts = passes; num_accepted_tokens_per_pos[k] = passes whose drafts 0..k were accepted),
so `decode_walk` gives vLLM's accept length on the same text.

Sampled decoding is not replayable; its expectation is: with p the verifier's and q the draft's
distribution (after temperature / top-p), draft k is accepted with probability
alpha_k = sum_v min(p, q) when the draft samples from q (vLLM's "probabilistic" draft sampling),
or p(argmax q) when it proposes its argmax (vLLM's default, "greedy" draft sampling). A chain
then accepts sum_k prod_{i<=k} alpha_i tokens on average.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AcceptCounts:
    """vLLM's spec-decode counters: passes with K drafts, and accepted drafts per position."""

    drafts: float
    accepted_per_pos: list[float]   # [K]

    @classmethod
    def zeros(cls, K: int) -> AcceptCounts:
        return cls(0.0, [0.0] * K)

    def __add__(self, other: AcceptCounts) -> AcceptCounts:
        if len(other.accepted_per_pos) != len(self.accepted_per_pos):
            raise ValueError(f"cannot add counts of {len(self.accepted_per_pos)} and "
                             f"{len(other.accepted_per_pos)} draft positions")
        return AcceptCounts(self.drafts + other.drafts,
                            [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos)])

    def per_position(self) -> list[float]:
        """Share of passes whose drafts 0..k were all accepted, per draft position k."""
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_pos]

    def accept_length(self) -> float:
        """Tokens per verifier pass: 1 + accepted drafts per pass (ceiling K + 1)."""
        return 1.0 + sum(self.per_position())


def leading_run(agree: Tensor) -> Tensor:
    """agree [T, K] bool -> [T] int64: drafts accepted per chain, the leading run of True."""
    return agree.long().cumprod(dim=1).sum(dim=1)


def decode_walk(accepted: Tensor, first: int, last: int, K: int) -> AcceptCounts:
    """Replay greedy speculative decoding over one text.

    accepted [T]: drafts accepted by the chain at each position (`leading_run`); first: the chain
    position of the first pass (answer's first token index - 1); last: index of the text's last
    token. A pass is made while its verified prefix x_{<=t+1} does not yet reach `last`.
    """
    counts = AcceptCounts.zeros(K)
    values = accepted.tolist()
    t = first
    while t + 1 < last:
        a = min(int(values[t]), K)
        counts.drafts += 1
        for k in range(a):
            counts.accepted_per_pos[k] += 1
        t += a + 1
    return counts


def expected_counts(alpha: Tensor) -> AcceptCounts:
    """Expected counters over chains, one pass per row of alpha [T, K] (the probability that draft
    k is accepted given drafts < k were): drafts 0..k all accepted with probability prod_{i<=k}."""
    reach = alpha.double().cumprod(dim=1)                                # [T, K]
    return AcceptCounts(float(alpha.shape[0]), reach.sum(dim=0).tolist())


def sampling_probs(logits: Tensor, temperature: float, top_p: float = 1.0) -> Tensor:
    """[N, V] logits -> [N, V] probabilities after temperature and nucleus (top-p) filtering,
    as vLLM's sampler applies them (the smallest set of tokens whose mass reaches top_p)."""
    if temperature <= 0:
        raise ValueError("sampling_probs needs a temperature > 0 (greedy has its own path)")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)      # always keeps the top token
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return kept / kept.sum(dim=-1, keepdim=True)


def acceptance_probability(target: Tensor, draft: Tensor, draft_sample: str) -> Tensor:
    """target p [N, V], draft q [N, V] distributions -> [N] probability that the draft's token
    survives rejection sampling: sum_v min(p, q) when the draft samples from q
    ("probabilistic"), p(argmax q) when it proposes its argmax ("greedy")."""
    if draft_sample == "probabilistic":
        return torch.minimum(target, draft).sum(dim=-1)
    if draft_sample == "greedy":
        return target.gather(-1, draft.argmax(dim=-1, keepdim=True)).squeeze(-1)
    raise ValueError(f"unknown draft sampling {draft_sample!r} (greedy | probabilistic)")
