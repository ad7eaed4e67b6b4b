"""Tests of train/objective.py and train/soft_ce.py: alignment, chunked soft cross-entropy, packing, accept length."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

import train.objective as objective_module
from tests.conftest import assert_same_objective_runs
from model.batch import PAD_SEGMENT, Batch, RowSample, collate_rows, pack_row
from model.chain import step_inputs
from config import compose_draft_conf
from model.draft import DraftConfig, build_draft
from model.verifier_handle import Verifier
from model.verifier_weights import read_verifier_head
from store import StoreReader
import train.soft_ce as soft_ce
from train.objective import Eagle3Objective, ObjectiveConfig, simulated_accept_length
from train.logit_blocks import ARGMAX_BLOCK, ARGMAX_BLOCKED_MIN, row_argmax
from train.soft_ce import build_target_cache, soft_cross_entropy
from train.topk_ce import topk_targets


@pytest.fixture(scope="module")
def tiny_cfg(draft_verifier_dir: Path) -> DraftConfig:
    return DraftConfig.from_conf(compose_draft_conf("kimi_tiny"), Verifier.open(draft_verifier_dir))


def _objective(cfg: DraftConfig, verifier: Path, steps: int = 3, chunk_bytes: int = 1 << 27,
               d2t: torch.Tensor | None = None) -> Eagle3Objective:
    torch.manual_seed(0)
    draft = build_draft(cfg)
    if d2t is not None:
        draft.set_vocab(d2t)
    draft.load_verifier_head(Verifier.open(verifier))
    head = read_verifier_head(verifier, torch.float32).lm_head
    return Eagle3Objective(draft, head, ObjectiveConfig(steps, 0.8, chunk_bytes))


# ---- alignment --------------------------------------------------------------------------------
def _hand_row() -> Batch:
    """Two samples packed in one row, then 2 tokens of padding.
    A: ids 10..15, assistant tokens at 3, 4, 5.   B: ids 20..24, assistant tokens at 1, 2, 3."""
    H = 4
    samples = []
    for ids, mask in (([10, 11, 12, 13, 14, 15], [0, 0, 0, 1, 1, 1]), ([20, 21, 22, 23, 24], [0, 1, 1, 1, 0])):
        T = len(ids)
        final = torch.arange(T, dtype=torch.float32)[:, None].expand(T, H) + ids[0]  # final[t] marks (sample, t)
        samples.append(RowSample(torch.tensor(ids), torch.tensor(mask, dtype=torch.bool), torch.zeros(T, 3, H), final))
    row = pack_row(samples, max_len=16)                           # 11 tokens
    longer = row.map(lambda v: torch.zeros((13, *v.shape[1:]), dtype=v.dtype))
    return collate_rows([row, longer]).map(lambda v: v[:1])      # padded to 13, segment -1


def test_alignment_on_a_hand_built_row() -> None:
    """Step k at position t reads x[t+1+k], sits at position t+k, is trained towards F[t+1+k],
    and counts iff x[t+2+k] (the predicted token) is an assistant token of the same sample."""
    batch = _hand_row()
    L = batch.input_ids.shape[1]
    assert L == 13 and batch.segment_ids[0].tolist() == [0] * 6 + [1] * 5 + [-1] * 2
    ids0, pos0, counted0 = step_inputs(batch, 0)
    assert ids0[0].tolist() == [11, 12, 13, 14, 15, 0, 21, 22, 23, 24, 0, 0, 0]
    assert pos0[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0, 0]
    # A predicts its tokens 3, 4, 5 from positions 1, 2, 3; B its tokens 2, 3 from 0, 1
    # (token 1 of B is an assistant token too, but no position of B predicts it two ahead).
    assert counted0[0].nonzero().flatten().tolist() == [1, 2, 3, 6, 7]
    ids1, pos1, counted1 = step_inputs(batch, 1)
    assert ids1[0].tolist() == [12, 13, 14, 15, 0, 0, 22, 23, 24, 0, 0, 0, 0]
    assert pos1[0].tolist()[:6] == [1, 2, 3, 4, 5, 6]
    assert counted1[0].nonzero().flatten().tolist() == [0, 1, 2, 6]
    ids3, _, counted3 = step_inputs(batch, 3)
    assert counted3[0].nonzero().flatten().tolist() == [0]         # A: t=0 predicts x[5]
    # Public trainers' l[t] would instead count positions 3, 4, 5 of A at step 0, predicting
    # x[5], x[6] (B's first token!) and beyond: the shift above is the one that stays inside.


def test_targets_are_the_final_states_one_ahead(monkeypatch, tiny_cfg: DraftConfig, draft_verifier_dir: Path) -> None:
    """The verifier hidden state each counted position is trained against: F[t+1+k] of its sample."""
    H = tiny_cfg.hidden_size
    batch = _hand_row()
    batch = dataclasses.replace(batch, aux=torch.zeros(*batch.input_ids.shape, 3 * H),
                                final=batch.final[..., :1].expand(*batch.final.shape[:2], H).contiguous())
    seen = []
    real = objective_module.soft_cross_entropy

    def spy(normed, head, target_hidden, target_head, keep, chunk, cache=None, rows=None, **kw):
        # The objective may pass all of final and name each position's row in it.
        seen.append((target_hidden if rows is None else target_hidden[rows])[:, 0].tolist())
        return real(normed, head, target_hidden, target_head, keep, chunk, cache, rows, **kw)

    monkeypatch.setattr(objective_module, "soft_cross_entropy", spy)
    obj = _objective(tiny_cfg, draft_verifier_dir, steps=4)
    with torch.no_grad():
        out = obj(batch)
    # final[t] = first id of the sample + t: A's markers 10 + t, B's 20 + t.
    assert seen[0] == [10 + 2, 10 + 3, 10 + 4, 20 + 1, 20 + 2]     # positions 1, 2, 3 | 0, 1 -> F[t+1]
    assert seen[1] == [10 + 2, 10 + 3, 10 + 4, 20 + 2]             # positions 0, 1, 2 | 0 -> F[t+2]
    assert seen[3] == [10 + 4]
    assert out.stats.count.tolist() == [5, 4, 2, 1]


def test_chains_follow_each_start_position_through_the_steps(monkeypatch, tiny_cfg: DraftConfig,
                                                             draft_verifier_dir: Path) -> None:
    """With every draft agreeing, a chain started at step 0 (positions 1, 2, 3 | 6, 7) lives while
    its later steps still predict assistant tokens of its own sample: [5, 3, 1, 0] alive."""
    H = tiny_cfg.hidden_size
    batch = _hand_row()
    batch = dataclasses.replace(batch, aux=torch.zeros(*batch.input_ids.shape, 3 * H),
                                final=torch.zeros(*batch.input_ids.shape, H))
    real = objective_module.soft_cross_entropy

    def always_right(*args):
        loss, correct = real(*args)
        return loss, torch.ones_like(correct)

    monkeypatch.setattr(objective_module, "soft_cross_entropy", always_right)
    with torch.no_grad():
        stats = _objective(tiny_cfg, draft_verifier_dir, steps=4)(batch).stats
    assert stats.count.tolist() == [5, 4, 2, 1] and stats.correct.tolist() == [5, 4, 2, 1]
    assert stats.chain.tolist() == [5, 3, 1, 0]


# ---- chunked soft cross-entropy -------------------------------------------------------------
def _reference(normed, head, target_hidden, target_head, keep):
    target = target_hidden @ target_head.T
    top = target.argmax(-1)
    if keep is not None:
        target = target[:, keep]
    logits = normed @ head.T
    loss = -(target.softmax(-1) * logits.log_softmax(-1)).sum()
    pred = logits.argmax(-1)
    return loss, (keep[pred] if keep is not None else pred) == top


@pytest.mark.parametrize("pruned", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_loss_equals_the_unchunked_reference(pruned: bool, chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    N, H, V = 37, 16, 50
    keep = torch.sort(torch.randperm(V, generator=g)[:20]).values if pruned else None
    Vd = 20 if pruned else V
    target_hidden, target_head = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    # A draft near the verifier, so that some top-1s agree and some do not.
    normed = (target_hidden + 0.5 * torch.randn(N, H, generator=g)).requires_grad_()
    head = ((target_head[keep] if pruned else target_head) + 0.1 * torch.randn(Vd, H, generator=g)).requires_grad_()
    loss, correct = soft_cross_entropy(normed, head, target_hidden, target_head, keep, chunk)
    (2.5 * loss).backward()
    grads = normed.grad.clone(), head.grad.clone()
    normed.grad = head.grad = None
    ref_loss, ref_correct = _reference(normed, head, target_hidden, target_head, keep)
    (2.5 * ref_loss).backward()
    torch.testing.assert_close(loss.float(), ref_loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(correct, ref_correct) and 0 < int(correct.sum()) < N
    # fp32 sums in another order: a few ulps of the largest entries.
    torch.testing.assert_close(grads[0], normed.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[1], head.grad, rtol=1e-4, atol=1e-5)


def test_chunked_loss_in_bf16_follows_the_fp32_reference() -> None:
    """bf16 inputs (the GPU recipe): bf16 matmuls, fp32 softmax and accumulation."""
    g = torch.Generator().manual_seed(1)
    N, H, V = 29, 32, 64
    tensors = [torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) / 4,
               torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) / 4]
    low = [t.bfloat16().requires_grad_(i < 2) for i, t in enumerate(tensors)]
    loss, _ = soft_cross_entropy(low[0], low[1], low[2], low[3], None, 8)
    loss.backward()
    ref = [t.bfloat16().float().requires_grad_(i < 2) for i, t in enumerate(tensors)]
    ref_loss, _ = _reference(*ref, None)
    ref_loss.backward()
    assert low[0].grad.dtype == low[1].grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.float(), ref_loss, rtol=2e-2, atol=0)
    torch.testing.assert_close(low[0].grad.float(), ref[0].grad, rtol=5e-2, atol=2e-2)
    torch.testing.assert_close(low[1].grad.float(), ref[1].grad, rtol=5e-2, atol=2e-2)


def test_row_argmax_is_torchs_argmax_ties_included() -> None:
    """The blocked argmax the losses take their top-1 with: torch's argmax exactly, the first of
    equal maxima included (few distinct values make ties in and across blocks), maxima in the
    first and the last block; widths off the block grid, column slices and small blocks go to
    torch's own."""
    g = torch.Generator().manual_seed(3)
    V = 64 * ARGMAX_BLOCK
    rows = -(-ARGMAX_BLOCKED_MIN // V)                      # the smallest block that takes the blocked path
    for z in (torch.randn(rows, V, generator=g), torch.randint(0, 4, (rows, V), generator=g).float(),
              torch.randn(rows, V, generator=g).bfloat16(), torch.randn(5, V, generator=g)):
        z[0, 0] = z[1, -1] = 1e4
        assert torch.equal(row_argmax(z), z.argmax(-1))
    with torch.profiler.profile() as prof:                   # the blocked path did run: block maxima
        row_argmax(torch.randn(rows, V, generator=g))
    assert "aten::amax" in {event.key for event in prof.key_averages()}
    odd = torch.randn(7, V + 3, generator=g)
    assert torch.equal(row_argmax(odd), odd.argmax(-1))
    assert torch.equal(row_argmax(odd[:, 3:]), odd[:, 3:].argmax(-1))


def test_chunked_loss_without_rows_is_zero_with_zero_gradients() -> None:
    normed = torch.zeros(0, 8, requires_grad=True)
    head = torch.randn(10, 8, requires_grad=True)
    loss, correct = soft_cross_entropy(normed, head, torch.zeros(0, 8), torch.randn(10, 8), None, 4)
    loss.backward()
    assert loss.item() == 0 and correct.numel() == 0 and torch.all(head.grad == 0)


# ---- packing ------------------------------------------------------------------------------------
def test_packed_row_gives_the_loss_and_gradients_of_separate_rows(
        tiny_cfg: DraftConfig, draft_verifier_dir: Path, train_store: Path) -> None:
    """Two real samples packed into one row == the same two samples as a batch of two rows."""
    reader = StoreReader(train_store)
    samples = [reader.read_sample(ref, torch.float32) for ref in reader.samples()[:2]]
    parts = [(s.input_ids, s.loss_mask, s.aux, s.final) for s in samples]
    packed = collate_rows([pack_row(parts, 4096)])
    separate = collate_rows([pack_row([p], 4096) for p in parts])
    obj = _objective(tiny_cfg, draft_verifier_dir, steps=3)
    results = []
    for batch in (packed, separate):
        obj.zero_grad()
        out = obj(batch)
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in obj.named_parameters() if p.requires_grad}))
    (a, ga), (b, gb) = results
    assert a.stats.count.tolist() == b.stats.count.tolist() and a.stats.count[0] > 10
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.stats.loss_sum, b.stats.loss_sum, rtol=1e-5, atol=1e-4)
    assert a.stats.correct.tolist() == b.stats.correct.tolist()
    assert a.stats.chain.tolist() == b.stats.chain.tolist()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-6)


