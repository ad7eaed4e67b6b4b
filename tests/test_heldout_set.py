"""The held-out set that tells drafts apart (data/heldout_set.py), the standard error of a difference
clustered by conversation (evaluation/paired.py), and the two training levers on the draft's
inputs: the draft layer started from the verifier's (model/verifier_init.py) and noise on the aux
states (train/objective.py noisy_aux)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from config import compose_config
from data.heldout_set import HeldoutSet, dump_conversations, dump_heldout
from data.conversations import load_conversations
from data.split import held_out_by, sharegpt_split_key
from evaluation.paired import HeldoutSums, paired_difference
from model.draft import DraftConfig, build_draft
from model.verifier_init import init_from_verifier_layer, last_dense_layer
from model.verifier_weights import read_tensors
from train.objective import noisy_aux


def _sharegpt(path: Path, conversations: int, parts: int) -> Path:
    """`conversations` ShareGPT conversations of `parts` parts each, "c<i>_<j>", code-like (a
    "python" first turn) for even i."""
    records = []
    for i in range(conversations):
        for j in range(parts):
            topic = "python" if i % 2 == 0 else "gardening"
            records.append({"id": f"c{i}_{j}", "conversations": [
                {"from": "human", "value": f"about {topic}, part {j}"}, {"from": "gpt", "value": f"answer {i} {j}"}]})
    path.write_text(json.dumps(records))
    return path


def _data(path: Path, max_samples: int | None, select: dict | None = None) -> dict:
    data = dict(compose_config("dump", ["data=sharegpt"]).data)
    data.update(path=str(path), max_samples=max_samples, select=select, heldout_fraction=0.0)
    return data


def test_held_out_conversations_give_one_part_each_and_the_set_reads_on(tmp_path: Path) -> None:
    data = _data(_sharegpt(tmp_path / "d.json", 400, 3), 120)
    rule = held_out_by(0.1, 1, "sharegpt")
    own = list(load_conversations(data, "train"))
    own_keys = {sharegpt_split_key(c.id) for c in own}
    small, large = HeldoutSet(30, 64, 32), HeldoutSet(60, 64, 32)
    out = list(dump_conversations(data, "train", rule, small))
    held = dump_heldout(data, "train", rule, small)
    train = [c.id for c in out if not held(c.id)]
    assert train == [c.id for c in own if not rule(c.id)]           # the training data is the data's own
    heldout = [c.id for c in out if held(c.id)]
    keys = [sharegpt_split_key(i) for i in heldout]
    assert len(keys) == len(set(keys)) == 30                        # one part per conversation, 30 of them
    within = {sharegpt_split_key(c.id) for c in own if rule(c.id)}
    assert within and within <= set(keys) and len(within) < 30      # those within max_samples come first
    read_on = [i for i in heldout if sharegpt_split_key(i) not in within]
    assert all(i.endswith("_0") for i in read_on)                   # first parts
    assert not {sharegpt_split_key(i) for i in read_on} & own_keys  # of conversations the data's read missed
    assert any(not rule(i) for i in read_on)                        # held out by the dump, not the rule
    assert held(read_on[0] + "~sampled")                            # a copy splits with its conversation

    bigger = list(dump_conversations(data, "train", rule, large))
    held_more = dump_heldout(data, "train", rule, large)
    assert [c.id for c in bigger if not held_more(c.id)] == train   # a larger set trains on the same data
    assert set(heldout) < {c.id for c in bigger if held_more(c.id)}
    again = list(dump_conversations(data, "train", rule, small))
    assert [c.id for c in again] == [c.id for c in out]            # a fixed order: resumable


def test_a_sampled_copy_splits_and_shards_with_the_sample_it_copies() -> None:
    """The dump's sampled copies (regenerate.sampled_share) share their conversation's side of the
    trainer's split and its dump rank, for every data format."""
    from data.split import sampled_copy_id
    from store.writer import rank_of

    for fmt in ("sharegpt", "jsonl", None):
        held = held_out_by(0.3, 2, fmt)
        for sample_id in [f"conv{i}_{i % 3}" for i in range(200)] + [f"conv{i}" for i in range(200)]:
            copy = sampled_copy_id(sample_id)
            assert copy != sample_id and held(copy) == held(sample_id)
            assert rank_of(copy, 5) == rank_of(sample_id, 5)
    assert sharegpt_split_key(sampled_copy_id("QWJhYvA_3")) == "QWJhYvA"


def test_the_extra_held_out_conversations_keep_the_select_share(tmp_path: Path) -> None:
    data = _data(_sharegpt(tmp_path / "d.json", 600, 1), 60, {"pattern": "python", "share": 0.25})
    rule = held_out_by(0.2, 3, "sharegpt")
    wanted = HeldoutSet(conversations=40, max_tokens=64, answer_tokens=32)
    out = list(dump_conversations(data, "train", rule, wanted))
    held = dump_heldout(data, "train", rule, wanted)
    within = sum(rule(c.id) for c in load_conversations(data, "train"))
    extra = out[60:]
    assert len(extra) == 40 - within and all(held(c.id) for c in extra)
    code = sum("python" in c.messages[0].content for c in extra)
    assert code == round(0.25 * len(extra))


