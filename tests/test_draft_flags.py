"""The draft's optional architecture switches fc_norm, norm_before_residual and norm_output
(model/draft.py, model/checkpoint/), as vLLM's Eagle3DeepseekV2ForCausalLM reads them from
config.json: what each computes, the export round trip, init_from, and parity with vLLM."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig
from safetensors import safe_open

from config import compose_config
from model.batch import Batch, collate_rows, pack_row
from model.chain import draft_chain
from model.checkpoint import export_draft, init_from_draft, load_draft
from model.draft import ARCHITECTURE_FLAGS, DraftConfig, Eagle3Draft, StepOutput, build_draft
from model.verifier_handle import Verifier
from model.mla import RMSNorm
from tests.test_vllm_draft import (  # noqa: F401  (tiny_cfg: a fixture, used by name)
    COMPARE_PROMPTS, compare_first_round, engine_on, make_test_draft, tiny_cfg)

FLAG_SETS = {"fc_norm": {"fc_norm": True}, "norm_before_residual": {"norm_before_residual": True},
             "norm_output": {"norm_output": True}, "all": dict.fromkeys(ARCHITECTURE_FLAGS, True)}
T = 10          # tokens of the random batches
STEPS = 3       # TTT steps of the chains


def _flagged(cfg: DraftConfig, **flags: bool) -> DraftConfig:
    return dataclasses.replace(cfg, **flags)


@torch.no_grad()
def _draft(cfg: DraftConfig, verifier_dir: Path | None = None) -> Eagle3Draft:
    """A random draft whose norms are not all ones, so that a norm taken from the wrong place shows."""
    torch.manual_seed(0)
    draft = build_draft(cfg)
    if verifier_dir is not None:
        draft.load_verifier_head(Verifier.open(verifier_dir))
    for module in draft.modules():
        if isinstance(module, RMSNorm) and module is not draft.norm:
            module.weight.copy_(1 + 0.2 * torch.randn(module.weight.shape))
    return draft


def _batch(cfg: DraftConfig, seed: int = 0) -> Batch:
    """One packed row of a random sample, as the trainer's loader builds it (aux [1, T, n_aux*H_t]),
    its aux states of unequal scale like the verifier's layers."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    scales = 0.5 * 8.0 ** torch.arange(cfg.num_aux, dtype=torch.float32)
    aux = torch.randn(T, cfg.num_aux, cfg.target_hidden_size, generator=g) * scales[:, None]
    final = torch.randn(T, cfg.hidden_size, generator=g)
    return collate_rows([pack_row([(ids, torch.ones(T, dtype=torch.bool), aux, final)], T)])


def _chain(draft: Eagle3Draft, batch: Batch) -> list[StepOutput]:
    with torch.no_grad():
        return [out for _, out, _ in draft_chain(draft, batch, STEPS)]


# ---- configuration ------------------------------------------------------------------------------
def test_the_draft_yamls_carry_the_switches_and_overrides_reach_the_draft() -> None:
    """kimi-tiny chooses its switches; the Kimi drafts leave them null (the train.init_from folder's,
    else off: model/checkpoint/init_from.py draft_config_for_run, tests/test_published_drafts.py)."""
    for name, kind in (("kimi_tiny", bool), ("kimi_k2", type(None)), ("kimi_k3", type(None))):
        draft = compose_config("train", [f"verifier={name}", f"draft={name}", "verifier.path=/x"]).draft
        assert {flag: type(draft[flag]) for flag in ARCHITECTURE_FLAGS} == dict.fromkeys(ARCHITECTURE_FLAGS, kind)
        if kind is not bool:
            assert not any(getattr(DraftConfig.from_conf(draft), flag) for flag in ARCHITECTURE_FLAGS)
    cfg = compose_config("train", [f"draft.{flag}=true" for flag in ARCHITECTURE_FLAGS])
    flags = DraftConfig.from_conf(cfg.draft)
    assert all(getattr(flags, flag) is True for flag in ARCHITECTURE_FLAGS)


