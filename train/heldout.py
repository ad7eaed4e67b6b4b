"""Held-out evaluation: per-step loss, top-1 agreement and the simulated accept length.

The draft runs its TTT chain on held-out samples exactly as in training (ground-truth ids, its
own hidden states fed back), for `eval.ttt_steps` steps whatever it was trained with, so drafts
trained with different TTT depths are compared on the same chain. acc_k = share of counted
positions where the draft's top-1 equals the verifier's at step k; accept_length is the usual
1 + sum_k prod_{i<=k} acc_i, chain_accept_length replays greedy chain drafting position by
position (1 + sum_k share of chains whose drafts 0..k all agree), which is what vLLM measures
(train/metrics.py). On kimi-tiny's held-out split the two differ by ~0.02; against vLLM's own
spec-decode counters on the verifier's greedy continuations the chain replay agreed per position.

A store of top-k targets is evaluated as it trains (train/topk_ce.py): the loss is the bucket
cross-entropy, and the verifier's top-1 is its stored most likely token, so acc_k and both accept
lengths mean the same as with final states.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from model.batch import Batch
from train.distributed import all_reduce_sum
from train.metrics import step_metrics
from train.objective import StepStats


@dataclass(frozen=True)
class HeldoutResult:
    """The held-out metrics (train/metrics.py step_metrics) and each sample's own sums."""

    metrics: dict[str, float]
    per_sample: Tensor      # [samples, 4, K] float64: StepStats.stacked() of each held-out sample


@torch.no_grad()
def evaluate(engine, batches: Iterable[Batch], rows: Sequence[tuple[int, bool]], samples: int,
             steps: int) -> HeldoutResult:
    """Metrics over the held-out micro-batches of all ranks, one sample per batch: rows[i] =
    (the sample batch i holds, counted). Collective: every rank runs as many batches; those with
    counted False only keep ZeRO-3's gathers in step and add nothing. Each sample's sums are kept
    apart, so that a difference between two drafts can be given a standard error clustered by
    conversation (evaluation/paired.py)."""
    was_training = engine.module.training
    engine.eval()
    per_sample = torch.zeros(samples, len(StepStats._fields), steps, dtype=torch.float64, device=engine.device)
    for batch, (sample, keep) in zip(batches, rows, strict=True):
        stats = engine(batch.to(engine.device), steps).stats.stacked().to(per_sample.device)
        if keep:
            per_sample[sample] += stats
    all_reduce_sum(per_sample)      # ranks hold different samples, or slices of the same ones
    engine.train(was_training)
    return HeldoutResult(step_metrics(per_sample.sum(0)), per_sample.cpu())
