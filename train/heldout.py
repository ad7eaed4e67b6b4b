"""Held-out evaluation: per-step loss, top-1 agreement and the simulated accept length.

The draft runs its TTT chain on held-out samples exactly as in training (ground-truth ids, its
own hidden states fed back), for `eval.ttt_steps` steps whatever it was trained with, so drafts
trained with different TTT depths are compared on the same chain. acc_k = share of counted
positions where the draft's top-1 equals the verifier's at step k; accept_length is the usual
1 + sum_k prod_{i<=k} acc_i, chain_accept_length replays greedy chain drafting position by
position (1 + sum_k share of chains whose drafts 0..k all agree), which is what vLLM measures
(train/metrics.py). On kimi-tiny's held-out split the two differ by ~0.02; against vLLM's own
spec-decode counters on the verifier's greedy continuations the chain replay agreed per position.

A store of top-k targets is evaluated as it trains (train/objective.py): the loss is the bucket
cross-entropy, and the verifier's top-1 is its stored most likely token, so acc_k and both accept
lengths mean the same as with final states.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from model.batch import Batch
from train.distributed import all_reduce_sum
from train.metrics import step_metrics
from train.objective import StepStats


@torch.no_grad()
def evaluate(engine, batches: Iterable[Batch], counted: Iterable[bool],
             steps: int) -> dict[str, float]:
    """Metrics over the held-out micro-batches of all ranks (collective: every rank runs as many
    batches; those with counted False only keep ZeRO-3's gathers in step and add nothing)."""
    was_training = engine.module.training
    engine.eval()
    total = StepStats.zeros(steps, engine.device)
    for batch, keep in zip(batches, counted, strict=True):
        stats = engine(batch.to(engine.device), steps).stats.stacked().to(total.device)
        if keep:
            total += stats
    all_reduce_sum(total)
    engine.train(was_training)
    return step_metrics(total)