def test_pruned_vocabulary_trains_against_the_restricted_target(
        tiny_cfg: DraftConfig, draft_verifier_dir: Path, train_store: Path) -> None:
    """With d2t, the loss is the soft CE against the verifier restricted to the kept tokens."""
    from model.vocab import build_draft_vocab, count_tokens

    reader = StoreReader(train_store)
    s = reader.read_sample(reader.samples()[0], torch.float32)
    d2t, _ = build_draft_vocab(count_tokens(s.input_ids, s.loss_mask, tiny_cfg.vocab_size), 256)
    cfg = dataclasses.replace(tiny_cfg, draft_vocab_size=256)
    obj = _objective(cfg, draft_verifier_dir, steps=1, d2t=d2t)
    batch = collate_rows([pack_row([(s.input_ids, s.loss_mask, s.aux, s.final)], 4096)])
    out = obj(batch)
    out.loss.backward()
    _, _, counted = step_inputs(batch, 0)
    b, t = counted.nonzero(as_tuple=True)
    keep = torch.arange(256) + d2t
    with torch.no_grad():
        draft = obj.draft
        ids, positions, _ = step_inputs(batch, 0)
        step = draft.step(ids, draft.project_aux(batch.aux), positions, None, batch.segment_ids)
        ref, _ = _reference(step.normed[b, t], draft.lm_head.weight, batch.final[b, t + 1], obj.target_head, keep)
    torch.testing.assert_close(out.stats.loss_sum[0].float(), ref, rtol=1e-5, atol=1e-4)
    assert obj.draft.fc.weight.grad is not None and obj.draft.fc.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("pruned", [False, True])
