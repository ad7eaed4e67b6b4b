"""Tests of model/draft.py, model/vocab.py and model/verifier_weights.py."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

import model.verifier_weights as vw
from config import compose_config, compose_draft_conf
from model.checkpoint import export_size_bytes
from model.draft import DraftConfig, Eagle3Draft, build_draft, exported_parameter_count
from model.verifier_handle import Verifier
from model.vocab import build_draft_vocab, count_tokens, draft_to_target, t2d_from_d2t, target_to_draft


@pytest.fixture(scope="module")
def tiny_cfg(draft_verifier_dir: Path) -> DraftConfig:
    return DraftConfig.from_conf(compose_draft_conf("kimi_tiny"), Verifier.open(draft_verifier_dir))


@pytest.fixture(scope="module")
def tiny_draft(tiny_cfg: DraftConfig, draft_verifier_dir: Path) -> Eagle3Draft:
    torch.manual_seed(0)
    draft = build_draft(tiny_cfg)
    draft.load_verifier_head(Verifier.open(draft_verifier_dir))
    return draft


# ---- configs ------------------------------------------------------------------------------
def test_tiny_draft_config_follows_the_verifier_yaml(tiny_cfg: DraftConfig, kimi_tiny_cfg) -> None:
    arch = kimi_tiny_cfg.architecture
    assert tiny_cfg.hidden_size == tiny_cfg.target_hidden_size == arch.hidden_size
    assert tiny_cfg.rope_parameters == OmegaConf.to_container(arch.rope_parameters)
    assert tiny_cfg.aux_layer_ids == tuple(kimi_tiny_cfg.aux_layer_ids)
    assert tiny_cfg.draft_vocab_size == tiny_cfg.vocab_size == 8192 and not tiny_cfg.pruned
    assert tiny_cfg.bos_token_id is not None and tiny_cfg.eos_token_id is not None


def test_draft_group_composes_with_hydra() -> None:
    cfg = compose_config("train")
    assert DraftConfig.from_conf(cfg.draft).hidden_size == cfg.verifier.architecture.hidden_size
    k2 = DraftConfig.from_conf(compose_config("train", ["verifier=kimi_k2", "draft=kimi_k2"]).draft)
    assert k2.hidden_size == 7168


def test_sglang_aux_ids_in_a_verifier_yaml_become_vllm_ids() -> None:
    cfg = compose_config("train", ["draft=kimi_tiny", "verifier=kimi_tiny", "verifier.aux_layer_ids=[1,3,4]",
                                   "verifier.aux_convention=sglang"])
    assert DraftConfig.from_conf(cfg.draft).aux_layer_ids == (2, 4, 5)


def test_kimi_k3_draft_builds_on_meta_device() -> None:
    """conf/draft/kimi_k3 composes with no missing value; the draft is the published K3 shape."""
    cfg = DraftConfig.from_conf(compose_draft_conf("kimi_k3"))
    draft = build_draft(cfg, device="meta")
    shapes = {n: tuple(p.shape) for n, p in draft.named_parameters()}
    assert shapes["fc.weight"] == (7168, 3 * 7168)
    assert shapes["midlayer.self_attn.q_b_proj.weight"] == (64 * 192, 1536)
    assert cfg.aux_layer_ids == (2, 46, 90) and cfg.target_num_hidden_layers == 93


def test_kimi_k2_draft_shapes_on_meta_device(capsys) -> None:
    """The published Kimi-K2 MLA draft shapes; the parameter count and bf16 export size are reported."""
    cfg = DraftConfig.from_conf(compose_draft_conf("kimi_k2"))
    draft = build_draft(cfg, device="meta")
    shapes = {n: tuple(p.shape) for n, p in draft.named_parameters()}
    attn = "midlayer.self_attn."
    assert shapes["fc.weight"] == (7168, 3 * 7168)
    assert shapes[attn + "q_a_proj.weight"] == (1536, 14336)
    assert shapes[attn + "q_b_proj.weight"] == (12288, 1536)          # 64 heads x 192
    assert shapes[attn + "kv_a_proj_with_mqa.weight"] == (576, 14336)
    assert shapes[attn + "kv_b_proj.weight"] == (16384, 512)
    assert shapes[attn + "o_proj.weight"] == (7168, 8192)
    assert shapes["midlayer.mlp.gate_proj.weight"] == (18432, 7168)
    assert shapes["lm_head.weight"] == (163840, 7168)
    assert cfg.rope_parameters["factor"] == 64.0 and cfg.rope_interleave
    params, size = exported_parameter_count(draft), export_size_bytes(draft, torch.bfloat16)
    assert size == 2 * params                                           # full vocabulary: no d2t
    assert 3.6e9 < size < 3.8e9                                         # the published K2.7 draft: ~3.7 GB
    with capsys.disabled():
        print(f"\nkimi_k2 draft: {params:,} parameters, bf16 export {size:,} bytes ({size / 1e9:.3f} GB)")


# ---- frozen parts -------------------------------------------------------------------------
def test_embedding_is_frozen_and_not_in_state_dict(tiny_draft: Eagle3Draft, draft_verifier_dir: Path) -> None:
    head = vw.read_verifier_head(draft_verifier_dir)
    assert torch.equal(tiny_draft.embed_tokens, head.embed_tokens.float())
    assert torch.equal(tiny_draft.lm_head.weight, head.lm_head.float())     # a trained head starts as the verifier's
    assert torch.equal(tiny_draft.norm.weight, head.norm.float())
    assert "embed_tokens" not in " ".join(tiny_draft.state_dict())
    trainable = {n for n, p in tiny_draft.named_parameters() if p.requires_grad}
    train_head = tiny_draft.config.train_head
    assert ("lm_head.weight" in trainable) == train_head                   # draft.train_head
    assert ("norm.weight" in trainable) == (train_head or tiny_draft.config.train_norm)
    assert tiny_draft.shares_verifier_head == (not train_head)
    assert "fc.weight" in trainable and "midlayer.self_attn.kv_b_proj.weight" in trainable


def test_pruned_lm_head_takes_the_verifier_rows(tiny_cfg: DraftConfig, draft_verifier_dir: Path) -> None:
    cfg = dataclasses.replace(tiny_cfg, draft_vocab_size=512)
    draft = build_draft(cfg)
    d2t, _ = build_draft_vocab(torch.randint(0, 100, (cfg.vocab_size,)), 512)
    draft.set_vocab(d2t)
    draft.load_verifier_head(Verifier.open(draft_verifier_dir))
    target_ids = torch.arange(512) + d2t
    assert torch.equal(draft.lm_head.weight, vw.read_verifier_head(draft_verifier_dir).lm_head.float()[target_ids])
    assert torch.equal(draft.t2d, t2d_from_d2t(d2t, cfg.vocab_size))


# ---- forward ------------------------------------------------------------------------------
def _inputs(cfg: DraftConfig, B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(B, T, cfg.num_aux * cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (B, T + 3), generator=g)
    return aux, ids


def _ttt(draft: Eagle3Draft, aux, ids, positions, segment_ids=None, steps: int = 3):
    """The TTT chain: ids shift left by one per step, positions advance by one."""
    hidden, cache, outs = draft.project_aux(aux), None, []
    T = aux.shape[1]
    for k in range(steps):
        out = draft.step(ids[:, k:k + T], hidden, positions + k, cache, segment_ids)
        hidden, cache = out.hidden, out.cache
        outs.append(out)
    return outs


def test_ttt_kernels_agree_through_the_draft(tiny_cfg: DraftConfig, tiny_draft: Eagle3Draft) -> None:
    ref = Eagle3Draft(dataclasses.replace(tiny_cfg, attention="reference"))
    ref.load_state_dict(tiny_draft.state_dict())
    ref.embed_tokens.copy_(tiny_draft.embed_tokens)
    aux, ids = _inputs(tiny_cfg, 2, 12)
    pos = torch.arange(12).expand(2, 12)
    losses = []
    for draft in (tiny_draft, ref):
        draft.zero_grad()
        outs = _ttt(draft, aux, ids, pos)
        loss = sum(o.logits.logsumexp(-1).mean() * 0.8 ** k for k, o in enumerate(outs))
        loss.backward()
        losses.append((outs, {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}))
    for a, b in zip(losses[0][0], losses[1][0]):
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-4)
    for name, grad in losses[0][1].items():
        torch.testing.assert_close(grad, losses[1][1][name], rtol=1e-4, atol=1e-6)


def test_packed_rows_equal_separate_samples(tiny_cfg: DraftConfig, tiny_draft: Eagle3Draft) -> None:
    lengths = [6, 9]
    aux, ids = _inputs(tiny_cfg, 1, sum(lengths), seed=1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = _ttt(tiny_draft, aux, ids, pos, seg)
        start = 0
        for n in lengths:
            alone = _ttt(tiny_draft, aux[:, start:start + n], ids[:, start:start + n + 3], torch.arange(n)[None])
            for k in range(3):
                # Step k at the last k positions reads ids of the next sample in the packed row;
                # those positions are loss-masked by the trainer, so compare the rest.
                keep = n - k
                torch.testing.assert_close(packed[k].logits[:, start:start + keep], alone[k].logits[:, :keep],
                                           rtol=0, atol=1e-4)
            start += n


def test_a_step_does_not_see_later_positions(tiny_cfg: DraftConfig, tiny_draft: Eagle3Draft) -> None:
    aux, ids = _inputs(tiny_cfg, 1, 10, seed=2)
    pos = torch.arange(10)[None]
    aux2, ids2 = aux.clone(), ids.clone()
    aux2[:, 6:] += 1.0
    ids2[:, 9:] = (ids2[:, 9:] + 1) % tiny_cfg.vocab_size
    with torch.no_grad():
        a, b = _ttt(tiny_draft, aux, ids, pos), _ttt(tiny_draft, aux2, ids2, pos)
    for k in range(3):
        # Step k at position t reads ids[t + k]; ids changed from 9 on, aux from 6 on.
        last = min(6, 9 - k)
        torch.testing.assert_close(a[k].logits[:, :last], b[k].logits[:, :last], rtol=0, atol=1e-6)


# ---- vocabulary ---------------------------------------------------------------------------
def test_build_draft_vocab_keeps_the_most_frequent_in_ascending_order() -> None:
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 2])
    d2t, t2d = build_draft_vocab(counts, 4)
    kept = torch.arange(4) + d2t
    assert kept.tolist() == [0, 2, 3, 5]                         # 9, 9, 7, 5
    assert t2d.tolist() == [True, False, True, True, False, True, False, False]
    d2t, _ = build_draft_vocab(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 5]
    d2t, _ = build_draft_vocab(torch.zeros(8, dtype=torch.long), 2)
    assert (torch.arange(2) + d2t).tolist() == [0, 1]           # ties: lower id first
    d2t, _ = build_draft_vocab(counts, 3, always_include=[6])
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 6]
    assert d2t.dtype == torch.int64


def test_vocab_maps_both_ways() -> None:
    counts = torch.randint(0, 50, (100,), generator=torch.Generator().manual_seed(0))
    d2t, t2d = build_draft_vocab(counts, 30)
    target = draft_to_target(torch.arange(30), d2t)
    assert t2d[target].all() and int(t2d.sum()) == 30
    assert torch.equal(target_to_draft(target, t2d), torch.arange(30))
    assert (target_to_draft(torch.nonzero(~t2d).flatten(), t2d) == -1).all()


def test_count_tokens_counts_only_loss_masked_tokens() -> None:
    ids = torch.tensor([[1, 2, 2, 3], [3, 3, 0, 1]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1]])
    assert count_tokens(ids, mask, 5).tolist() == [0, 1, 2, 1, 0]


# ---- verifier weights ---------------------------------------------------------------------
def test_verifier_head_reads_only_its_three_tensors_from_shards(tmp_path: Path, monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    shard1 = {"model.embed_tokens.weight": torch.randn(10, 4, generator=g),
              "model.layers.0.mlp.down_proj.weight": torch.randn(4, 4, generator=g)}
    shard2 = {"model.norm.weight": torch.randn(4, generator=g), "lm_head.weight": torch.randn(10, 4, generator=g),
              "model.layers.1.mlp.down_proj.weight": torch.randn(4, 4, generator=g)}
    save_file(shard1, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(shard2, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in shard1} | \
                 {n: "model-00002-of-00002.safetensors" for n in shard2}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    read: list[str] = []
    real_map = vw.map_file

    class Recording(dict):
        def __getitem__(self, name):
            read.append(name)
            return super().__getitem__(name)

    monkeypatch.setattr(vw, "map_file", lambda file: Recording(real_map(file)))
    head = vw.read_verifier_head(tmp_path)
    assert sorted(read) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert torch.equal(head.embed_tokens, shard1["model.embed_tokens.weight"])
    assert torch.equal(head.lm_head, shard2["lm_head.weight"])
    assert torch.equal(head.norm, shard2["model.norm.weight"])
    # Views of the files' pages, not copies: the storage is the whole mapped file.
    assert head.lm_head.untyped_storage().nbytes() == (tmp_path / "model-00002-of-00002.safetensors").stat().st_size
