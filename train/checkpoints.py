"""Training checkpoints: save, verify, resume, prune. train/run_folder.py says where they live.

A checkpoint is a folder <checkpoints>/step-XXXXXXXX/ holding DeepSpeed's files, the files the
run gives it to carry (its draft config and pruned vocabulary: what an export needs), and
complete.json, written by rank 0 once every rank has saved. complete.json records every file of
the folder (relative path: bytes and sha256) and what the run adds (step, loss, verifier folder);
a checkpoint is resumed from only when the marker and every file it lists verify, so a partial
save, a truncated file or a flipped bit is refused by name, never loaded.

The marker is format 2: sealed JSON (store/sealed.py: compact JSON, then a sha256 line), the
only one written and read. A marker of an older trainer (format 1, JSON sealed by its own field
marker_sha256, or one from before it) is refused by name, as any marker of another format is.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from infra import FAILPOINTS_ENV, failpoint
from store.sealed import NotSealedError, SealMismatchError, replace_sealed_json, unseal_json

logger = logging.getLogger(__name__)

COMPLETE = "complete.json"
MARKER_FORMAT = 2
_MARKER_TMP = f".{COMPLETE}."        # replace_sealed_json's tmp files
TAG_PREFIX = "step-"
_CHUNK = 1 << 24


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded: its save did not finish, or a file changed since."""


def tag_of(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under root that have a completion marker, oldest first (the marker's
    contents are not checked here: see verify_checkpoint)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(TAG_PREFIX) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: p.name)


# ---- the marker ------------------------------------------------------------------------------
def _digest(path: Path) -> tuple[int, str]:
    """(bytes, sha256) of a file, whose data is also flushed to disk: the marker that records
    it may only exist once what it vouches for would survive a power loss."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return size, h.hexdigest()


def _write_marker(folder: Path, record: Mapping[str, Any]) -> None:
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith((COMPLETE, _MARKER_TMP))):
        size, digest = _digest(path)
        files[path.relative_to(folder).as_posix()] = {"bytes": size, "sha256": digest}
    # The checkpoint exists from the rename on (the folder is fsync'd after it).
    replace_sealed_json(folder / COMPLETE, {"format": MARKER_FORMAT, **record, "files": files},
                        before_rename="train.checkpoint.marker_unrenamed", after_rename=None)


def _read_marker(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(marker, None), or (None, what is wrong with complete.json)."""
    try:
        raw = (folder / COMPLETE).read_bytes()
    except FileNotFoundError:
        return None, f"file {COMPLETE} is missing: the save did not finish (a partial checkpoint)"
    try:
        marker = unseal_json(raw)
    except NotSealedError:
        return None, _unsealed_problem(raw)
    except SealMismatchError:
        return None, f"file {COMPLETE} does not match the sha256 on its last line: it changed after the save"
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT or "files" not in marker:
        found = marker.get("format") if isinstance(marker, dict) else None
        return None, (f"file {COMPLETE} is not a format-{MARKER_FORMAT} marker (format {found!r}): written "
                      "by another version")
    return marker, None


def _unsealed_problem(raw: bytes) -> str:
    """What a complete.json without a sha256 line is: damaged, or a marker of an older trainer
    (format 1, sealed by its own marker_sha256 field, or before it one without file hashes),
    refused by name rather than as damage."""
    try:
        marker = json.loads(raw)
    except ValueError:
        marker = None
    if isinstance(marker, dict) and marker.get("format") != MARKER_FORMAT:
        what = "a format-1 marker" if marker.get("format") == 1 else "a marker without file hashes"
        return (f"file {COMPLETE} was written by an older version of the trainer ({what}) and is not "
                "read any more")
    return f"file {COMPLETE} is damaged: it does not end with its sha256 line"


# ---- verification ----------------------------------------------------------------------------
def checkpoint_problem(folder: Path) -> str | None:
    """What keeps a checkpoint folder from loading, or None: its marker must be intact and every
    file it lists must still have the recorded size and sha256 (files it does not list, such as
    an export written into the folder later, are not its concern)."""
    marker, problem = _read_marker(folder)
    if marker is None:
        return problem
    for rel, want in marker["files"].items():
        path = folder / rel
        if not path.is_file():
            return f"file {rel} is missing ({COMPLETE} lists it with {want['bytes']} bytes)"
        if path.stat().st_size != want["bytes"]:
            return f"file {rel} has {path.stat().st_size} bytes, {COMPLETE} recorded {want['bytes']}"
        size, digest = _digest(path)
        if (size, digest) != (want["bytes"], want["sha256"]):
            return (f"file {rel} has sha256 {digest[:16]}..., {COMPLETE} recorded {want['sha256'][:16]}...: "
                    "its contents changed after the save")
    return None


def _refusal(folder: Path, problem: str) -> CheckpointError:
    older = [p for p in complete_checkpoints(folder.parent) if p.name < folder.name]
    previous = next((p for p in reversed(older) if checkpoint_problem(p) is None), None)
    hint = (f"the previous complete checkpoint is {previous}; resume from it with train.resume={previous}"
            if previous else "no earlier complete checkpoint verifies (train.resume=null starts over)")
    return CheckpointError(f"checkpoint {folder}: {problem}; {hint}")


