"""Tests of model/verifier_handle.py: one Verifier per process, each of the folder's safetensors
files opened once, through a training start too (train/loop.py prepare + build_objective)."""
from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

import train.loop as loop
from config import compose_config, compose_draft_conf
from model.draft import DraftConfig
from model.verifier_handle import Verifier
from model import verifier_weights
from model.verifier_weights import read_verifier_head
from store import verifier_identity
from train.distributed import init_distributed


def _count_opens(monkeypatch: pytest.MonkeyPatch, folder: Path) -> Counter:
    """File name -> times a safetensors file under `folder` is opened (safe_open or load_file,
    wherever a module imported them), from now on."""
    opened: Counter = Counter()
    real_open, real_load = safetensors.safe_open, safetensors.torch.load_file

    def note(filename) -> None:
        path = Path(filename).resolve()
        if path.is_relative_to(folder.resolve()):
            opened[path.name] += 1

    def counting_open(filename, *args, **kwargs):
        note(filename)
        return real_open(filename, *args, **kwargs)

    def counting_load(filename, *args, **kwargs):
        note(filename)
        return real_load(filename, *args, **kwargs)

    real_map = verifier_weights.map_file

    def counting_map(file):
        note(file)
        return real_map(file)

    monkeypatch.setattr(verifier_weights, "map_file", counting_map)
    for module in list(sys.modules.values()):
        # load_file opens through safetensors.torch's own safe_open: left as is, not counted twice.
        if module is safetensors.torch:
            monkeypatch.setattr(module, "load_file", counting_load)
            continue
        for name, real, fake in (("safe_open", real_open, counting_open), ("load_file", real_load, counting_load)):
            if getattr(module, "__dict__", {}).get(name) is real:           # no lazy module's import
                monkeypatch.setattr(module, name, fake)
    return opened


def _copy(verifier: Path, to: Path, sharded: bool) -> Path:
    """A copy of the verifier folder (a new path: a handle of its own), its weights in one file or
    in two shards with an index (the embedding in one, the norm and lm_head in the other)."""
    shutil.copytree(verifier, to)
    if sharded:
        tensors = load_file(str(to / "model.safetensors"))
        (to / "model.safetensors").unlink()
        first = {n for n in tensors if n == "model.embed_tokens.weight" or n.startswith("model.layers.0.")}
        files = {"model-00001-of-00002.safetensors": first,
                 "model-00002-of-00002.safetensors": set(tensors) - first}
        for file, names in files.items():
            save_file({n: tensors[n] for n in names}, str(to / file))
        weight_map = {n: file for file, names in files.items() for n in names}
        (to / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return to


# ---- one training start ----------------------------------------------------------------------------
@pytest.mark.parametrize("sharded,extra", [(False, []), (True, ["draft.draft_vocab_size=1024"])],
                         ids=["single-file", "sharded-pruned"])
def test_a_training_start_opens_each_verifier_file_once(tmp_path: Path, train_store: Path, draft_verifier_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch, sharded: bool,
                                                        extra: list[str]) -> None:
    folder = _copy(draft_verifier_dir, tmp_path / "verifier", sharded)
    expected = read_verifier_head(folder)
    cfg = compose_config("train", [f"store_dir={train_store}", f"verifier.path={folder}", "train.precision=fp32",
                                   "train.max_len=384", "train.steps=1", "eval.heldout_fraction=0.25", *extra])
    init_distributed()
    opened = _count_opens(monkeypatch, folder)
    (tmp_path / "run").mkdir()
    setup = loop.prepare(cfg, tmp_path / "run", 1)
    objective = loop.build_objective(setup, cfg)

    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] if sharded else ["model.safetensors"]
    assert opened == Counter({file: 1 for file in files})
    assert torch.equal(objective.target_head, expected.lm_head.float())                 # fp32, from the one read
    assert torch.equal(objective.draft.embed_tokens, expected.embed_tokens.float())
    assert setup.verifier.files is Verifier.open(folder).files                          # one handle in the process


