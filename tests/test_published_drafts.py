"""Published drafts (tools/published_drafts.py rebuilds them at kimi-tiny's shapes) through the
importer, train.init_from and the exporter; and each engine's loading rule on exported folders."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from config import compose_config, compose_draft_conf
from model.aux_ids import sglang_to_vllm_aux_ids
from model.card import write_card
from model.checkpoint import (DEEPSEEK_V3, EMBED, KIMI_K3, draft_config_for_run, engine_load_problems,
                              export_draft, init_from_draft, load_draft, read_folder_config, sglang_capture,
                              our_name, stored_names, vllm_capture)
from model.draft import ARCHITECTURE_FLAGS, DraftConfig, build_draft
from model.verifier_handle import Verifier
from model.mla import RMSNorm
from model.verifier_weights import read_verifier_embedding
from tests.conftest import plain_layer
from tools.published_drafts import PUBLISHED, TEMPLATES, template_sglang_ids, write_published

EAGLE31 = {"fc_norm": True, "norm_output": True}
NULL_SWITCHES = [f"draft.{flag}=null" for flag in ARCHITECTURE_FLAGS]


@pytest.fixture(scope="module")
def tiny_cfg(draft_verifier_dir: Path) -> DraftConfig:
    return plain_layer(DraftConfig.from_conf(compose_draft_conf("kimi_tiny"), Verifier.open(draft_verifier_dir)))


@pytest.fixture(scope="module")
def embedding(draft_verifier_dir: Path) -> torch.Tensor:
    return read_verifier_embedding(draft_verifier_dir)


def _switches(name: str) -> dict[str, bool]:
    return {flag: bool(PUBLISHED[name].get("eagle31")) and flag in EAGLE31 for flag in ARCHITECTURE_FLAGS}


@torch.no_grad()
def _published(name: str, cfg: DraftConfig, embedding: torch.Tensor, path: Path) -> Path:
    """The folder `name`, holding a random draft whose norms are not all ones."""
    torch.manual_seed(0)
    draft = build_draft(dataclasses.replace(cfg, **_switches(name)))
    for module in draft.modules():
        if isinstance(module, RMSNorm):
            module.weight.copy_(1 + 0.2 * torch.randn(module.weight.shape))
    return write_published(name, path / name, draft, embedding)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _run_conf(verifier: Path, init_from: Path, *overrides: str):
    return compose_config("train", [f"verifier.path={verifier}", f"train.init_from={init_from}", *overrides]).draft


# ---- import -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", PUBLISHED)
def test_a_published_folder_imports_with_its_layers_switches_and_weights(
        name: str, tiny_cfg: DraftConfig, embedding: torch.Tensor, tmp_path: Path) -> None:
    folder = _published(name, tiny_cfg, embedding, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    back = load_draft(folder)
    # The layers the template's SGLang ids name, whichever way the folder writes them.
    trained = tuple(sglang_to_vllm_aux_ids(template_sglang_ids(tiny_cfg.target_num_hidden_layers),
                                           tiny_cfg.target_num_hidden_layers))
    assert back.config.aux_layer_ids == trained == tiny_cfg.aux_layer_ids
    # ... which is what SGLang, the engine TorchSpec's folders were made for, captures from them.
    assert sglang_capture(config, DEEPSEEK_V3, tiny_cfg.target_num_hidden_layers) == trained
    assert {flag: getattr(back.config, flag) for flag in ARCHITECTURE_FLAGS} == _switches(name)
    template = TEMPLATES[PUBLISHED[name]["family"]]
    # vLLM parses model_type kimi_k2 with DeepseekV3Config, whose default fills a missing value.
    assert back.config.max_position_embeddings == template.get(
        "max_position_embeddings", AutoConfig.for_model("deepseek_v3").max_position_embeddings)
    ours = {our_name(k): v for k, v in _tensors(folder).items()}
    assert torch.equal(back.embed_tokens, ours.pop(EMBED).float())
    assert back.state_dict().keys() == ours.keys()
    assert all(torch.equal(back.state_dict()[k], v.float()) for k, v in ours.items())


def test_nested_ids_of_each_kind_are_told_apart_and_misreaders_named(tiny_cfg: DraftConfig, embedding: torch.Tensor,
                                                                     tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """TorchSpec's --vllm export holds vLLM ids ([2, ...]), its native export SGLang ids ([1, ...]):
    the engine that misreads each is logged (TokenSpeed adds 1 to both, vLLM takes both as they are)."""
    vllm_ids = _published("torchspec_vllm_k2", tiny_cfg, embedding, tmp_path)
    sglang_ids = _published("torchspec_sglang_ids", tiny_cfg, embedding, tmp_path)
    nested = [json.loads((f / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
              for f in (vllm_ids, sglang_ids)]
    assert nested == [list(tiny_cfg.aux_layer_ids), [i - 1 for i in tiny_cfg.aux_layer_ids]]
    assert vllm_capture(json.loads((vllm_ids / "config.json").read_text()), DEEPSEEK_V3, 8) == tiny_cfg.aux_layer_ids
    for folder, misreader in ((vllm_ids, "tokenspeed"), (sglang_ids, "vllm")):
        caplog.clear()
        with caplog.at_level("WARNING", logger="model.checkpoint"):
            assert read_folder_config(folder).aux_layer_ids == tiny_cfg.aux_layer_ids
        on_k2 = [r.getMessage() for r in caplog.records if r.getMessage().endswith("(on a deepseek_v3 target)")]
        assert [m.split(": ", 1)[1].split()[0] for m in on_k2] == [misreader]


# ---- train.init_from ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["eagle31_k2", "torchspec_vllm_k2"])
def test_init_from_takes_the_folders_switches_where_the_conf_leaves_them_null(
        name: str, tiny_cfg: DraftConfig, embedding: torch.Tensor, draft_verifier_dir: Path, tmp_path: Path) -> None:
    folder = _published(name, tiny_cfg, embedding, tmp_path)
    conf = _run_conf(draft_verifier_dir, folder, *NULL_SWITCHES)
    cfg = draft_config_for_run(conf, Verifier.open(draft_verifier_dir), folder)
    assert {flag: getattr(cfg, flag) for flag in ARCHITECTURE_FLAGS} == _switches(name)
    plain = DraftConfig.from_conf(conf, Verifier.open(draft_verifier_dir))
    assert not any(getattr(plain, f) for f in ARCHITECTURE_FLAGS)                 # null: off
    draft = build_draft(cfg)
    init_from_draft(draft, folder)
    published = load_draft(folder)
    assert all(torch.equal(draft.state_dict()[k], v) for k, v in published.state_dict().items())


@pytest.mark.parametrize("name,override", [("eagle31_k2", "draft.fc_norm=false"),
                                           ("torchspec_vllm_k2", "draft.norm_output=true")])
def test_init_from_refuses_a_switch_the_conf_sets_otherwise_naming_both(
        name: str, override: str, tiny_cfg: DraftConfig, embedding: torch.Tensor, draft_verifier_dir: Path,
        tmp_path: Path) -> None:
    folder = _published(name, tiny_cfg, embedding, tmp_path)
    flag, mine = override.removeprefix("draft.").split("=")
    theirs = _switches(name)[flag]
    conf = _run_conf(draft_verifier_dir, folder, *[o for o in NULL_SWITCHES if not o.startswith(f"draft.{flag}=")],
                     override)
    message = f"{flag} is {theirs} in its config.json, {mine == 'true'} in draft.{flag}"
    with pytest.raises(ValueError, match=re.escape(message)):
        draft_config_for_run(conf, Verifier.open(draft_verifier_dir), folder)


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_published_folder_re_exports_to_the_same_layers_and_tensors(
        name: str, tiny_cfg: DraftConfig, embedding: torch.Tensor, draft_verifier_dir: Path, tmp_path: Path) -> None:
    """folder -> train.init_from -> export -> import: the same aux ids, switches and tensors (the
    K3 draft's run names the Kimi-K3 target, whose folder carries the embedding)."""
    folder = _published(name, tiny_cfg, embedding, tmp_path)
    k3 = PUBLISHED[name]["family"] == "k3"
    cfg = draft_config_for_run(_run_conf(draft_verifier_dir, folder, *NULL_SWITCHES), Verifier.open(draft_verifier_dir),
                               folder)
    cfg = dataclasses.replace(cfg, target_model_type=KIMI_K3 if k3 else DEEPSEEK_V3)
    draft = build_draft(cfg)
    init_from_draft(draft, folder)
    out = export_draft(draft, tmp_path / "again", verifier=Verifier.open(draft_verifier_dir))
    back = read_folder_config(out)
    assert back.aux_layer_ids == read_folder_config(folder).aux_layer_ids == cfg.aux_layer_ids
    assert {f: getattr(back, f) for f in ARCHITECTURE_FLAGS} == _switches(name)
    published = {our_name(k): v for k, v in _tensors(folder).items()}
    if not k3:
        del published[EMBED]            # DeepSeek-V3 targets share the verifier's
    assert _tensors(out).keys() == published.keys()
    assert all(torch.equal(_tensors(out)[k], v) for k, v in published.items())


# ---- what each engine loads -----------------------------------------------------------------------
def test_a_k3_export_carries_what_every_engines_loader_needs(tiny_cfg: DraftConfig, draft_verifier_dir: Path,
                                                            tmp_path: Path) -> None:
    k3 = dataclasses.replace(tiny_cfg, target_model_type=KIMI_K3)
    draft = build_draft(k3)
    with pytest.raises(ValueError, match="has not loaded the verifier's embedding"):
        export_draft(draft, tmp_path / "no_embedding")          # a draft rebuilt from a training state
    out = export_draft(draft, tmp_path / "k3", verifier=Verifier.open(draft_verifier_dir))
    config, names = json.loads((out / "config.json").read_text()), stored_names(out)
    assert torch.equal(_tensors(out)[EMBED], read_verifier_embedding(draft_verifier_dir).to(torch.bfloat16))
    assert engine_load_problems(config, names, k3) == {"vllm": [], "sglang": [], "tokenspeed": []}
    without = engine_load_problems(config, [n for n in names if n != EMBED], k3)
    assert without["vllm"] == without["sglang"] == [] and "needs embed_tokens.weight" in without["tokenspeed"][0]
    # A DeepSeek-V3 target's embedding is shared by every engine: not exported.
    plain = export_draft(build_draft(tiny_cfg), tmp_path / "k2")
    assert EMBED not in stored_names(plain)
    assert engine_load_problems(json.loads((plain / "config.json").read_text()), stored_names(plain), tiny_cfg) \
        == {"vllm": [], "sglang": [], "tokenspeed": []}
    assert "`embed_tokens.weight`: TokenSpeed cannot share" in (write_card(out, "kimi-tiny", "/v", 1, 1)).read_text()


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_loading_rules_accept_the_published_layouts_and_refuse_broken_ones(
        name: str, tiny_cfg: DraftConfig, embedding: torch.Tensor, tmp_path: Path) -> None:
    folder = _published(name, tiny_cfg, embedding, tmp_path)
    config, names = json.loads((folder / "config.json").read_text()), stored_names(folder)
    cfg = read_folder_config(folder)
    assert engine_load_problems(config, names, cfg) == {"vllm": [], "sglang": [], "tokenspeed": []}
    if cfg.fc_norm:      # an EAGLE 3.1 config without its fc_norm tensors, or the tensors without the switch
        lacking = engine_load_problems(config, [n for n in names if not n.startswith("fc_norm.")], cfg)
        assert all("lacks ['fc_norm.0.weight'" in p[0] for p in lacking.values())
        unread = engine_load_problems(config, names, dataclasses.replace(cfg, fc_norm=False))
        assert all("holds ['fc_norm.0.weight'" in p[0] for p in unread.values())


def test_norm_before_residual_is_exported_as_served_by_vllm_only(tiny_cfg: DraftConfig, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    cfg = dataclasses.replace(tiny_cfg, norm_before_residual=True)
    with caplog.at_level("WARNING", logger="model.checkpoint"):
        out = export_draft(build_draft(cfg), tmp_path / "nbr")
    assert re.search(r"SGLang \S+ does not read norm_before_residual", caplog.text)
    assert re.search(r"TokenSpeed \S+ does not read norm_before_residual", caplog.text)
    problems = engine_load_problems(json.loads((out / "config.json").read_text()), stored_names(out), cfg)
    assert problems["vllm"] == [] and all("only vLLM serves" in problems[e][0] for e in ("sglang", "tokenspeed"))
    card = write_card(out, "kimi-tiny", "/v", 1, 1).read_text()
    assert "not `norm_before_residual`: only vLLM serves this folder as trained" in card
    assert card.count("does not read norm_before_residual") == 2          # SGLang's and TokenSpeed's launch notes
