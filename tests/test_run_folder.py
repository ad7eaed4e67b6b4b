"""The run folder (train/run_folder.py), the sealed JSON it shares with the store (store/sealed.py)
and the checkpoint markers written with it (train/checkpoints.py): a checkpoint exports from its
own folder alone, markers of the previous format (1) still verify, resume and export, and the
store's sealed bytes are those it has always written.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.checkpoint import load_draft
from store.sealed import NotSealedError, SealMismatchError, sealed_json, unseal_json, write_sealed_json
from tests.test_train import _fit, _losses, _overrides, one_thread  # noqa: F401
from train.checkpoints import (COMPLETE, CheckpointError, checkpoint_marker, checkpoint_problem, newest_verified,
                               verify_checkpoint)
from train.run_folder import DRAFT_CONFIG, VOCAB, RunFolder, checkpoint_draft, find_checkpoint

# A manifest as the store has written it since format 2: compact JSON, then its sha256 line.
MANIFEST = {"format_version": 3, "rank": 0, "shards": [], "rejected": {}}
MANIFEST_BYTES = (b'{"format_version":3,"rank":0,"shards":[],"rejected":{}}\n'
                  b'sha256:d9586fa259076fcab26e85e582a43544d53c00fe4aebeea808542eec85faa2b8\n')

# A format-1 complete.json as the previous trainer wrote it (for one 13-byte file).
STATES = b"model states\n"
FORMAT_1_MARKER = (
    b'{\n "files": {\n  "mp_rank_00_model_states.pt": {\n   "bytes": 13,\n'
    b'   "sha256": "d20fc1a6632724c9e3ecddf344a2f370c5d3b9ab8302ba520878f635961c6e97"\n  }\n },\n'
    b' "format": 1,\n "loss": 1.5,\n'
    b' "marker_sha256": "091a6e92b87fd0fb83a391a44781728258b484ee3691da32dfc2bcafd2595576",\n "step": 2\n}\n')


def format_1_marker(body: dict) -> bytes:
    """The previous trainer's sealing: the body's canonical JSON hashed into marker_sha256, then
    the whole written sorted and indented."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    sealed = {**body, "marker_sha256": hashlib.sha256(canonical).hexdigest()}
    return (json.dumps(sealed, sort_keys=True, indent=1) + "\n").encode()


def as_format_1(checkpoint: Path) -> None:
    """Rewrite a checkpoint as the previous trainer saved it: without the files it now carries
    and with a format-1 marker listing the rest."""
    marker = checkpoint_marker(checkpoint)
    for name in (DRAFT_CONFIG, VOCAB):
        (checkpoint / name).unlink(missing_ok=True)
        marker["files"].pop(name, None)
    body = {"format": 1, **{k: v for k, v in marker.items() if k not in ("format", "verifier")}}
    (checkpoint / COMPLETE).write_bytes(format_1_marker(body))


# ---- sealed JSON -------------------------------------------------------------------------------
def test_sealed_json_is_the_stores_format_byte_for_byte(tmp_path: Path) -> None:
    assert sealed_json(MANIFEST) == MANIFEST_BYTES
    write_sealed_json(tmp_path / "rank-00000.json", MANIFEST)
    assert (tmp_path / "rank-00000.json").read_bytes() == MANIFEST_BYTES
    assert unseal_json(MANIFEST_BYTES) == MANIFEST
    with pytest.raises(SealMismatchError):
        unseal_json(MANIFEST_BYTES.replace(b'"rank":0', b'"rank":1'))
    with pytest.raises(NotSealedError):
        unseal_json(MANIFEST_BYTES[:MANIFEST_BYTES.rindex(b"\nsha256:")])


