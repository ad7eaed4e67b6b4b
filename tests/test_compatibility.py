"""Tests of model/compatibility.py: the one check that a store, a draft config, a verifier and a
draft folder fit together, every disagreement at once."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from config import compose_config, compose_draft_conf
from model.checkpoint import export_draft, read_draft_folder
from model.compatibility import (DRAFT, FOLDER, INIT_FROM, STORE, IncompatibleError, StoreIncompatibleError,
                                 check_compatible)
from model.draft import DraftConfig, build_draft
from model.verifier_handle import Verifier
from store import StoreMismatchError, StoreReader, StoreWriter, verifier_identity


def _draft_cfg(verifier: Path) -> DraftConfig:
    return DraftConfig.from_conf(compose_draft_conf("kimi_tiny"), Verifier.open(verifier))


def _tiny_store(path: Path, verifier: Path, aux_ids: list[int], aux_capture: str = "residual_stream",
                **identity_changes) -> Path:
    cfg = compose_config("dump")
    identity = verifier_identity(verifier, "kimi-tiny") | identity_changes
    H, n = identity["hidden_size"], len(aux_ids)
    with StoreWriter(path, identity, aux_ids, cfg.store, {}, aux_convention="vllm", aux_capture=aux_capture,
                     rank=0, world_size=1) as w:
        w.add("s0", torch.arange(4), torch.ones(4, dtype=torch.bool), torch.zeros(4, n, H), torch.zeros(4, H))
    return path


def _check_store(store: Path, verifier: Path, aux_capture: str | None = None, draft: DraftConfig | None = None) -> None:
    check_compatible(verifier=Verifier.open(verifier), draft=draft or _draft_cfg(verifier), store=StoreReader(store),
                     aux_capture=aux_capture)


# ---- the store against the draft and the verifier ---------------------------------------------------
def test_matching_store_is_accepted(train_store: Path, draft_verifier_dir: Path) -> None:
    _check_store(train_store, draft_verifier_dir, "residual_stream")


@pytest.mark.parametrize("change,message", [
    ({"aux_ids": [1, 4, 5]}, r"aux layer ids \(vLLM convention\): the store has \[1, 4, 5\], the draft has \[2, 4, 5\]"),
    ({"hidden_size": 128}, "hidden size: the store has 128, the draft has 256"),
    ({"vocab_size": 4096}, "vocabulary: the store has 4096, the draft has 8192"),
    ({"config_sha256": "0" * 64}, "verifier config_sha256: the store has '0{64}', the verifier has '[0-9a-f]{64}'"),
])
def test_mismatched_store_is_refused(tmp_path: Path, draft_verifier_dir: Path, change: dict, message: str) -> None:
    aux = change.pop("aux_ids", [2, 4, 5])
    store = _tiny_store(tmp_path / "store", draft_verifier_dir, aux, **change)
    with pytest.raises(StoreMismatchError, match=message) as error:
        _check_store(store, draft_verifier_dir)
    assert f"store {store} does not match the draft config" in str(error.value)
    assert "(change " in str(error.value) and "store_dir" in str(error.value)


@pytest.mark.parametrize("store_mode,draft_mode", [("prefix_only", "residual_stream"),
                                                   ("attn_res_stream", "prefix_only")])
def test_store_of_another_aux_capture_is_refused(tmp_path: Path, draft_verifier_dir: Path,
                                                 store_mode: str, draft_mode: str) -> None:
    store = _tiny_store(tmp_path / "store", draft_verifier_dir, [2, 4, 5], aux_capture=store_mode)
    with pytest.raises(StoreMismatchError) as error:
        _check_store(store, draft_verifier_dir, draft_mode)
    message = str(error.value)
    assert f"store {store}" in message
    assert f"aux capture: the store has {store_mode!r}, the draft has {draft_mode!r} (change draft.aux_capture" in message
    _check_store(store, draft_verifier_dir, store_mode)                       # the same mode: accepted


def test_store_of_another_verifier_checkpoint_is_refused(tmp_path: Path, draft_verifier_dir: Path,
                                                         train_store: Path) -> None:
    """Same shapes, other weights' config (a retrained verifier): its hash differs."""
    other = tmp_path / "other_verifier"
    shutil.copytree(draft_verifier_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-5}))
    with pytest.raises(StoreMismatchError, match="config_sha256"):
        _check_store(train_store, other)