# ---- what each switch computes ---------------------------------------------------------------------
@pytest.mark.parametrize("norm_output", [False, True])
def test_norm_output_feeds_the_next_step_the_normed_output(tiny_cfg: DraftConfig, norm_output: bool) -> None:
    """Through the training chain (model/chain.py, also the simulation's): step 1's hidden
    input is norm(step 0's layer output) with the switch, the output itself without."""
    draft = _draft(_flagged(tiny_cfg, norm_output=norm_output))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []     # (hidden in, layer output) per step
    hook = draft.midlayer.register_forward_hook(lambda m, args, out: seen.append((args[1], out[0])))
    try:
        outs = _chain(draft, _batch(draft.config))
    finally:
        hook.remove()
    first_out = seen[0][1]
    expected = draft.norm(first_out) if norm_output else first_out
    assert torch.equal(seen[1][0], expected)
    assert not torch.allclose(draft.norm(first_out), first_out)             # the two choices differ
    assert all(torch.equal(o.normed, draft.norm(layer_out)) for o, (_, layer_out) in zip(outs, seen))


def test_norm_before_residual_takes_the_residual_after_hidden_norm(tiny_cfg: DraftConfig) -> None:
    draft = _draft(_flagged(tiny_cfg, norm_before_residual=True))
    layer = draft.midlayer
    g = torch.Generator().manual_seed(1)
    embeds, hidden = torch.randn(2, T, tiny_cfg.hidden_size, generator=g), 5 * torch.randn(2, T, tiny_cfg.hidden_size, generator=g)
    positions = torch.arange(T).expand(2, T)
    with torch.no_grad():
        out, _ = layer(embeds, hidden, positions, None, None)
        # The reference: vLLM's DeepseekV2Eagle3DecoderLayer with norm_before_residual, written out.
        normed = layer.hidden_norm(hidden)
        attn, _ = layer.self_attn(torch.cat((layer.input_layernorm(embeds), normed), dim=-1), positions, None, None)
        residual = normed + attn
        reference = residual + layer.mlp(layer.post_attention_layernorm(residual))
        layer.norm_before_residual = False
        plain, _ = layer(embeds, hidden, positions, None, None)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    assert not torch.allclose(out, plain, atol=1e-3)


def test_fc_norm_norms_each_aux_state_by_its_own_norm(tiny_cfg: DraftConfig) -> None:
    """fc reads each H_t-wide aux chunk through its own RMSNorm: scaling one aux state by a
    constant changes nothing (RMSNorm is scale invariant), and chunk i carries fc_norm[i]'s weight."""
    draft = _draft(_flagged(tiny_cfg, fc_norm=True))
    assert draft.fc_norm is not None and len(draft.fc_norm) == tiny_cfg.num_aux
    fc_inputs: list[torch.Tensor] = []
    hook = draft.fc.register_forward_pre_hook(lambda m, args: fc_inputs.append(args[0]))
    aux = _batch(tiny_cfg).aux
    scaled = aux.clone()
    H = tiny_cfg.target_hidden_size
    scaled[..., H:2 * H] *= 37.0
    try:
        with torch.no_grad():
            draft.project_aux(aux), draft.project_aux(scaled)
    finally:
        hook.remove()
    torch.testing.assert_close(fc_inputs[1], fc_inputs[0], rtol=1e-5, atol=1e-6)
    for i, (chunk, fed) in enumerate(zip(aux.chunk(tiny_cfg.num_aux, -1), fc_inputs[0].chunk(tiny_cfg.num_aux, -1))):
        rms = chunk.pow(2).mean(-1, keepdim=True).add(tiny_cfg.rms_norm_eps).sqrt()
        torch.testing.assert_close(fed, chunk / rms * draft.fc_norm[i].weight, rtol=1e-5, atol=1e-6)


