"""Accept-length simulation on hand-built cases with known answers (evaluation/accept.py, evaluation/simulate.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from evaluation.accept import (AcceptCounts, acceptance_probability, decode_walk, expected_counts, leading_run,
                               sampling_probs)
from evaluation.simulate import Sampling, answer_spans, simulate_sample
from config import compose_draft_conf
from model.draft import DraftConfig, build_draft
from model.verifier_handle import Verifier
from store import Sample

K = 3


def walk_of(agree: torch.Tensor, prompt_len: int, last: int) -> AcceptCounts:
    return decode_walk(leading_run(agree), prompt_len - 1, last, K)


def test_leading_run_counts_drafts_until_the_first_miss() -> None:
    agree = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    assert leading_run(agree).tolist() == [3, 1, 0, 2]


def test_a_draft_that_always_agrees_reaches_the_ceiling() -> None:
    prompt, last = 10, 10 + 4 * 20           # 80 tokens after the first: 20 passes of 4 tokens
    counts = walk_of(torch.ones(last + 1, K, dtype=torch.bool), prompt, last)
    assert counts.drafts == 20
    assert counts.accept_length() == 4.0
    assert counts.per_position() == [1.0, 1.0, 1.0]


def test_a_draft_that_never_agrees_gives_one_token_per_pass() -> None:
    prompt, last = 10, 50
    counts = walk_of(torch.zeros(last + 1, K, dtype=torch.bool), prompt, last)
    assert counts.drafts == last - prompt       # one pass per token after the prefill's
    assert counts.accept_length() == 1.0


def test_only_the_first_draft_right_gives_two_tokens_per_pass() -> None:
    agree = torch.zeros(101, K, dtype=torch.bool)
    agree[:, 0] = True
    counts = walk_of(agree, 1, 100)
    assert counts.accept_length() == 2.0
    assert counts.per_position() == [1.0, 0.0, 0.0]


def test_independent_agreement_at_rate_r_gives_the_geometric_sum() -> None:
    r = 0.6
    generator = torch.Generator().manual_seed(0)
    agree = torch.rand(400_001, K, generator=generator) < r
    walk = walk_of(agree, 1, 400_000)
    expected = 1 + r + r ** 2 + r ** 3
    assert walk.accept_length() == pytest.approx(expected, rel=0.01)
    assert walk.per_position() == pytest.approx([r, r ** 2, r ** 3], rel=0.02)
    # The expectation over chains, with the rate itself as acceptance probability: exact.
    assert expected_counts(torch.full((10, K), r, dtype=torch.float64)).accept_length() == pytest.approx(expected, abs=1e-12)


def test_the_walk_stops_once_the_last_token_is_verified() -> None:
    # Text of 7 answer tokens x_3..x_9 after a 3-token prompt; drafts 0 and 1 always right.
    agree = torch.tensor([[1, 1, 0]] * 10, dtype=torch.bool)
    counts = walk_of(agree, 3, 9)
    # Passes at t = 2 (verifies x_3..x_6), t = 5 (x_6..x_9): x_9 is the last token.
    assert counts.drafts == 2
    assert counts.accepted_per_pos == [2, 2, 0]


def test_acceptance_probabilities() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    assert acceptance_probability(p, p, "probabilistic").item() == pytest.approx(1.0)
    disjoint = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    assert acceptance_probability(p, disjoint, "probabilistic").item() == 0.0
    q = torch.tensor([[0.1, 0.6, 0.2, 0.1]])
    assert acceptance_probability(p, q, "probabilistic").item() == pytest.approx(0.1 + 0.3 + 0.2)
    assert acceptance_probability(p, q, "greedy").item() == pytest.approx(0.3)    # p(argmax q)
    with pytest.raises(ValueError, match="unknown draft sampling"):
        acceptance_probability(p, q, "beam")


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert sampling_probs(logits, 1.0, 0.8).tolist()[0] == pytest.approx([0.625, 0.375, 0.0, 0.0])
    assert sampling_probs(logits, 1.0, 0.81).tolist()[0] == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert sampling_probs(logits, 1.0, 1.0).tolist()[0] == pytest.approx([0.5, 0.3, 0.15, 0.05])
    assert sampling_probs(logits, 1.0, 0.01).tolist()[0] == pytest.approx([1.0, 0, 0, 0])


def test_answer_spans() -> None:
    mask = torch.tensor([0, 0, 1, 1, 0, 1, 0, 1, 1, 1], dtype=torch.bool)
    assert answer_spans(mask) == [(2, 3), (5, 5), (7, 9)]


# ---- the simulation end to end on a real draft, with a verifier built to a known answer -----------
@pytest.fixture(scope="module")
def constant_draft(draft_verifier_dir: Path):
    """A kimi-tiny draft whose final norm is zero: its logits are all 0, so it always proposes token 0."""
    cfg = DraftConfig.from_conf(compose_draft_conf("kimi_tiny"), Verifier.open(draft_verifier_dir))
    torch.manual_seed(0)
    draft = build_draft(cfg).eval()
    draft.load_verifier_head(Verifier.open(draft_verifier_dir))
    with torch.no_grad():
        draft.norm.weight.zero_()
    return draft


def verifier_sample(constant_draft, agrees: list[bool], prompt_len: int) -> tuple[Sample, torch.Tensor]:
    """A sample whose verifier's argmax at position j is token 0 where agrees[j], else token 1."""
    cfg = constant_draft.config
    H, V, T = cfg.hidden_size, cfg.vocab_size, len(agrees)
    head = torch.zeros(V, H)
    head[0, 0] = head[1, 1] = 50.0
    final = torch.zeros(T, H)
    for j, ok in enumerate(agrees):
        final[j, 0 if ok else 1] = 1.0
    g = torch.Generator().manual_seed(1)
    sample = Sample("hand-built", torch.randint(2, V, (T,), generator=g), torch.arange(T) >= prompt_len,
                    torch.randn(T, cfg.num_aux, H, generator=g), final)
    return sample, head