def test_target_cache_gives_the_loss_stats_and_gradients_of_recomputing(
        tiny_cfg: DraftConfig, draft_verifier_dir: Path, train_store: Path, pruned: bool) -> None:
    """TargetCache (verifier probabilities computed once per micro-batch) == recomputed per step."""
    from model.vocab import build_draft_vocab, count_tokens

    reader = StoreReader(train_store)
    samples = [reader.read_sample(ref, torch.float32) for ref in reader.samples()[:3]]
    batch = collate_rows([pack_row([(s.input_ids, s.loss_mask, s.aux, s.final) for s in samples[:2]], 4096),
                          pack_row([(samples[2].input_ids, samples[2].loss_mask, samples[2].aux, samples[2].final)], 4096)])
    cfg, d2t = tiny_cfg, None
    if pruned:
        d2t, _ = build_draft_vocab(count_tokens(samples[0].input_ids, samples[0].loss_mask, tiny_cfg.vocab_size), 256)
        cfg = dataclasses.replace(tiny_cfg, draft_vocab_size=256)
    results = []
    for cache_bytes in (0, 1 << 30):
        obj = _objective(cfg, draft_verifier_dir, steps=4, chunk_bytes=1 << 20, d2t=d2t)
        obj.cfg = dataclasses.replace(obj.cfg, target_cache_bytes=cache_bytes)
        assert (obj._target_cache(batch, batch.final, None if d2t is None else torch.arange(256) + d2t)
                is None) == (cache_bytes == 0)
        out = obj(batch)
        out.loss.backward()
        results.append((out, {n: p.grad for n, p in obj.named_parameters() if p.requires_grad}))
    assert_same_objective_runs(results, loss_tol=1e-6, grad_rtol=1e-5, grad_atol=1e-7)