def verify_checkpoint(folder: Path) -> dict[str, Any]:
    """The marker of a checkpoint that may be loaded; CheckpointError naming the first file that
    is missing, resized or changed, and the newest older checkpoint that verifies."""
    problem = checkpoint_problem(folder)
    if problem is not None:
        raise _refusal(folder, problem)
    return _read_marker(folder)[0] or {}


def checkpoint_marker(folder: Path) -> dict[str, Any]:
    """The marker of a checkpoint, checked against its own seal only (not the files it lists: for
    a folder verify_checkpoint or newest_verified already verified)."""
    marker, problem = _read_marker(folder)
    if marker is None:
        raise CheckpointError(f"checkpoint {folder}: {problem}")
    return marker


# ---- resume ----------------------------------------------------------------------------------
def newest_verified(root: Path) -> Path | None:
    """train.resume=auto: the newest checkpoint that verifies. Newer corrupt ones are logged and
    skipped; when checkpoints exist and none verifies it raises rather than start over."""
    if not root.is_dir():
        return None
    found = complete_checkpoints(root)
    newest = found[-1].name if found else ""
    for partial in sorted(p for p in root.iterdir() if p.name.startswith(TAG_PREFIX) and p.name > newest
                          and not (p / COMPLETE).exists()):
        logger.warning("checkpoint %s has no %s (its save did not finish): not resumed from", partial, COMPLETE)
    skipped = []
    for folder in reversed(found):
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder
        logger.error("checkpoint %s: %s; skipped, trying an older one", folder, problem)
        skipped.append(f"{folder.name}: {problem}")
    if skipped:
        raise CheckpointError(
            f"train.resume=auto: none of the {len(found)} complete checkpoints under {root} verifies "
            f"({'; '.join(skipped)}); not starting over from scratch: move them aside or set "
            "train.resume=null to train from the beginning")
    return None


def verified_checkpoint(path: Path) -> Path:
    """That checkpoint folder, or the newest complete checkpoint in that folder, which must verify
    (CheckpointError; FileNotFoundError where there is none)."""
    if (path / COMPLETE).exists() or (path.name.startswith(TAG_PREFIX) and path.is_dir()):
        verify_checkpoint(path)
        return path
    found = complete_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"train.resume={path}: no complete checkpoint there")
    verify_checkpoint(found[-1])
    return found[-1]


# ---- save, load ------------------------------------------------------------------------------
def _failpoint_after_each_file(engine) -> None:
    """A failpoint between the files DeepSpeed writes (model states, then optimizer states), for
    the fault suite; installed only when failpoints are armed."""
    ckpt = engine.checkpoint_engine
    if FAILPOINTS_ENV not in os.environ or getattr(ckpt, "_failpoint_installed", False):
        return
    save = ckpt.save

    def save_then_failpoint(state_dict: Any, path: str) -> None:
        save(state_dict, path)
        failpoint("train.checkpoint.file_saved")

    ckpt.save, ckpt._failpoint_installed = save_then_failpoint, True


def save_checkpoint(engine, root: Path, step: int, keep: int, client_state: dict[str, Any],
                    carry: Mapping[str, Path] | None = None, record: Mapping[str, Any] | None = None) -> Path:
    """Every rank saves its part; rank 0 then copies `carry` (name in the checkpoint -> file) into
    the folder, records every file's size and sha256 and `record` in the marker (which makes the
    checkpoint complete), and keeps the newest `keep` checkpoints (all of them for 0)."""
    tag = tag_of(step)
    folder = root / tag
    if dist.get_rank() == 0 and root.is_dir():
        # This step's folder and later ones are a killed save's leftovers or checkpoints of a
        # trajectory this run went back from (it resumed from an older checkpoint, or a newer
        # one did not verify): no stale file may mix with the new ones, and once this run has
        # moved on, train.resume=auto must not pick up the abandoned trajectory again.
        for stale in sorted(p for p in root.iterdir() if p.name.startswith(TAG_PREFIX) and p.name >= tag):
            if (stale / COMPLETE).exists():
                logger.warning("removing checkpoint %s: this run is saving step %d of another trajectory", stale, step)
            shutil.rmtree(stale)
    dist.barrier()
    _failpoint_after_each_file(engine)
    engine.save_checkpoint(str(root), tag=tag, client_state={"step": step, **client_state})
    dist.barrier()
    failpoint("train.checkpoint.before_marker")
    if dist.get_rank() == 0:
        for name, source in (carry or {}).items():
            shutil.copyfile(source, folder / name)
        _write_marker(folder, {"step": step, **client_state, **(record or {})})
        failpoint("train.checkpoint.after_marker")
        _prune(root, tag, keep)
    dist.barrier()
    return folder


def _prune(root: Path, tag: str, keep: int) -> None:
    """The newest `keep` complete checkpoints stay (all for 0), and no unfinished save before `tag`."""
    for old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for partial in root.iterdir():
        if partial.name.startswith(TAG_PREFIX) and partial.name < tag and not (partial / COMPLETE).exists():
            shutil.rmtree(partial, ignore_errors=True)


def load_checkpoint(engine, folder: Path) -> int:
    """Restore module, optimizer, lr schedule and step from a checkpoint folder that
    RunFolder.resolve_resume returned (hence verified); the step."""
    _, client = engine.load_checkpoint(str(folder.parent), tag=folder.name)
    if client is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint {folder}")
    return int(client["step"])
