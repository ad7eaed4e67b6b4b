"""Pruned draft vocabulary: which target tokens the draft's lm_head covers.

d2t [draft_vocab] int64: d2t[i] = target_id(i) - i (the offset form vLLM and SGLang read;
vLLM scatters draft logit i to target id i + d2t[i]).
t2d [target_vocab] bool: True for target tokens the draft can propose (vLLM ignores it).
The kept tokens are the most frequent loss-masked tokens, in ascending target-id order.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def count_tokens(token_ids: Tensor, loss_mask: Tensor, vocab_size: int) -> Tensor:
    """Frequencies [vocab_size] int64 of the tokens whose loss_mask is set (any shapes, equal)."""
    ids = token_ids.reshape(-1)[loss_mask.reshape(-1).bool()]
    return torch.bincount(ids.long(), minlength=vocab_size)


def build_draft_vocab(
    token_counts: Tensor, draft_vocab_size: int, always_include: Sequence[int] = ()
) -> tuple[Tensor, Tensor]:
    """(d2t [Vd] int64, t2d [V] bool) from token_counts [V]: the Vd most frequent tokens.

    Ties go to the lower token id (a stable order, so the same counts give the same vocabulary).
    `always_include` (e.g. EOS) is kept whatever its count.
    """
    V = token_counts.numel()
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} not in (0, {V}]")
    counts = token_counts.to(torch.float64).clone()
    if always_include:
        counts[torch.as_tensor(list(always_include), dtype=torch.long)] = float("inf")
    order = torch.sort(-counts, stable=True).indices                   # most frequent first
    target_ids = order[:draft_vocab_size].sort().values                 # ascending target ids
    d2t = target_ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t.to(torch.int64), t2d


def draft_to_target(draft_ids: Tensor, d2t: Tensor | None) -> Tensor:
    """Target ids of draft ids (identity without a pruned vocabulary)."""
    if d2t is None:
        return draft_ids
    return draft_ids + d2t.to(draft_ids.device)[draft_ids]


def target_ids_of(d2t: Tensor) -> Tensor:
    """[Vd] target id of every draft id."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def target_to_draft(target_ids: Tensor, t2d: Tensor) -> Tensor:
    """Draft ids of target ids; -1 where the target token is outside the draft vocabulary."""
    index = torch.cumsum(t2d.long(), 0) - 1                              # draft id at each kept target id
    t2d, index = t2d.to(target_ids.device), index.to(target_ids.device)
    return torch.where(t2d[target_ids], index[target_ids], torch.full_like(target_ids, -1))


def t2d_from_d2t(d2t: Tensor, vocab_size: int) -> Tensor:
    """The bool mask over the target vocabulary that d2t covers."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    t2d[target_ids_of(d2t)] = True
    return t2d