# ---- the checkpoint ----------------------------------------------------------------------------------
@pytest.mark.parametrize("flags", FLAG_SETS.values(), ids=FLAG_SETS.keys())
def test_exported_folder_round_trips(tiny_cfg: DraftConfig, draft_verifier_dir: Path, tmp_path: Path,
                                     flags: dict[str, bool]) -> None:
    """export_draft -> load_draft: the flags in config.json (all three, as bools), fc_norm.{i}.weight
    in the weights exactly when fc_norm, and the same chain outputs on a random batch."""
    draft = _draft(_flagged(tiny_cfg, **flags), draft_verifier_dir)
    export_draft(draft, tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert {flag: config[flag] for flag in ARCHITECTURE_FLAGS} == {flag: flags.get(flag, False) for flag in ARCHITECTURE_FLAGS}
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        fc_norm_keys = {k for k in f.keys() if k.startswith("fc_norm.")}
    assert fc_norm_keys == ({f"fc_norm.{i}.weight" for i in range(tiny_cfg.num_aux)} if flags.get("fc_norm") else set())
    back = load_draft(tmp_path, verifier=Verifier.open(draft_verifier_dir))
    assert back.config == draft.config
    batch = _batch(tiny_cfg)
    for ours, theirs in zip(_chain(draft, batch), _chain(back, batch), strict=True):
        assert torch.equal(ours.hidden, theirs.hidden) and torch.equal(ours.normed, theirs.normed)


def test_a_folder_without_the_switches_loads_with_them_off(tiny_cfg: DraftConfig, tmp_path: Path) -> None:
    """Drafts published before the switches (or by other tools) do not name them: vLLM reads False."""
    export_draft(_draft(tiny_cfg), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in ARCHITECTURE_FLAGS}))
    back = load_draft(tmp_path)
    assert not any(getattr(back.config, flag) for flag in ARCHITECTURE_FLAGS) and back.fc_norm is None


@pytest.mark.parametrize("flag", ARCHITECTURE_FLAGS)
@pytest.mark.parametrize("in_folder", [True, False], ids=["folder_on", "folder_off"])
def test_init_from_refuses_a_folder_with_another_switch(tiny_cfg: DraftConfig, tmp_path: Path, flag: str,
                                                        in_folder: bool) -> None:
    export_draft(_draft(_flagged(tiny_cfg, **{flag: in_folder})), tmp_path)
    draft = build_draft(_flagged(tiny_cfg, **{flag: not in_folder}))
    message = (f"{tmp_path} cannot start this draft: {flag}: the folder has {in_folder}, the configured draft has "
               f"{not in_folder} (change draft.{flag}, or train.init_from)")
    with pytest.raises(ValueError, match=re.escape(message)):
        init_from_draft(draft, tmp_path)


def test_init_from_a_folder_with_the_same_switches_copies_fc_norm(tiny_cfg: DraftConfig, tmp_path: Path) -> None:
    published = _draft(_flagged(tiny_cfg, **FLAG_SETS["all"]))
    export_draft(published, tmp_path, dtype=torch.float32)
    draft = build_draft(published.config)
    init_from_draft(draft, tmp_path)
    assert all(torch.equal(mine.weight, theirs.weight) for mine, theirs in zip(draft.fc_norm, published.fc_norm))


def test_training_state_export_carries_fc_norm(tiny_cfg: DraftConfig) -> None:
    """train/export.py rebuilds the draft from the trainer's state_dict to export it."""
    from train.export import draft_from_state

    published = _draft(_flagged(tiny_cfg, **FLAG_SETS["all"]))
    state = published.state_dict()
    rebuilt = draft_from_state(published.config, state, None)
    assert all(torch.equal(rebuilt.state_dict()[k], v) for k, v in state.items())
    with pytest.raises(KeyError, match="fc_norm.0.weight"):
        draft_from_state(published.config, {k: v for k, v in state.items() if not k.startswith("fc_norm.")}, None)


# ---- vLLM ---------------------------------------------------------------------------------------------
@pytest.mark.vllm
def test_vllm_serves_a_draft_with_all_switches_on(tiny_cfg: DraftConfig, draft_verifier_dir: Path,
                                                  cpu_engine_cfg: DictConfig, tmp_path: Path) -> None:
    """vLLM loads the folder (fc_norm.{i} included) and its drafter agrees with ours step by step:
    fc_norm + fc output, each chained step's hidden input (post-norm: norm_output) and logits."""
    draft = make_test_draft(_flagged(tiny_cfg, **FLAG_SETS["all"]), draft_verifier_dir)
    with torch.no_grad():
        for i, norm in enumerate(draft.fc_norm):           # distinct weights: vLLM must load each one
            norm.weight.copy_(torch.linspace(0.5, 1.5, norm.weight.numel()).roll(i * 7))
        draft.midlayer.hidden_norm.weight.mul_(1.3)
    with engine_on(draft, draft_verifier_dir, cpu_engine_cfg, tmp_path / "draft") as (llm, record, ours):
        compare_first_round(llm, record, ours, COMPARE_PROMPTS[0])