# ---- format-1 markers --------------------------------------------------------------------------
def test_a_format_1_marker_still_verifies_and_any_changed_byte_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    folder = root / "step-00000002"
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(STATES)
    body = {"format": 1, "step": 2, "loss": 1.5, "files": {"mp_rank_00_model_states.pt": {
        "bytes": len(STATES), "sha256": hashlib.sha256(STATES).hexdigest()}}}
    assert format_1_marker(body) == FORMAT_1_MARKER
    (folder / COMPLETE).write_bytes(FORMAT_1_MARKER)
    assert checkpoint_problem(folder) is None
    assert verify_checkpoint(folder)["step"] == 2
    assert newest_verified(root) == folder == find_checkpoint(root)
    for offset in range(len(FORMAT_1_MARKER)):
        damaged = bytearray(FORMAT_1_MARKER)
        damaged[offset] ^= 0x01
        (folder / COMPLETE).write_bytes(bytes(damaged))
        problem = checkpoint_problem(folder)
        assert problem and problem.startswith(f"file {COMPLETE} "), (offset, problem)
    (folder / COMPLETE).write_bytes(FORMAT_1_MARKER)
    (folder / "mp_rank_00_model_states.pt").write_bytes(STATES[:-1])
    with pytest.raises(CheckpointError, match="file mp_rank_00_model_states.pt has 12 bytes"):
        verify_checkpoint(folder)


# ---- real runs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pruned_run(train_store: Path, draft_verifier_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two steps of a pruned-vocabulary draft (d2t in its checkpoint), checkpointed and exported."""
    run = tmp_path_factory.mktemp("pruned")
    _fit(run, _overrides(train_store, draft_verifier_dir, "draft.draft_vocab_size=1024", "train.steps=2"))
    return run


@pytest.mark.slow
def test_a_checkpoint_exports_from_its_own_folder_alone(pruned_run: Path, tmp_path: Path,
                                                        draft_verifier_dir: Path) -> None:
    from train.__main__ import export_main

    run = RunFolder(pruned_run)
    checkpoint = run.checkpoints / "step-00000002"
    marker = verify_checkpoint(checkpoint)
    assert {DRAFT_CONFIG, VOCAB} <= set(marker["files"]) and marker["verifier"] == str(draft_verifier_dir)
    alone = tmp_path / "elsewhere" / checkpoint.name             # no run folder around it
    shutil.copytree(checkpoint, alone)
    source = checkpoint_draft(alone)
    assert source.verifier == draft_verifier_dir and source.config.draft_vocab_size == 1024
    assert torch.equal(source.d2t, load_file(str(run.vocab))["d2t"])
    assert export_main([str(alone), str(tmp_path / "out")]) == 0
    again, exported = load_draft(tmp_path / "out").state_dict(), load_draft(run.export_dir).state_dict()
    assert set(again) == set(exported) and all(torch.equal(again[k], v) for k, v in exported.items())
    assert export_main([str(alone)]) == 0 and (alone / "draft" / "model.safetensors").is_file()
    assert checkpoint_problem(alone) is None                     # an export beside it is not its concern


@pytest.mark.slow
def test_a_format_1_checkpoint_exports_from_its_run_and_resumes(pruned_run: Path, tmp_path: Path,
                                                                train_store: Path, draft_verifier_dir: Path) -> None:
    from omegaconf import OmegaConf

    from config import compose_config
    from train.__main__ import export_main

    old = tmp_path / "old"
    shutil.copytree(pruned_run, old)
    checkpoint = RunFolder(old).checkpoints / "step-00000002"
    as_format_1(checkpoint)
    assert checkpoint_problem(checkpoint) is None and not (checkpoint / DRAFT_CONFIG).exists()
    # The config Hydra saves in a run folder: the verifier of a checkpoint that does not name it.
    (old / ".hydra").mkdir()
    OmegaConf.save(compose_config("train", [f"verifier.path={draft_verifier_dir}"]), old / ".hydra" / "config.yaml")
    source = checkpoint_draft(checkpoint)
    assert source.verifier == draft_verifier_dir and source.config.draft_vocab_size == 1024
    assert export_main([str(old), str(tmp_path / "out")]) == 0
    exported = load_draft(RunFolder(old).export_dir).state_dict()
    assert all(torch.equal(load_draft(tmp_path / "out").state_dict()[k], v) for k, v in exported.items())

    summary = _fit(old, _overrides(train_store, draft_verifier_dir, "draft.draft_vocab_size=1024", "train.steps=4",
                                   "train.checkpoint_every=2", "train.resume=auto"))
    assert summary["resumed_from"] == str(checkpoint) and len(_losses(old)) == 4
    newest = checkpoint_marker(RunFolder(old).checkpoints / "step-00000004")
    assert newest["format"] == 2 and {DRAFT_CONFIG, VOCAB} <= set(newest["files"])