# ---- the handle ------------------------------------------------------------------------------------
def test_every_opening_of_one_folder_shares_its_files(draft_verifier_dir: Path) -> None:
    node = compose_config("train", [f"verifier.path={draft_verifier_dir}"]).verifier
    verifier = Verifier.from_conf(node)
    assert verifier.files is Verifier.open(draft_verifier_dir).files is Verifier.open(draft_verifier_dir / ".").files
    assert verifier.name == "kimi-tiny" and verifier.aux_capture == "residual_stream"
    draft = DraftConfig.from_conf(compose_draft_conf("kimi_tiny"), verifier)
    assert (draft.bos_token_id, draft.eos_token_id) == (verifier.token_ids["bos_token_id"], verifier.token_ids["eos_token_id"])
    assert verifier.eos_token_ids == [verifier.token_ids["eos_token_id"]]


def test_the_handle_says_what_config_json_says(draft_verifier_dir: Path) -> None:
    config = json.loads((draft_verifier_dir / "config.json").read_text())
    config = config.get("text_config", config)
    verifier = Verifier.open(draft_verifier_dir)
    assert verifier.config == config and verifier.name == draft_verifier_dir.name
    assert (verifier.hidden_size, verifier.vocab_size, verifier.num_hidden_layers) == \
        (config["hidden_size"], config["vocab_size"], config["num_hidden_layers"])
    assert verifier.aux_capture is None and verifier.final_norm_module is None


def test_the_identity_is_the_one_stores_record(draft_verifier_dir: Path) -> None:
    node = compose_config("train", [f"verifier.path={draft_verifier_dir}"]).verifier
    assert Verifier.from_conf(node).identity == verifier_identity(draft_verifier_dir, "kimi-tiny")


def test_aux_layers_in_both_conventions(draft_verifier_dir: Path) -> None:
    node = compose_config("train", [f"verifier.path={draft_verifier_dir}"]).verifier
    assert Verifier.from_conf(node).aux_layer_ids == (2, 4, 5)
    assert Verifier.from_conf(node).sglang_aux_layer_ids == (1, 3, 4)
    sglang = OmegaConf.merge(node, {"aux_layer_ids": [1, 3, 4], "aux_convention": "sglang"})
    assert Verifier.from_conf(sglang).aux_layer_ids == (2, 4, 5)
    assert Verifier.open(draft_verifier_dir).aux_layer_ids is None


def test_dtypes_are_converted_from_one_read(tmp_path: Path, draft_verifier_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _copy(draft_verifier_dir, tmp_path / "verifier", sharded=False)
    opened = _count_opens(monkeypatch, folder)
    verifier = Verifier.open(folder)
    stored = verifier.head()                                                    # the three in one read
    assert stored.lm_head.dtype == torch.bfloat16                               # kimi-tiny is stored in bf16
    fp32 = verifier.lm_head(torch.float32)
    assert torch.equal(fp32, stored.lm_head.float()) and verifier.lm_head(torch.float32) is fp32
    head = verifier.head(torch.float32)
    assert head.lm_head is fp32 and torch.equal(head.embed_tokens, verifier.embedding().float())
    assert verifier.lm_head() is stored.lm_head and verifier.norm() is stored.norm
    assert opened == Counter({"model.safetensors": 1})
    verifier.release_tensors()
    assert torch.equal(verifier.lm_head(), stored.lm_head)                      # read again after a release
    assert opened == Counter({"model.safetensors": 2})


def test_a_folder_rewritten_in_place_is_read_anew(tmp_path: Path, draft_verifier_dir: Path) -> None:
    folder = _copy(draft_verifier_dir, tmp_path / "verifier", sharded=False)
    before = Verifier.open(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"eos_token_id": [4, 5]}, indent=1))
    after = Verifier.open(folder)
    assert after.files is not before.files and after.eos_token_ids == [4, 5]
    assert after.identity["config_sha256"] != before.identity["config_sha256"]
