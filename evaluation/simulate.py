"""Simulated accept length of an exported draft on a store's samples (no vLLM).

For every sample the draft runs its chain as in training (model/chain.py's draft_chain: step
k at position t reads x_{t+1+k} and its own previous hidden state) for K = the number of
speculative tokens, and each draft is compared with the verifier's distribution at the position
it predicts (the stored final hidden state through the verifier's lm_head):

- greedy: agree[t, k] = draft argmax == verifier argmax; `decode_walk` replays greedy decoding
  over every answer (a maximal run of loss-masked tokens), which is vLLM's count on that text;
  `chains` averages over every chain position of the answers instead (no replay).
- sampled: alpha[t, k] at a temperature and top-p (evaluation/accept.py), averaged over the chain
  positions of the answers: an expectation, not a replay.

Logits exist for `chunk` positions at a time, so Kimi's 163,840-token vocabulary fits.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from evaluation.accept import (AcceptCounts, acceptance_probability, decode_walk, expected_counts,
                               leading_run, sampling_probs)
from model.batch import RowSample, collate_rows, pack_row
from model.chain import draft_chain
from model.draft import Eagle3Draft
from store import Sample, StoreReader


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    draft_sample: str           # greedy | probabilistic (vLLM's draft_sample_method)


@dataclass
class SimResult:
    walk: AcceptCounts          # greedy decoding replayed over the answers
    chains: AcceptCounts        # greedy, every chain position of the answers
    sampled: AcceptCounts | None
    samples: int = 0
    answer_tokens: int = 0

    def __add__(self, other: SimResult) -> SimResult:
        sampled = None if self.sampled is None else self.sampled + other.sampled
        return SimResult(self.walk + other.walk, self.chains + other.chains, sampled,
                         self.samples + other.samples, self.answer_tokens + other.answer_tokens)

    def summary(self) -> dict[str, object]:
        out = {"samples": self.samples, "answer_tokens": self.answer_tokens,
               "greedy": {"accept_length": self.walk.accept_length(), "per_position": self.walk.per_position(),
                          "passes": self.walk.drafts},
               "greedy_all_positions": {"accept_length": self.chains.accept_length(),
                                        "per_position": self.chains.per_position()}}
        if self.sampled is not None:
            out["sampled"] = {"accept_length": self.sampled.accept_length(),
                              "per_position": self.sampled.per_position()}
        return out


def answer_spans(loss_mask: Tensor) -> list[tuple[int, int]]:
    """[T] bool -> (first, last) index of each maximal run of assistant tokens."""
    m = loss_mask.long().tolist()
    spans, start = [], None
    for i, v in enumerate(m + [0]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            spans.append((start, i - 1))
            start = None
    return spans


@torch.no_grad()
def chain_outcomes(draft: Eagle3Draft, target_head: Tensor, sample: Sample, K: int,
                   sampling: Sampling | None, chunk: int) -> tuple[Tensor, Tensor | None]:
    """(agree [T, K] bool, alpha [T, K] float or None) of the chains at every position of one sample."""
    if sample.final is None:
        # The replay needs the verifier's full distribution (any temperature, top-p): top-k
        # targets cannot give it.
        raise ValueError(f"sample {sample.sample_id!r} has no final hidden states (its store keeps the "
                         "verifier's top-k targets instead): the accept-length simulation needs them, "
                         "so evaluation stores must keep final states (dump them with conf/store lossless)")
    batch = collate_rows([pack_row([RowSample(sample.input_ids, sample.loss_mask, sample.aux, sample.final)],
                                   len(sample.input_ids))])
    final = batch.final[0]                                               # [T, H]
    T = final.shape[0]
    agree = torch.zeros(T, K, dtype=torch.bool)
    alpha = torch.zeros(T, K) if sampling is not None else None
    for k, out, counted in draft_chain(draft, batch, K):
        rows = counted[0].nonzero().squeeze(1)                           # chain positions t
        for c in range(0, rows.numel(), chunk):
            t = rows[c:c + chunk]
            target = final[t + 1 + k].float() @ target_head.T            # [c, V] verifier logits
            mine = draft.to_target_logits(draft.compute_logits(out.normed[0, t]).float())   # [c, V]
            agree[t, k] = mine.argmax(-1) == target.argmax(-1)
            if sampling is not None:
                p = sampling_probs(target, sampling.temperature, sampling.top_p)
                q = sampling_probs(mine, sampling.temperature)           # vLLM's drafts: temperature only
                alpha[t, k] = acceptance_probability(p, q, sampling.draft_sample)
    return agree, alpha


def simulate_sample(draft: Eagle3Draft, target_head: Tensor, sample: Sample, K: int,
                    sampling: Sampling | None, chunk: int) -> SimResult:
    agree, alpha = chain_outcomes(draft, target_head, sample, K, sampling, chunk)
    accepted = leading_run(agree)
    walk, chains = AcceptCounts.zeros(K), AcceptCounts.zeros(K)
    sampled = AcceptCounts.zeros(K) if sampling is not None else None
    answer_tokens = 0
    for first, last in answer_spans(sample.loss_mask):
        answer_tokens += last - first + 1
        walk = walk + decode_walk(accepted, max(first - 1, 0), last, K)
        starts = slice(max(first - 1, 0), max(last - 1, 0))              # chains of the passes made
        chains = chains + expected_counts(agree[starts].double())
        if sampled is not None:
            sampled = sampled + expected_counts(alpha[starts].double())
    return SimResult(walk, chains, sampled, 1, answer_tokens)


def simulate_store(draft: Eagle3Draft, target_head: Tensor, store: StoreReader, K: int,
                   sampling: Sampling | None, chunk: int, refs: Iterable | None = None,
                   progress: bool = False) -> SimResult:
    """Sum of `simulate_sample` over the store's samples (or the given refs)."""
    from tqdm import tqdm

    refs = list(store.samples() if refs is None else refs)
    total = SimResult(AcceptCounts.zeros(K), AcceptCounts.zeros(K),
                      AcceptCounts.zeros(K) if sampling is not None else None)
    dtype = draft.fc.weight.dtype
    for ref in tqdm(refs, desc=f"simulate {store.path.parent.name}/{store.path.name}", unit="sample", disable=not progress):
        sample = store.read_sample(ref, dtype)
        if sample.final is None:
            raise ValueError(f"store {store.path}: sample {sample.sample_id!r} has no final hidden states "
                             "(the store keeps the verifier's top-k targets instead); the accept-length "
                             "simulation needs them, so evaluation stores must keep final states (dump "
                             "them with conf/store lossless)")
        total = total + simulate_sample(draft, target_head, sample, K, sampling, chunk)
    return total