@pytest.mark.parametrize("pattern, expected", [
    ("always", 4.0),
    ("never", 1.0),
])
def test_simulation_on_a_draft_that_always_or_never_agrees(constant_draft, pattern: str, expected: float) -> None:
    prompt, T = 8, 8 + 1 + 4 * 12            # 48 tokens after the first answer token: 12 full passes
    sample, head = verifier_sample(constant_draft, [pattern == "always"] * T, prompt)
    result = simulate_sample(constant_draft, head, sample, K, Sampling(1.0, 1.0, "greedy"), chunk=16)
    assert result.walk.accept_length() == pytest.approx(expected)
    assert result.walk.drafts == (12 if pattern == "always" else T - 1 - prompt)
    # Sampling at T=1: the verifier puts ~1 - 8191 e^-50 on its argmax, the draft proposes token 0.
    # The expectation covers all 48 chain positions; the last two run out of text after 2 and 1 drafts.
    chains = T - 1 - prompt
    expected_sampled = 1 + (3 * (chains - 2) + 2 + 1) / chains if pattern == "always" else 1.0
    assert result.sampled.accept_length() == pytest.approx(expected_sampled, abs=1e-6)


def test_simulation_at_a_known_agreement_pattern(constant_draft) -> None:
    """Verifier right about token 0 at positions j % 3 != 0: the chain at t proposes x_{t+2..t+4},
    whose targets are the verifier at t+1..t+3, so draft k is accepted iff (t+1+k) % 3 != 0."""
    prompt, T = 5, 60
    agrees = [j % 3 != 0 for j in range(T)]
    sample, head = verifier_sample(constant_draft, agrees, prompt)
    result = simulate_sample(constant_draft, head, sample, K, None, chunk=7)

    counts, t = AcceptCounts.zeros(K), prompt - 1
    while t + 1 < T - 1:
        a = 0
        while a < K and t + 2 + a <= T - 1 and agrees[t + 1 + a]:
            a += 1
        counts.drafts += 1
        for k in range(a):
            counts.accepted_per_pos[k] += 1
        t += a + 1
    assert result.walk.drafts == counts.drafts
    assert result.walk.accepted_per_pos == counts.accepted_per_pos
    assert 1.0 < result.walk.accept_length() < 4.0
