"""Tests of train/batches.py (split, the row stream, reading rows) and of model/batch.py's packing
of the rows it reads (the store check: tests/test_compatibility.py)."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from data.split import sharegpt_split_key
from config import compose_config
from model.batch import PAD_SEGMENT, RowSample, collate_rows, last_turn_mask, pack_row
from store import StoreReader
from train.batches import PackedRows, RowStream, StoreSplit, held_out_rule, pack_next_fit, rank_rows, split_samples


# ---- packing and order --------------------------------------------------------------------------
def test_next_fit_packing_keeps_order_and_length() -> None:
    lengths = [5, 3, 4, 9, 12, 1, 1]
    rows = pack_next_fit(lengths, 10)
    assert rows == [[0, 1], [2], [3], [4], [5, 6]]            # 12 > 10: a row of its own, cut to 10
    assert all(sum(min(lengths[i], 10) for i in row) <= 10 for row in rows)


def test_row_stream_is_seeded_and_covers_each_sample_once_per_epoch() -> None:
    lengths = [7, 3, 5, 2, 8, 6, 4, 1, 9, 2]
    a, b, c = RowStream(lengths, 12, seed=0), RowStream(lengths, 12, seed=0), RowStream(lengths, 12, seed=1)
    first = [a.row(i) for i in range(12)]
    assert first == [b.row(i) for i in range(12)]
    assert first != [c.row(i) for i in range(12)]
    per_epoch = Counter()
    for epoch, row in first:
        per_epoch.update((epoch, s) for s in row)
    epoch0 = [s for e, row in first if e == 0 for s in row]
    assert sorted(epoch0) == list(range(len(lengths)))       # every sample once in epoch 0
    assert max(per_epoch.values()) == 1
    assert a.row(5) == first[5]                               # random access, any order


def test_two_ranks_see_the_rows_of_one_rank_with_twice_the_accumulation() -> None:
    stream = RowStream(list(range(1, 30)), 16, seed=3)
    one = rank_rows(stream, 2, 5, micro_batch=1, grad_accum=2, rank=0, world_size=1)
    r0 = rank_rows(stream, 2, 5, micro_batch=1, grad_accum=1, rank=0, world_size=2)
    r1 = rank_rows(stream, 2, 5, micro_batch=1, grad_accum=1, rank=1, world_size=2)
    for step in range(3):                                     # same rows per optimizer step
        assert sorted(map(str, one[2 * step:2 * step + 2])) == sorted(map(str, [r0[step], r1[step]]))
    resumed = rank_rows(stream, 3, 5, micro_batch=1, grad_accum=2, rank=0, world_size=1)
    assert resumed == one[2:]                                 # a resumed run continues the stream


# ---- split ----------------------------------------------------------------------------------------
def test_heldout_split_is_stable_and_keeps_conversations_together(train_store: Path) -> None:
    reader = StoreReader(train_store)
    split = StoreSplit.open(train_store, 0.3, 1)
    assert split.heldout and split.train
    assert {r.sample_id for r in split.train}.isdisjoint(r.sample_id for r in split.heldout)
    assert len(split.train) + len(split.heldout) == len(reader)
    again = split_samples(list(reversed(reader.samples())), held_out_rule(reader, 0.3, 1))
    assert {r.sample_id for r in again[1]} == {r.sample_id for r in split.heldout}
    held_conversations = {sharegpt_split_key(r.sample_id) for r in split.heldout}
    assert not any(sharegpt_split_key(r.sample_id) in held_conversations for r in split.train)


def test_a_store_trains_on_the_same_data_as_itself(train_store: Path) -> None:
    """bench/training_data_diff.py, which says whether a change to the held-out set moved a training
    sample: a store against itself matches sample for sample."""
    from bench.training_data_diff import training_data_diff

    report = training_data_diff(train_store, train_store, 0.3, 1)
    n = report["train_samples"][0]
    assert n > 0 and report["train_identical"] == report["train_shared"] == n and report["train_same_order"]
    assert report["heldout_shared"] == report["heldout_samples"][0] > 0


def test_a_train_fraction_is_a_nested_subset_and_keeps_the_heldout(train_store: Path) -> None:
    split = StoreSplit.open(train_store, 0.3, 1)
    half, quarter = split.with_train_fraction(0.5), split.with_train_fraction(0.25)
    ids = lambda s: {r.sample_id for r in s.train}                      # noqa: E731
    assert len(half.train) == -(-len(split.train) // 2) and 0 < len(quarter.train) <= len(half.train)
    assert ids(quarter) <= ids(half) <= ids(split)
    assert half.heldout == split.heldout and split.with_train_fraction(1.0) is split
    with pytest.raises(ValueError, match="train_fraction"):
        split.with_train_fraction(0.0)


# ---- reading rows ---------------------------------------------------------------------------------
def test_packed_rows_hold_the_samples_with_restarting_positions(train_store: Path) -> None:
    reader = StoreReader(train_store)
    refs = reader.samples()
    rows = PackedRows(train_store, refs, [[0, 1, 2], [3]], max_len=4096)
    row = rows[0]
    expected = [reader.read_sample(refs[i]) for i in (0, 1, 2)]
    assert torch.equal(row.input_ids, torch.cat([s.input_ids for s in expected]))
    assert torch.equal(row.loss_mask, torch.cat([s.loss_mask for s in expected]))
    assert torch.equal(row.aux, torch.cat([s.aux.flatten(1) for s in expected]))
    assert torch.equal(row.final, torch.cat([s.final for s in expected]))
    lengths = [len(s.input_ids) for s in expected]
    assert row.position_ids.tolist() == [p for n in lengths for p in range(n)]
    assert row.segment_ids.tolist() == [i for i, n in enumerate(lengths) for _ in range(n)]
    batch = collate_rows([row, rows[1]])
    L = sum(lengths)
    n1 = len(rows[1].input_ids)
    assert batch.input_ids.shape == (2, L) and batch.aux.shape == (2, L, 3 * reader.hidden_size)
    assert (batch.segment_ids[1, n1:] == PAD_SEGMENT).all() and not batch.loss_mask[1, n1:].any()
    cut = PackedRows(train_store, refs, [[0]], max_len=16)[0]
    assert len(cut.input_ids) == 16                      # a long sample is cut to max_len


def test_a_batch_holds_one_kind_of_targets_and_pads_inertly() -> None:
    H, n = 2, 3
    def sample(T: int, topk: bool = False) -> RowSample:
        targets = (torch.zeros(T, 4, dtype=torch.long), torch.zeros(T, 4)) if topk else torch.ones(T, H)
        return RowSample(torch.arange(1, T + 1), torch.ones(T, dtype=torch.bool), torch.ones(T, n, H), targets)
    batch = collate_rows([pack_row([sample(5), sample(2)], 8), pack_row([sample(3)], 8)], multiple=4)
    assert not batch.topk and batch.input_ids.shape == (2, 8) and batch.final.shape == (2, 8, H)
    assert int(batch.tokens()) == 10 and batch.real.sum(1).tolist() == [7, 3]
    pad = ~batch.real
    assert not batch.loss_mask[pad].any() and not batch.input_ids[pad].any() and not batch.aux[pad].any()
    assert not batch.final[pad].any() and not batch.position_ids[pad].any()
    moved = batch.map(lambda t: t[:1])
    assert moved.tensors().keys() == batch.tensors().keys() and moved.segment_ids.shape == (1, 8)
    with pytest.raises(ValueError, match="either final states or both top-k"):
        dataclasses.replace(batch, target_ids=batch.input_ids[..., None])
    with pytest.raises(ValueError, match="mixes"):
        collate_rows([pack_row([sample(3)], 8), pack_row([sample(3, topk=True)], 8)])


def _mask(bits: str) -> torch.Tensor:
    return torch.tensor([b == "1" for b in bits])


@pytest.mark.parametrize("bits,last", [
    ("0011100110", "0000000110"),    # two turns: the second stays
    ("0110001111", "0000001111"),    # the last turn runs to the end of the sample
    ("1110000000", "1110000000"),    # one turn from the first token
    ("0000000000", "0000000000"),    # no assistant token
])
def test_last_turn_mask_keeps_the_last_run(bits: str, last: str) -> None:
    assert torch.equal(last_turn_mask(_mask(bits)), _mask(last))


def test_last_turn_only_rows_count_the_last_turn_of_each_whole_sample() -> None:
    H, n = 2, 3
    def sample(bits: str) -> RowSample:
        T = len(bits)
        return RowSample(torch.arange(T), _mask(bits), torch.zeros(T, n, H), torch.zeros(T, H))
    samples = [sample("0110011100"), sample("0111000011")]
    full = pack_row(samples, max_len=20)
    assert full.loss_mask.tolist() == _mask("0110011100" "0111000011").tolist()
    last = pack_row(samples, max_len=20, last_turn_only=True).loss_mask
    assert last.tolist() == _mask("0000011100" "0000000011").tolist()
    # Cut to 6 tokens: the first sample keeps the start of its last turn; the second loses its
    # last turn, and an earlier turn does not take its place.
    assert pack_row(samples[:1], max_len=6, last_turn_only=True).loss_mask.tolist() == \
        _mask("000001").tolist()
    assert not pack_row(samples[1:], max_len=6, last_turn_only=True).loss_mask.any()


def test_packed_rows_apply_last_turn_only(train_store: Path) -> None:
    reader = StoreReader(train_store)
    refs = reader.samples()
    turns = [int((m[1:] & ~m[:-1]).sum() + m[0]) for m in (reader.read_tokens(r)[1] for r in refs)]
    multi = [i for i, t in enumerate(turns) if t > 1]
    assert multi, "the test store has no multi-turn sample"
    i = multi[0]
    row = PackedRows(train_store, refs, [[i]], max_len=4096, last_turn_only=True)[0]
    stored = reader.read_tokens(refs[i])[1]
    assert torch.equal(row.loss_mask, last_turn_mask(stored))
    assert 0 < int(row.loss_mask.sum()) < int(stored.sum())
    plain = PackedRows(train_store, refs, [[i]], max_len=4096)[0]
    assert torch.equal(plain.loss_mask, stored)


def test_loader_workers_read_the_same_batches(train_store: Path) -> None:
    from train.batches import make_loader

    refs = StoreReader(train_store).samples()
    rows = PackedRows(train_store, refs, [[i] for i in range(6)], max_len=4096)
    inline = list(make_loader(rows, 2, 0, 2))
    workers = list(make_loader(rows, 2, 2, 2))
    assert len(inline) == len(workers) == 3
    for a, b in zip(inline, workers):
        assert a.tensors().keys() == b.tensors().keys()
        assert all(torch.equal(t, getattr(b, k)) for k, t in a.tensors().items())


def test_row_length_and_lr_follow_the_verifier_recipe() -> None:
    """Kimi configs train at lr 2e-5 (the published drafts); kimi-tiny's rows are shorter."""
    from train.deepspeed_setup import warmup_steps_of

    k2 = compose_config("train", ["verifier=kimi_k2", "draft=kimi_k2"]).train
    assert (k2.max_len, k2.lr, k2.warmup_steps, k2.grad_clip) == (8192, 2e-5, 500, 0.5)
    assert warmup_steps_of(k2, 10_000) == 500 and not k2.loss.last_turn_only
    tiny = compose_config("train").train
    assert tiny.max_len < 8192 and tiny.ttt.steps == 4 and tiny.ttt.decay == 0.8
    assert not tiny.loss.last_turn_only