# ---- accept length ----------------------------------------------------------------------------
def test_simulated_accept_length() -> None:
    assert simulated_accept_length([1, 1, 1, 1]) == 5
    assert simulated_accept_length([0, 1, 1]) == 1
    assert simulated_accept_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


# ---- acceptance term ------------------------------------------------------------------------
def _acceptance_reference(normed, head, target_hidden, target_head, keep, kind, weight):
    """Dense PyTorch: sum over rows of soft CE + weight * (1 - alpha) (tv), weight * -log
    max(alpha, 1e-6) (lk), or lambda CE + (1 - lambda)(1 - alpha) with lambda = exp(-weight alpha)
    held constant (hybrid); alpha = sum_v min(p_v, q_v), p restricted to keep and renormalised."""
    target = target_hidden @ target_head.T
    if keep is not None:
        target = target[:, keep]
    p, logits = target.softmax(-1), normed @ head.T
    ce = -(p * logits.log_softmax(-1)).sum(-1)
    alpha = torch.minimum(p, logits.softmax(-1)).sum(-1)
    if kind == "hybrid":
        lam = torch.exp(-weight * alpha.detach())
        return (lam * ce + (1 - lam) * (1 - alpha)).sum()
    term = 1 - alpha if kind == "tv" else -alpha.clamp(min=1e-6).log()
    return (ce + weight * term).sum()


