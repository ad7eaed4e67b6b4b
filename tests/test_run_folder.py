"""The run folder (train/run_folder.py), the sealed JSON it shares with the store (store/sealed.py)
and the checkpoint markers written with it (train/checkpoints.py): a checkpoint exports from its
own folder alone, a marker of the previous format (1) is refused by name, and the store's sealed
bytes are those it has always written.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.checkpoint import load_draft
from store.sealed import NotSealedError, SealMismatchError, sealed_json, unseal_json, write_sealed_json
from tests.test_train import _fit, _overrides, one_thread  # noqa: F401
from train.checkpoints import COMPLETE, CheckpointError, checkpoint_problem, newest_verified, verify_checkpoint
from train.run_folder import DRAFT_CONFIG, VOCAB, RunFolder, checkpoint_draft, find_checkpoint

# A manifest as the store has written it since format 2: compact JSON, then its sha256 line.
MANIFEST = {"format_version": 3, "rank": 0, "shards": [], "rejected": {}}
MANIFEST_BYTES = (b'{"format_version":3,"rank":0,"shards":[],"rejected":{}}\n'
                  b'sha256:d9586fa259076fcab26e85e582a43544d53c00fe4aebeea808542eec85faa2b8\n')

# A format-1 complete.json as the previous trainer wrote it (for one 13-byte file): sealed by its
# marker_sha256 field, not by a sha256 line.
STATES = b"model states\n"
FORMAT_1_MARKER = (
    b'{\n "files": {\n  "mp_rank_00_model_states.pt": {\n   "bytes": 13,\n'
    b'   "sha256": "d20fc1a6632724c9e3ecddf344a2f370c5d3b9ab8302ba520878f635961c6e97"\n  }\n },\n'
    b' "format": 1,\n "loss": 1.5,\n'
    b' "marker_sha256": "091a6e92b87fd0fb83a391a44781728258b484ee3691da32dfc2bcafd2595576",\n "step": 2\n}\n')


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
def test_a_format_1_marker_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from train.__main__ import verify_main

    root = tmp_path / "checkpoints"
    folder = root / "step-00000002"
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(STATES)
    (folder / COMPLETE).write_bytes(FORMAT_1_MARKER)
    older = (f"file {COMPLETE} was written by an older version of the trainer (a format-1 marker) and is "
             "not read any more")
    assert checkpoint_problem(folder) == older
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {folder}: {older}; no earlier complete")):
        verify_checkpoint(folder)
    with pytest.raises(CheckpointError, match=f"none of the 1 complete checkpoints .*{re.escape(older)}.* "
                                              "not starting over"):
        newest_verified(root)
    with pytest.raises(CheckpointError, match=re.escape(older)):
        find_checkpoint(root)
    assert verify_main([str(folder)]) == 1 and older in capsys.readouterr().err
    # The markers written before format 1 recorded no file hashes.
    (folder / COMPLETE).write_text('{"step": 2, "loss": 1.5}\n')
    assert checkpoint_problem(folder) == older.replace("a format-1 marker", "a marker without file hashes")
    # A format-2 marker that lost its sha256 line is damage, named as such.
    (folder / COMPLETE).write_bytes(FORMAT_1_MARKER.replace(b'"format": 1', b'"format": 2'))
    assert checkpoint_problem(folder) == f"file {COMPLETE} is damaged: it does not end with its sha256 line"


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