def test_kimi_tinys_peak_lr_falls_with_the_runs_length() -> None:
    """kimi-tiny's 3e-3 holds up to the 100 steps it was tuned at; longer runs peak at
    3e-3 x sqrt(100 / steps), in the optimizer DeepSpeed builds; Kimi's 2e-5 holds at any length."""
    from train.deepspeed_setup import deepspeed_config, peak_lr

    cfg = compose_config("train")
    t = cfg.train
    assert (t.lr, t.lr_tuned_steps) == (3e-3, 100)
    assert peak_lr(t, 50) == peak_lr(t, 100) == peak_lr(t, None) == 3e-3
    assert peak_lr(t, 300) == pytest.approx(3e-3 / math.sqrt(3))
    assert deepspeed_config(cfg, 400)["optimizer"]["params"]["lr"] == pytest.approx(1.5e-3)
    assert deepspeed_config(cfg)["optimizer"]["params"]["lr"] == 3e-3
    k2 = compose_config("train", ["verifier=kimi_k2", "draft=kimi_k2"]).train
    assert k2.lr_tuned_steps is None and peak_lr(k2, 100_000) == 2e-5
    with pytest.raises(Exception, match="lr_tuned_steps"):
        compose_config("train", ["train.lr_tuned_steps=0"])


def test_kimi_k3_recipe() -> None:
    """Rows up to 46,000 tokens, lr 2e-5, warmup 1% of the steps then cosine to 0, clip 1.0,
    loss on the last turn only."""
    from train.deepspeed_setup import deepspeed_config, lr_factor, warmup_steps_of

    cfg = compose_config("train", ["verifier=kimi_k3", "draft=kimi_k3", "verifier.path=/x"])
    t = cfg.train
    assert (t.max_len, t.lr, t.min_lr_ratio, t.grad_clip) == (46000, 2e-5, 0.0, 1.0)
    assert t.warmup_steps is None and t.warmup_ratio == 0.01 and t.loss.last_turn_only
    assert t.ttt.steps == 4
    assert (warmup_steps_of(t, 10_000), warmup_steps_of(t, 150)) == (100, 2)   # rounded up
    assert deepspeed_config(cfg)["gradient_clipping"] == 1.0
    factor = lr_factor(warmup_steps_of(t, 1000), 1000, t.min_lr_ratio)
    assert factor(9) == 1.0 and factor(999) == 0.0


def test_warmup_is_steps_or_ratio_not_both() -> None:
    from omegaconf import OmegaConf

    from train.deepspeed_setup import warmup_steps_of

    for both in ({"warmup_steps": 5, "warmup_ratio": 0.1}, {"warmup_steps": None, "warmup_ratio": None}):
        with pytest.raises(ValueError, match="exactly one"):
            warmup_steps_of(OmegaConf.create(both), 100)
    with pytest.raises(ValueError, match="fraction"):
        warmup_steps_of(OmegaConf.create({"warmup_steps": None, "warmup_ratio": 1.5}), 100)