def _acceptance_case(pruned: bool, seed: int = 0):
    """float64 (normed, head, target_hidden, target_head, keep): a draft near the verifier, so that
    alpha spreads over (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    N, H, V, Vd = 37, 16, 50, 20
    f64 = dict(generator=g, dtype=torch.float64)
    keep = torch.sort(torch.randperm(V, generator=g)[:Vd]).values if pruned else None
    target_hidden, target_head = torch.randn(N, H, **f64), torch.randn(V, H, **f64)
    normed = target_hidden + 0.5 * torch.randn(N, H, **f64)
    head = (target_head[keep] if pruned else target_head) + 0.1 * torch.randn(Vd if pruned else V, H, **f64)
    return normed, head, target_hidden, target_head, keep


def _grads(loss_fn, normed, head):
    """(loss, d(2.5 loss)/d normed, d(2.5 loss)/d head) of loss_fn(normed, head)."""
    normed, head = normed.clone().requires_grad_(), head.clone().requires_grad_()
    loss = loss_fn(normed, head)
    (2.5 * loss).backward()
    return loss.detach(), normed.grad, head.grad


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("pruned", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("kind", ["tv", "lk", "hybrid"])
def test_acceptance_loss_and_gradients_equal_the_dense_reference(kind: str, chunk: int, pruned: bool,
                                                                 cached: bool) -> None:
    """Chunked CE + acceptance term == materialised softmax and autograd, in the loss and in the
    gradients w.r.t. normed and head; chunk 7 does not divide N = 37, 64 exceeds it. The chunked
    loss computes in fp32 blocks whatever its inputs' dtype, so the match is to fp32 rounding."""
    normed, head, target_hidden, target_head, keep = _acceptance_case(pruned)
    N = normed.shape[0]
    rows = torch.randperm(N, generator=torch.Generator().manual_seed(3))   # cache row of each of the N
    if cached:
        cache = build_target_cache(target_hidden[None], torch.ones(1, N, dtype=torch.bool), target_head, keep,
                                   head.shape[0], 5)
        inputs = (None, target_head, keep, chunk, cache, rows)
        target_hidden = target_hidden[rows]                            # what row n of the loss reads
    else:
        inputs = (target_hidden, target_head, keep, chunk)
    loss, gx, gw = _grads(lambda x, w: soft_cross_entropy(x, w, *inputs, acceptance=kind,
                                                          acceptance_weight=0.7)[0], normed, head)
    ref, rx, rw = _grads(lambda x, w: _acceptance_reference(x, w, target_hidden, target_head, keep, kind, 0.7),
                         normed, head)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-5)
    # The term moves the gradient far beyond those tolerances: the check sees it.
    _, cx, cw = _grads(lambda x, w: _reference(x, w, target_hidden, target_head, keep)[0], normed, head)
    assert (rx - cx).abs().max() > 0.1 and (rw - cw).abs().max() > 0.1