def test_every_disagreement_is_reported_at_once(tmp_path: Path, draft_verifier_dir: Path) -> None:
    """Another verifier's hash, other aux layers and another vocabulary: one error names all three,
    each with both sides and the setting to change."""
    store = _tiny_store(tmp_path / "store", draft_verifier_dir, [1, 4, 5], config_sha256="0" * 64, vocab_size=4096)
    with pytest.raises(StoreIncompatibleError) as error:
        _check_store(store, draft_verifier_dir)
    problems = error.value.problems
    assert [p.what for p in problems] == ["verifier config_sha256", "vocabulary", "aux layer ids (vLLM convention)"]
    assert all(p.pair == STORE and p.sides[0][0] == "the store" and p.change for p in problems)
    assert [side for side, _ in problems[2].sides] == ["the store", "the draft"]
    message = str(error.value)
    assert all(str(p) in message for p in problems)
    assert isinstance(error.value, IncompatibleError) and isinstance(error.value, ValueError)


def test_the_draft_config_against_the_verifier_folder(draft_verifier_dir: Path) -> None:
    """A draft composed for the conf's verifier, checked against the folder the run reads:
    without a store, a disagreement is an IncompatibleError, not a store mismatch."""
    cfg = compose_config("train")
    verifier = Verifier.from_conf(cfg.verifier)
    draft = _draft_cfg(draft_verifier_dir)
    check_compatible(verifier=verifier, draft=draft)
    other = dataclasses.replace(draft, vocab_size=4096, aux_layer_ids=(2, 3, 5))
    with pytest.raises(IncompatibleError) as error:
        check_compatible(verifier=verifier, draft=other)
    assert not isinstance(error.value, StoreMismatchError)
    assert [(p.pair, p.what) for p in error.value.problems] == [(DRAFT, "vocab_size"),
                                                                (DRAFT, "aux_layer_ids (vLLM convention)")]
    assert "vocab_size: the draft has 4096, the verifier has 8192" in str(error.value)


# ---- a draft folder against the draft it starts and the verifier it serves -------------------------
def test_a_folder_reports_every_field_it_differs_in(tmp_path: Path, draft_verifier_dir: Path) -> None:
    cfg = _draft_cfg(draft_verifier_dir)
    export_draft(build_draft(cfg), tmp_path)
    wanted = dataclasses.replace(cfg, intermediate_size=512, aux_layer_ids=(1, 4, 5))
    with pytest.raises(IncompatibleError) as error:
        check_compatible(draft=wanted, folder=read_draft_folder(tmp_path))
    assert [(p.pair, p.what) for p in error.value.problems] == [(INIT_FROM, "intermediate_size"),
                                                                (INIT_FROM, "aux_layer_ids")]
    assert str(error.value).startswith(f"{tmp_path} cannot start this draft: intermediate_size: the folder has "
                                       f"{cfg.intermediate_size}, the configured draft has 512 (change "
                                       "draft.intermediate_size, or train.init_from); aux_layer_ids: ")


def test_a_folder_for_another_verifier_is_refused_naming_both(tmp_path: Path, draft_verifier_dir: Path) -> None:
    cfg = _draft_cfg(draft_verifier_dir)
    export_draft(build_draft(dataclasses.replace(cfg, aux_layer_ids=(1, 3, 5))), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 4096}))
    verifier = Verifier.from_conf(compose_config("eval").verifier)
    with pytest.raises(IncompatibleError) as error:
        check_compatible(verifier=verifier, folder=read_draft_folder(tmp_path))
    assert [(p.pair, p.what) for p in error.value.problems] == [(FOLDER, "vocab_size"),
                                                                (FOLDER, "aux_layer_ids (vLLM convention)")]
    assert str(error.value).startswith(f"{tmp_path} does not fit verifier kimi-tiny ({verifier.path}): ")
