"""Tests of the top-k (bucket) cross-entropy of train/topk_ce.py, the top-k rows of
model/batch.py (from train/batches.py's row_sample) and the simulation's refusal of a sample
without final states."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import Tensor

import train.objective as objective_module
from tests.conftest import assert_same_objective_runs
from model.batch import Batch, collate_rows, pack_row
from model.chain import step_inputs
from config import compose_draft_conf
from model.draft import DraftConfig, build_draft
from model.verifier_handle import Verifier
from model.vocab import target_ids_of
from train.batches import row_sample
from train.objective import Eagle3Objective, ObjectiveConfig
from train.soft_ce import soft_cross_entropy
from train.topk_ce import ChunkedTopKCE, draft_ids_of, topk_cross_entropy

NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class TopKSample:
    """store.Sample with the fields of a store that keeps top-k targets (final None)."""

    sample_id: str
    input_ids: Tensor
    loss_mask: Tensor
    aux: Tensor
    final: Tensor | None = None
    target_ids: Tensor | None = None
    target_logprobs: Tensor | None = None


@pytest.fixture(scope="module")
def tiny_cfg(draft_verifier_dir: Path) -> DraftConfig:
    return DraftConfig.from_conf(compose_draft_conf("kimi_tiny"), Verifier.open(draft_verifier_dir))


def _topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The verifier's top-k of logits [..., V]: (ids [..., k], log-probabilities [..., k])."""
    logprobs, ids = logits.float().log_softmax(-1).topk(k, dim=-1)
    return ids, logprobs