@pytest.mark.parametrize("kind", ["tv", "lk"])
def test_acceptance_chunk_maths_in_float64(kind: str) -> None:
    """The per-chunk helpers on float64 buffers, against autograd at 1e-12, with ties: a tie
    q_v = p_v is outside {q < p} (min is p_v there, constant in z), and a row with p = q has
    alpha 1 and no acceptance gradient. Each gradient row sums to 0 (softmax is shift-invariant)."""
    g = torch.Generator().manual_seed(5)
    f64 = dict(generator=g, dtype=torch.float64)
    z = (2 * torch.randn(6, 12, **f64)).requires_grad_()
    q = z.softmax(-1)
    p = torch.randn(6, 12, **f64).mul(2).softmax(-1)
    # Ties on 4 tokens of every row, the rest scaled so that p still sums to 1; row 0: p = q.
    tied = q[:, :4].detach()
    p[:, 4:] *= (1 - tied.sum(-1, keepdim=True)) / p[:, 4:].sum(-1, keepdim=True)
    p[:, :4] = tied
    p[0] = q[0].detach()
    alpha_ref = torch.where(q < p, q, p).sum(-1)                       # the stated tie convention
    term_ref = soft_ce._acceptance_term(alpha_ref, kind)
    term_ref.sum().backward()
    ce, alpha = soft_ce._ce_and_alpha_(p.clone(), z.detach().clone(), torch.empty_like(p))
    torch.testing.assert_close(ce, -(p * z.detach().log_softmax(-1)).sum(-1), rtol=0, atol=1e-12)
    torch.testing.assert_close(alpha, alpha_ref.detach(), rtol=0, atol=1e-12)
    assert abs(float(alpha[0]) - 1) < 1e-12
    d_alpha = soft_ce._acceptance_grad_(q.detach(), p, torch.empty_like(p))
    scale = soft_ce._acceptance_scale(alpha, kind, 1.0)
    torch.testing.assert_close(scale[:, None] * d_alpha, z.grad, rtol=0, atol=1e-12)
    assert torch.all(d_alpha[0] == 0) and torch.all(d_alpha.sum(-1).abs() < 1e-15)
    # Counting ties inside {q <= p} instead gives another gradient: the test tells them apart.
    below_or_tie = (q <= p).double() * q.detach()
    other = q.detach() * below_or_tie.sum(-1, keepdim=True) - below_or_tie
    assert (other - d_alpha)[1:].abs().max() > 1e-3


def test_lk_floor_keeps_disjoint_distributions_finite() -> None:
    """alpha = 0 exactly in fp32 (verifier and draft peaked on different tokens): the lk term is
    -log(1e-6) per row, finite, and below the floor it adds no gradient (the CE's alone)."""
    H, V = 4, 6
    target_head = torch.eye(V, H) * 1000                               # row n: verifier all on token n
    head = torch.roll(target_head, 1, 0)                               # draft all on token n + 1
    target_hidden = torch.eye(H)
    normed = torch.eye(H)
    plain, gx, gw = _grads(lambda x, w: soft_cross_entropy(x, w, target_hidden, target_head, None, 3)[0],
                           normed, head)
    lk, lx, lw = _grads(lambda x, w: soft_cross_entropy(x, w, target_hidden, target_head, None, 3,
                                                        acceptance="lk", acceptance_weight=2.0)[0], normed, head)
    assert torch.isfinite(lk) and torch.isfinite(lx).all() and torch.isfinite(lw).all()
    torch.testing.assert_close(lk, plain + 2.0 * H * -math.log(1e-6), rtol=1e-6, atol=0)
    assert torch.equal(lx, gx) and torch.equal(lw, gw)


def test_acceptance_null_runs_todays_loss_only(monkeypatch) -> None:
    """acceptance None never calls the term's maths, and equals the acceptance branch at weight 0
    to rounding (acceptance None computes its gradients in the forward, in another order)."""
    normed, head, target_hidden, target_head, keep = _acceptance_case(pruned=True, seed=2)
    inputs = [t.float() if t is not None and t.is_floating_point() else t
              for t in (normed, head, target_hidden, target_head, keep)]
    weight_zero = _grads(lambda x, w: soft_cross_entropy(x, w, *inputs[2:], 7, acceptance="tv",
                                                         acceptance_weight=0.0)[0], *inputs[:2])

    def refuse(*args):
        raise AssertionError("the acceptance term ran with acceptance None")

    for name in ("_ce_and_alpha_", "_acceptance_term", "_acceptance_scale", "_acceptance_grad_"):
        monkeypatch.setattr(soft_ce, name, refuse)
    for call in (lambda x, w: soft_cross_entropy(x, w, *inputs[2:], 7)[0],
                 lambda x, w: soft_cross_entropy(x, w, *inputs[2:], 7, acceptance=None, acceptance_weight=3.0)[0]):
        null = _grads(call, *inputs[:2])
        for a, b in zip(null, weight_zero):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-5, check_dtype=False)   # float32 rounding