def test_no_read_on_without_a_cap_or_when_the_set_is_full(tmp_path: Path) -> None:
    path = _sharegpt(tmp_path / "d.json", 50, 2)
    held = held_out_by(0.3, 1, "sharegpt")
    everything = list(dump_conversations(_data(path, None), "train", held, HeldoutSet(200, 64, 32)))
    assert len({sharegpt_split_key(c.id) for c in everything}) == 50
    capped = list(dump_conversations(_data(path, 20), "train", held, HeldoutSet(0, 64, 32)))
    assert len(capped) <= 20
    with pytest.raises(ValueError, match="heldout_set.max_tokens"):
        HeldoutSet(4, 0, 32)
    with pytest.raises(ValueError, match="heldout_set.answer_tokens"):
        HeldoutSet(4, 64, 0)


def _sums(path: Path, step: int, samples: dict[str, tuple[float, float]]) -> HeldoutSums:
    path.write_text(json.dumps({"step": step, "samples": {
        s: {"positions": n, "chain_sum": c, "correct": [], "count": []} for s, (n, c) in samples.items()}}))
    return HeldoutSums.read(path)


def test_paired_difference_clusters_by_conversation(tmp_path: Path) -> None:
    a = _sums(tmp_path / "a.json", 100, {"x_0": (10, 12), "x_1": (10, 8), "y": (20, 30), "z": (40, 20)})
    b = _sums(tmp_path / "b.json", 100, {"x_0": (10, 10), "x_1": (10, 6), "y": (20, 26), "z": (40, 24)})
    d = paired_difference(a, b)
    # Conversations x (parts x_0, x_1: 20 positions, +4), y (20, +4), z (40, -4): D = 4 / 80.
    assert d.conversations == 3 and d.positions == 80 and d.largest_share == 0.5
    assert d.diff == pytest.approx(4 / 80) and d.a - d.b == pytest.approx(d.diff)
    spread = (4 - 0.05 * 20) ** 2 + (4 - 0.05 * 20) ** 2 + (-4 - 0.05 * 40) ** 2
    assert d.se_clustered == pytest.approx(math.sqrt(3 / 2 * spread) / 80)
    other = _sums(tmp_path / "c.json", 100, {"x_0": (10, 10), "y": (20, 26)})
    with pytest.raises(ValueError, match="different held-out samples"):
        paired_difference(a, other)


def test_two_held_out_sets_compare_on_the_samples_they_share(tmp_path: Path) -> None:
    # b's set is a part of a's, and y was scored on other positions (an answer decoded again).
    a = _sums(tmp_path / "a.json", 100, {"x_0": (10, 12), "y": (20, 30), "z": (40, 20), "w": (5, 1)})
    b = _sums(tmp_path / "b.json", 100, {"x_0": (10, 10), "y": (21, 26), "z": (40, 24)})
    a_shared, b_shared = a.shared_with(b)
    assert a_shared.positions == b_shared.positions == {"x_0": 10, "z": 40}
    assert paired_difference(a_shared, b_shared).diff == pytest.approx((2 - 4) / 50)
    with pytest.raises(ValueError, match="share no held-out sample"):
        a.shared_with(_sums(tmp_path / "c.json", 100, {"v": (3, 1)}))


def test_the_draft_layer_starts_from_the_verifiers(kimi_tiny_dir: Path) -> None:
    cfg = compose_config("train")
    draft = build_draft(DraftConfig.from_conf(cfg.draft))
    before = draft.midlayer.self_attn.q_a_proj.weight.clone()
    init_from_verifier_layer(draft, kimi_tiny_dir, 7)
    H = cfg.draft.hidden_size
    dense = last_dense_layer(kimi_tiny_dir)
    theirs = read_tensors(kimi_tiny_dir, ["model.layers.7.self_attn.q_a_proj.weight",
                                          "model.layers.7.self_attn.o_proj.weight",
                                          "model.layers.7.input_layernorm.weight",
                                          f"model.layers.{dense}.mlp.down_proj.weight"])
    attn = draft.midlayer.self_attn
    assert dense == 0
    assert torch.equal(attn.q_a_proj.weight[:, H:], theirs["model.layers.7.self_attn.q_a_proj.weight"].float())
    assert torch.equal(attn.q_a_proj.weight[:, :H], before[:, :H])           # the embedding half: its own
    assert torch.equal(attn.o_proj.weight, theirs["model.layers.7.self_attn.o_proj.weight"].float())
    assert torch.equal(draft.midlayer.hidden_norm.weight, theirs["model.layers.7.input_layernorm.weight"].float())
    assert torch.equal(draft.midlayer.mlp.down_proj.weight, theirs["model.layers.0.mlp.down_proj.weight"].float())
    deepest = max(range(3), key=lambda i: cfg.draft.aux_layer_ids[i])
    fc = draft.fc.weight
    assert torch.equal(fc[:, deepest * H:(deepest + 1) * H], torch.eye(H)) and fc.abs().sum() == H
    with pytest.raises(ValueError, match="layers 0..7"):
        init_from_verifier_layer(draft, kimi_tiny_dir, 8)


def test_aux_noise_scales_with_each_states_rms() -> None:
    g = torch.Generator().manual_seed(0)
    aux = torch.cat([torch.randn(2, 500, 64, generator=g) * s for s in (1.0, 10.0, 100.0)], dim=-1)
    torch.manual_seed(1)
    noise = (noisy_aux(aux, 3, 0.05) - aux).unflatten(-1, (3, 64))
    states = aux.unflatten(-1, (3, 64))
    ratio = noise.pow(2).mean((0, 1, 3)).sqrt() / states.pow(2).mean((0, 1, 3)).sqrt()
    torch.testing.assert_close(ratio, torch.full((3,), 0.05), rtol=0.05, atol=0)