# ---- a naive dense reference ------------------------------------------------------------------
def _naive_bucket_loss(normed: Tensor, head: Tensor, target_ids: Tensor, target_logprobs: Tensor,
                       keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """The bucket loss on the full [N, Vd] logits with plain autograd: (loss sum, correct [N])."""
    z = normed @ head.T                                                   # [N, Vd]
    N, Vd = z.shape
    to_target = keep if keep is not None else torch.arange(Vd)
    lookup = {int(t): d for d, t in enumerate(to_target)}                 # target id -> draft id
    in_set = torch.zeros(N, Vd, dtype=torch.bool)
    p = torch.zeros(N, Vd, dtype=z.dtype)
    for n in range(N):
        for t, lp in zip(target_ids[n].tolist(), target_logprobs[n].tolist()):
            if t in lookup:
                in_set[n, lookup[t]] = True
                p[n, lookup[t]] = torch.tensor(lp, dtype=torch.float32).exp().to(z.dtype)
    r = (1 - p.sum(-1)).clamp(min=0)
    has_off = (~in_set).any(-1)
    r = torch.where(has_off, r, torch.zeros_like(r))
    log_q = z.log_softmax(-1)
    z_off = torch.where(has_off[:, None], z.masked_fill(in_set, NEG_INF), z)  # finite rows only
    log_1mq = z_off.logsumexp(-1) - z.logsumexp(-1)                       # log(1 - Q)
    loss = -(p * log_q).sum(-1) - torch.where(r > 0, r * log_1mq, torch.zeros_like(r))
    pred = z.argmax(-1)
    return loss.sum(), to_target[pred] == target_ids[:, 0]


def _problem(N: int, H: int, V: int, k: int, pruned: int | None, seed: int
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """(normed, head, target_ids, target_logprobs, keep): a draft near a random verifier, so that
    some top-1s agree; the last three rows carry all their mass on k ids in the draft vocabulary
    (r == 0: their probabilities sum past 1, as rounding does)."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.sort(torch.randperm(V, generator=g)[:pruned]).values if pruned else None
    target_hidden, target_head = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    logits = target_hidden @ target_head.T                                # [N, V]
    ids, logprobs = _topk(logits, k)
    if keep is not None:                                                  # r == 0 rows: ids the draft has
        ids[-3:] = keep[torch.randperm(keep.numel(), generator=g)[:k]]
    logprobs[-3:] = torch.full((k,), 1.0 / k).log() + 1e-6
    normed = target_hidden + 0.5 * torch.randn(N, H, generator=g)
    head = (target_head[keep] if keep is not None else target_head) + 0.1 * torch.randn(
        pruned or V, H, generator=g)
    return normed, head, ids, logprobs, keep


# ---- (a) k = V equals the dense loss ------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_topk_with_every_id_equals_the_dense_loss(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    N, H, V = 37, 16, 50
    target_hidden, target_head = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    normed = (target_hidden + 0.5 * torch.randn(N, H, generator=g)).requires_grad_()
    head = (target_head + 0.1 * torch.randn(V, H, generator=g)).requires_grad_()
    ids, logprobs = _topk(target_hidden @ target_head.T, V)
    results = []
    for loss_fn in (lambda: soft_cross_entropy(normed, head, target_hidden, target_head, None, chunk),
                    lambda: topk_cross_entropy(normed, head, ids, logprobs, None, chunk)):
        loss, correct = loss_fn()
        (2.5 * loss).backward()
        results.append((loss, correct, normed.grad.clone(), head.grad.clone()))
        normed.grad = head.grad = None
    (dense, dense_ok, dense_gx, dense_gw), (topk, topk_ok, topk_gx, topk_gw) = results
    torch.testing.assert_close(topk, dense, rtol=1e-5, atol=1e-4)
    assert torch.equal(topk_ok, dense_ok) and 0 < int(topk_ok.sum()) < N
    torch.testing.assert_close(topk_gx, dense_gx, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(topk_gw, dense_gw, rtol=1e-4, atol=1e-5)


def test_objective_on_every_id_equals_the_objective_on_final_states(tiny_cfg: DraftConfig,
                                                                    draft_verifier_dir: Path) -> None:
    """The whole objective (TTT steps, alignment) on a top-k batch with k = V == on final states."""
    from model.verifier_weights import read_verifier_head

    head = read_verifier_head(draft_verifier_dir, torch.float32).lm_head   # [V, H]
    dense_rows, topk_rows = [], []
    for seed, T in ((0, 23), (1, 17)):
        ids, mask, aux, final = _sample(tiny_cfg, T, seed)
        dense_rows.append((ids, mask, aux, final))
        topk_rows.append((ids, mask, aux, _topk(final @ head.T, tiny_cfg.vocab_size)))
    dense = collate_rows([pack_row(dense_rows, 64)])
    topk = collate_rows([pack_row(topk_rows, 64)])
    results = []
    for batch, target_head in ((dense, head), (topk, None)):
        obj = _objective(tiny_cfg, draft_verifier_dir, target_head)
        out = obj(batch)
        out.loss.backward()
        results.append((out, {n: p.grad for n, p in obj.named_parameters() if p.requires_grad}))
    (a, ga), (b, gb) = results
    assert a.stats.count.tolist() == b.stats.count.tolist() and a.stats.count[0] > 10
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-5)
    assert a.stats.correct.tolist() == b.stats.correct.tolist()
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-3, atol=1e-6)


# ---- (b) backward against autograd of the naive loss --------------------------------------------
@pytest.mark.parametrize("pruned", [None, 20])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_topk_loss_and_gradients_follow_the_naive_loss(pruned: int | None, chunk: int) -> None:
    N, H, V, k = 29, 16, 50, 6
    normed, head, ids, logprobs, keep = _problem(N, H, V, k, pruned, seed=3)
    normed.requires_grad_(), head.requires_grad_()
    loss, correct = topk_cross_entropy(normed, head, ids, logprobs, keep, chunk)
    (1.5 * loss).backward()
    grads = normed.grad.clone(), head.grad.clone()
    # fp64 reference: the chunked loss works in fp32 blocks.
    ref_x, ref_w = normed.detach().double().requires_grad_(), head.detach().double().requires_grad_()
    ref_loss, ref_correct = _naive_bucket_loss(ref_x, ref_w, ids, logprobs, keep)
    (1.5 * ref_loss).backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    assert torch.equal(correct, ref_correct)
    torch.testing.assert_close(grads[0], ref_x.grad.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[1], ref_w.grad.float(), rtol=1e-4, atol=1e-5)
    # The r == 0 rows are really there, and the other rows have a bucket of mass off S.
    draft_ids = draft_ids_of(ids, keep, head.shape[0])
    mass = torch.where(draft_ids >= 0, logprobs.exp(), 0).sum(-1)
    assert (mass[-3:] >= 1).all() and (mass[:-3] < 1).all()
    if pruned:
        assert (draft_ids[:-3] < 0).any()                                 # top-k ids the draft lacks


def test_gradient_is_q_minus_the_bucketed_target() -> None:
    """d loss / d logits = q - p~: p~ = p on S, r q / (1 - Q) off S (head = identity: grad_x = dz)."""
    g = torch.Generator().manual_seed(5)
    N, V, k = 9, 12, 4
    z = (3 * torch.randn(N, V, generator=g)).requires_grad_()
    ids, logprobs = _topk(torch.randn(N, V, generator=g), k)
    loss, _ = ChunkedTopKCE.apply(z, torch.eye(V), ids, logprobs.exp(), ids[:, 0], None, 4)
    loss.backward()
    q = z.detach().softmax(-1)
    p = torch.zeros(N, V).scatter_(1, ids, logprobs.exp())
    in_set = torch.zeros(N, V, dtype=torch.bool).scatter_(1, ids, True)
    r = 1 - p.sum(-1, keepdim=True)
    Q = (q * in_set).sum(-1, keepdim=True)
    p_tilde = torch.where(in_set, p, r * q / (1 - Q))
    torch.testing.assert_close(z.grad, q - p_tilde, rtol=1e-4, atol=1e-6)


def test_draft_ids_of_maps_through_any_pruned_vocabulary() -> None:
    keep = torch.tensor([7, 2, 9, 4])                                     # unsorted on purpose
    ids = torch.tensor([[9, 3, -1], [2, 7, 11]])
    assert draft_ids_of(ids, keep, 4).tolist() == [[2, -1, -1], [1, 0, -1]]
    assert draft_ids_of(ids, None, 10).tolist() == [[9, 3, -1], [2, 7, -1]]


def test_topk_loss_in_bf16_follows_the_fp32_loss() -> None:
    """bf16 inputs (the GPU recipe): bf16 matmuls, fp32 block maths."""
    N, H, V, k = 29, 32, 64, 8
    normed, head, ids, logprobs, _ = _problem(N, H, V, k, None, seed=1)
    head = head / 4
    low = [t.bfloat16().requires_grad_() for t in (normed, head)]
    ref = [t.bfloat16().float().requires_grad_() for t in (normed, head)]
    loss, _ = topk_cross_entropy(*low, ids, logprobs, None, 8)
    loss.backward()
    ref_loss, _ = topk_cross_entropy(*ref, ids, logprobs, None, 8)
    ref_loss.backward()
    assert low[0].grad.dtype == low[1].grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=0)
    torch.testing.assert_close(low[0].grad.float(), ref[0].grad, rtol=5e-2, atol=2e-2)
    torch.testing.assert_close(low[1].grad.float(), ref[1].grad, rtol=5e-2, atol=2e-2)


def test_topk_loss_without_rows_is_zero_with_zero_gradients() -> None:
    normed = torch.zeros(0, 8, requires_grad=True)
    head = torch.randn(10, 8, requires_grad=True)
    loss, correct = topk_cross_entropy(normed, head, torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3),
                                       None, 4)
    loss.backward()
    assert loss.item() == 0 and correct.numel() == 0 and torch.all(head.grad == 0)


# ---- (c) top-1 agreement ----------------------------------------------------------------------
@pytest.mark.parametrize("pruned", [None, 20])
def test_correct_is_the_draft_argmax_against_the_verifier_top1(pruned: int | None) -> None:
    N, H, V, k = 40, 16, 50, 5
    normed, head, ids, logprobs, keep = _problem(N, H, V, k, pruned, seed=7)
    _, correct = topk_cross_entropy(normed, head, ids, logprobs, keep, 9)
    pred = (normed @ head.T).argmax(-1)                                   # draft ids
    expected = (keep[pred] if keep is not None else pred) == ids[:, 0]
    assert torch.equal(correct, expected) and 0 < int(correct.sum()) < N


# ---- (d) rows not stored never reach the loss ---------------------------------------------------
def _sample(cfg: DraftConfig, T: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(input_ids [T], loss_mask [T], aux [T, n_aux, H], final [T, H]): random, two assistant turns."""
    g = torch.Generator().manual_seed(seed)
    H = cfg.target_hidden_size
    mask = torch.zeros(T, dtype=torch.bool)
    mask[3:T // 2] = mask[T // 2 + 3:] = True
    return (torch.randint(0, cfg.vocab_size, (T,), generator=g), mask,
            torch.randn(T, cfg.num_aux, H, generator=g), torch.randn(T, H, generator=g))


def _stored_topk(mask: Tensor, ids: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """What a top-k store keeps: only rows j with j + 1 < T and loss_mask[j + 1]."""
    stored = torch.zeros_like(mask)
    stored[:-1] = mask[1:]
    return (torch.where(stored[:, None], ids, -1),
            torch.where(stored[:, None], logprobs, torch.full_like(logprobs, NEG_INF)))


def _objective(cfg: DraftConfig, verifier: Path, target_head: Tensor | None, steps: int = 3,
               d2t: Tensor | None = None) -> Eagle3Objective:
    torch.manual_seed(0)
    draft = build_draft(cfg)
    if d2t is not None:
        draft.set_vocab(d2t)
    draft.load_verifier_head(Verifier.open(verifier))
    return Eagle3Objective(draft, target_head, ObjectiveConfig(steps, 0.8, 1 << 22))


def _topk_batch(cfg: DraftConfig, k: int, lengths: tuple[int, ...], seed: int = 0) -> Batch:
    """Two rows (the second padded): samples with stored top-k targets of a random verifier."""
    rows = []
    for r, row_lengths in enumerate(((lengths[0], lengths[1]), (lengths[2],))):
        samples = []
        for i, T in enumerate(row_lengths):
            ids, mask, aux, _ = _sample(cfg, T, seed + 10 * r + i)
            g = torch.Generator().manual_seed(seed + 100 + 10 * r + i)
            top_ids, top_lp = _topk(4 * torch.randn(T, cfg.vocab_size, generator=g), k)
            samples.append(row_sample(TopKSample(f"s{r}{i}", ids, mask, aux, None,
                                                 *_stored_topk(mask, top_ids, top_lp))))
        rows.append(pack_row(samples, sum(lengths)))
    return collate_rows(rows)


def test_rows_not_stored_never_reach_the_loss(monkeypatch, tiny_cfg: DraftConfig, draft_verifier_dir: Path) -> None:
    batch = _topk_batch(tiny_cfg, 8, (19, 14, 21))
    assert batch.target_ids.shape[:2] == batch.input_ids.shape and batch.target_ids.shape[2] == 8
    assert (batch.target_ids == -1).any() and (batch.segment_ids == -1).any()
    seen = []
    real = objective_module.topk_cross_entropy

    def spy(normed, head, target_ids, target_logprobs, *rest):
        seen.append((target_ids, target_logprobs))
        return real(normed, head, target_ids, target_logprobs, *rest)

    monkeypatch.setattr(objective_module, "topk_cross_entropy", spy)
    obj = _objective(tiny_cfg, draft_verifier_dir, None, steps=3)
    with torch.no_grad():
        out = obj(batch)
    assert len(seen) == 3 and all(len(ids) for ids, _ in seen)
    for ids, logprobs in seen:
        assert (ids >= 0).all() and torch.isfinite(logprobs).all()
    assert torch.isfinite(out.loss) and out.stats.count.tolist() == [len(ids) for ids, _ in seen]
    # Garbage in the rows not stored (and in the padding) changes nothing.
    unstored = batch.target_ids[..., 0] < 0
    spoiled = batch.with_topk(torch.where(unstored[..., None], 5, batch.target_ids),
                              torch.where(unstored[..., None], float("nan"), batch.target_logprobs))
    with torch.no_grad():
        again = obj(spoiled)
    assert torch.equal(again.loss, out.loss) and torch.equal(again.stats.stacked(), out.stats.stacked())


def test_topk_rows_pad_ids_with_minus_one_and_logprobs_with_minus_inf(tiny_cfg: DraftConfig) -> None:
    batch = _topk_batch(tiny_cfg, 4, (9, 6, 11))
    assert batch.topk and batch.final is None and batch.target_ids.dtype == torch.int64
    assert batch.target_logprobs.dtype == torch.float32
    pad = batch.segment_ids == -1                                         # [2, 15]: the second row's tail
    assert pad.sum() == 4 and (batch.target_ids[pad] == -1).all()
    assert (batch.target_logprobs[pad] == NEG_INF).all()
    ids, mask, aux, final = _sample(tiny_cfg, 5, 0)
    with pytest.raises(ValueError, match="mixes"):
        pack_row([(ids, mask, aux, final), (ids, mask, aux, (torch.zeros(5, 2, dtype=torch.long),
                                                              torch.zeros(5, 2)))], 16)
    with pytest.raises(ValueError, match="neither final states nor top-k"):
        row_sample(TopKSample("bare", ids, mask, aux))


# ---- (e) training lowers the loss ----------------------------------------------------------------
@pytest.mark.parametrize("pruned", [False, True])
def test_a_few_steps_lower_the_topk_loss(tiny_cfg: DraftConfig, draft_verifier_dir: Path, pruned: bool) -> None:
    batch = _topk_batch(tiny_cfg, 8, (31, 24, 40), seed=4)
    d2t = None
    cfg = tiny_cfg
    if pruned:          # the rows' own top-k ids and some others: S is partly outside the draft
        wanted = torch.unique(batch.target_ids[batch.target_ids >= 0])
        kept = torch.unique(torch.cat([wanted[::2], torch.arange(0, tiny_cfg.vocab_size, 16)]))
        d2t = kept - torch.arange(kept.numel())
        cfg = dataclasses.replace(tiny_cfg, draft_vocab_size=kept.numel())
    obj = _objective(cfg, draft_verifier_dir, None, steps=2, d2t=d2t)
    if pruned:
        assert torch.equal(target_ids_of(obj.draft.d2t), kept)
    optimizer = torch.optim.Adam([p for p in obj.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        out = obj(batch)
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.85 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


# ---- the accept-length simulation needs final states ----------------------------------------------
def test_simulation_refuses_a_sample_without_final_states(tiny_cfg: DraftConfig, draft_verifier_dir: Path) -> None:
    from evaluation.simulate import chain_outcomes

    ids, mask, aux, _ = _sample(tiny_cfg, 12, 0)
    top_ids, top_lp = _topk(torch.randn(12, tiny_cfg.vocab_size), 4)
    sample = TopKSample("conv_7", ids, mask, aux, None, top_ids, top_lp)
    draft = build_draft(tiny_cfg)
    with pytest.raises(ValueError, match="sample 'conv_7' has no final hidden states.*must keep final states"):
        chain_outcomes(draft, torch.zeros(tiny_cfg.vocab_size, tiny_cfg.hidden_size), sample, 2, None, 8)


def test_step_inputs_count_only_stored_rows(tiny_cfg: DraftConfig) -> None:
    """Every counted position of every step reads a stored row (alignment of the store's rule)."""
    batch = _topk_batch(tiny_cfg, 3, (13, 10, 17))
    stored = batch.target_ids[..., 0] >= 0
    for k in range(4):
        _, _, counted = step_inputs(batch, k)
        b, t = counted.nonzero(as_tuple=True)
        assert stored[b, t + 1 + k].all()


def _dense_batch(cfg: DraftConfig) -> Batch:
    rows = [[_sample(cfg, T, seed) for seed, T in ((0, 23), (1, 17))], [_sample(cfg, 30, 2)]]
    return collate_rows([pack_row(row, 48) for row in rows])


def test_topk_targets_from_final_states_with_every_id_equal_the_dense_objective(
        tiny_cfg: DraftConfig, draft_verifier_dir: Path) -> None:
    """target_topk = V: the objective's own top-k of the final states trains as the dense loss."""
    from model.verifier_weights import read_verifier_head

    head = read_verifier_head(draft_verifier_dir, torch.float32).lm_head   # [V, H]
    batch = _dense_batch(tiny_cfg)
    results = []
    for k in (None, tiny_cfg.vocab_size):
        obj = _objective(tiny_cfg, draft_verifier_dir, head)
        obj.cfg = dataclasses.replace(obj.cfg, target_topk=k)
        out = obj(batch)
        out.loss.backward()
        results.append((out, {n: p.grad for n, p in obj.named_parameters() if p.requires_grad}))
    assert_same_objective_runs(results, loss_tol=1e-5, grad_rtol=1e-3, grad_atol=1e-6)


def test_topk_targets_are_the_verifier_topk_on_the_rows_a_step_reads(tiny_cfg: DraftConfig,
                                                                     draft_verifier_dir: Path) -> None:
    from model.verifier_weights import read_verifier_head
    from train.topk_ce import topk_targets

    head = read_verifier_head(draft_verifier_dir, torch.float32).lm_head
    batch = _dense_batch(tiny_cfg)
    got = topk_targets(batch, head, 5, 1 << 16)                  # a few rows per logits block
    read = torch.zeros_like(batch.loss_mask)                      # rows t+1+k of counted (t, k)
    for k in range(4):
        _, _, counted = step_inputs(batch, k)
        b, t = counted.nonzero(as_tuple=True)
        read[b, t + 1 + k] = True
    has = got.target_ids[..., 0] >= 0
    assert read.any() and torch.equal(has & read, read)           # every row a step reads
    assert not (has & (batch.segment_ids < 0)).any()              # never padding
    logprobs = torch.log_softmax(batch.final.float() @ head.T, -1)
    top = logprobs.topk(5, -1)
    assert torch.equal(got.target_ids[has], top.indices[has])
    torch.testing.assert_close(got.target_logprobs[has], top.values[has])
    assert (got.target_ids[~has] == -1).all() and (got.target_logprobs[~has] == NEG_INF).all()