@pytest.mark.parametrize("kind", ["tv", "lk"])
@pytest.mark.parametrize("cache_bytes", [0, 1 << 30])
def test_objective_optimises_and_logs_the_acceptance_term(
        tiny_cfg: DraftConfig, draft_verifier_dir: Path, train_store: Path, kind: str, cache_bytes: int) -> None:
    """ObjectiveConfig.acceptance reaches the loss: step 0's loss_sum and the loss hold the soft
    CE plus weight * term over the counted positions, with and without the target cache."""
    reader = StoreReader(train_store)
    s = reader.read_sample(reader.samples()[0], torch.float32)
    batch = collate_rows([pack_row([(s.input_ids, s.loss_mask, s.aux, s.final)], 4096)])
    obj = _objective(tiny_cfg, draft_verifier_dir, steps=1)
    obj.cfg = dataclasses.replace(obj.cfg, target_cache_bytes=cache_bytes, acceptance=kind, acceptance_weight=0.5)
    assert (obj._target_cache(batch, batch.final, None) is None) == (cache_bytes == 0)
    out = obj(batch)
    out.loss.backward()
    _, _, counted = step_inputs(batch, 0)
    b, t = counted.nonzero(as_tuple=True)
    with torch.no_grad():
        draft = obj.draft
        ids, positions, _ = step_inputs(batch, 0)
        step = draft.step(ids, draft.project_aux(batch.aux), positions, None, batch.segment_ids)
        args = (step.normed[b, t].double(), draft.lm_head.weight.double(), batch.final[b, t + 1].double(),
                obj.target_head.double(), None)
        ref = _acceptance_reference(*args, kind, 0.5)
        ce, _ = _reference(*args)
    assert b.numel() > 10 and ref - ce > 1                              # the term is there, and large
    torch.testing.assert_close(out.stats.loss_sum[0], ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.loss.double(), ref / b.numel(), rtol=1e-5, atol=1e-6)
    assert obj.draft.fc.weight.grad is not None and obj.draft.fc.weight.grad.abs().sum() > 0


def test_acceptance_settings_are_refused_where_they_cannot_work(
        tiny_cfg: DraftConfig, draft_verifier_dir: Path, train_store: Path) -> None:
    with pytest.raises(ValueError, match="tv, lk, hybrid"):
        ObjectiveConfig(3, 0.8, 1 << 27, acceptance="kl")
    with pytest.raises(ValueError, match="acceptance_weight"):
        ObjectiveConfig(3, 0.8, 1 << 27, acceptance="tv", acceptance_weight=-1.0)
    with pytest.raises(ValueError, match="target_topk=8"):
        ObjectiveConfig(3, 0.8, 1 << 27, target_topk=8, acceptance="lk")
    with pytest.raises(ValueError, match="tv, lk"):
        soft_cross_entropy(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, 4), torch.zeros(5, 4), None, 4,
                           acceptance="TV")
    cfg = ObjectiveConfig(3, 0.8, 1 << 27, acceptance="tv")
    with pytest.raises(ValueError, match="whole distribution"):            # an objective for a top-k store
        Eagle3Objective(build_draft(tiny_cfg), None, cfg)
    # A batch of top-k targets, met at first use by an objective that has the verifier's head.
    reader = StoreReader(train_store)
    s = reader.read_sample(reader.samples()[0], torch.float32)
    batch = collate_rows([pack_row([(s.input_ids, s.loss_mask, s.aux, s.final)], 4096)])
    obj = _objective(tiny_cfg, draft_verifier_dir, steps=1)
    batch = topk_targets(batch, obj.target_head, 4, 1 << 20)
    obj.cfg = cfg
    with pytest.raises(ValueError, match="whole distribution"):
        obj(batch)


def test_train_config_passes_the_acceptance_keys() -> None:
    from config import compose_config
    from train.loop import _objective_config

    default = _objective_config(compose_config("train"))
    assert default.acceptance is None and default.acceptance_weight == 1.0
    chosen = _objective_config(compose_config("train", ["train.loss.acceptance=lk",
                                                        "train.loss.acceptance_weight=0.25"]))
    assert chosen.acceptance == "lk" and chosen.acceptance_weight == 0.25


def test_padding_to_a_length_grid_changes_no_loss_or_gradient(
        tiny_cfg: DraftConfig, draft_verifier_dir: Path, train_store: Path) -> None:
    """train.pad_multiple: a row padded up to the grid trains exactly as the unpadded row."""
    reader = StoreReader(train_store)
    sample = reader.read_sample(reader.samples()[0], torch.float32)
    row = pack_row([(sample.input_ids, sample.loss_mask, sample.aux, sample.final)], 4096)
    free, grid = collate_rows([row]), collate_rows([row], multiple=100)
    T = row.input_ids.shape[0]
    assert free.input_ids.shape[1] == T and grid.input_ids.shape[1] == -(-T // 100) * 100 > T
    assert (grid.segment_ids[0, T:] == PAD_SEGMENT).all() and not grid.loss_mask[0, T:].any()
    obj = _objective(tiny_cfg, draft_verifier_dir, steps=3)
    results = []
    for batch in (free, grid):
        obj.zero_grad()
        out = obj(batch)
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in obj.named_parameters() if p.requires_grad}))
    (a, ga), (b, gb) = results
    assert a.stats.count.tolist() == b.stats.count.tolist() and a.stats.count[0] > 10
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-6)
    assert a.stats.correct.tolist() == b.stats.correct.tolist()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-7)


# ---- recompute per TTT step ---------------------------------------------------------------------
def test_recompute_gives_the_loss_and_gradients_of_keeping_the_activations(
        tiny_cfg: DraftConfig, draft_verifier_dir: Path, train_store: Path) -> None:
    """recompute (each TTT step under torch.utils.checkpoint): the same loss, stats and gradients,
    with every step's layer forward run once more by the backward."""
    reader = StoreReader(train_store)
    samples = [reader.read_sample(ref, torch.float32) for ref in reader.samples()[:3]]
    parts = [(s.input_ids, s.loss_mask, s.aux, s.final) for s in samples]
    batch = collate_rows([pack_row(parts[:2], 4096), pack_row(parts[2:], 4096)])
    results, calls = [], []
    for recompute in (False, True):
        obj = _objective(tiny_cfg, draft_verifier_dir, steps=4)
        obj.cfg = dataclasses.replace(obj.cfg, recompute=recompute)
        forwards = []
        hook = obj.draft.midlayer.register_forward_hook(lambda *_: forwards.append(1))
        out = obj(batch)
        in_forward = len(forwards)
        out.loss.backward()
        hook.remove()
        calls.append((in_forward, len(forwards)))
        results.append((out, {n: p.grad for n, p in obj.named_parameters() if p.requires_grad}))
    assert calls == [(4, 4), (4, 8)]
    assert_same_objective_runs(results, loss_tol=1e-6, grad_rtol=1e-5, grad_atol=1e-7)


def test_train_config_passes_recompute() -> None:
    from config import compose_config
    from train.loop import _objective_config

    assert _objective_config(compose_config("train")).recompute is False
    assert _objective_config(compose_config("train", ["verifier=kimi_k3", "draft=kimi_k3"])).recompute is True
    assert _objective_config(compose_config("train", ["train.recompute=true"])).recompute is True


def test_a_trained_head_gets_its_own_lr_group(tiny_cfg: DraftConfig, draft_verifier_dir: Path) -> None:
    from train.deepspeed_setup import param_groups

    trained = _objective(dataclasses.replace(tiny_cfg, train_head=True), draft_verifier_dir)
    head = trained.draft.lm_head.weight
    n_trainable = sum(p.requires_grad for p in trained.parameters())
    rest, own = param_groups(trained, 2e-3, 0.1)
    assert own["params"][0] is head and len(own["params"]) == 1 and own["lr"] == pytest.approx(2e-4)
    assert "lr" not in rest and len(rest["params"]) == n_trainable - 1 and all(p is not head for p in rest["params"])
    assert [len(g["params"]) for g in param_groups(trained, 2e-3, 1.0)] == [n_trainable]   # scale 1: one group
    frozen = _objective(dataclasses.replace(tiny_cfg, train_head=False), draft_verifier_dir)
    assert [len(g["params"]) for g in param_groups(frozen, 2e-3, 0.1)] == [sum(p.requires_grad for p in frozen.parameters())]
