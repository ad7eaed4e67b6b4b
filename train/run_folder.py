"""One training run's folder, the only place that knows its layout, and what each checkpoint in it
carries so that it exports (or resumes) from its own folder alone:

    <run>/                         Hydra's output dir (rank 0's, shared with every rank)
        .hydra/config.yaml         the run's composed config, written by Hydra
        metrics.jsonl              one JSON line per logged step (train/metrics.py)
        heldout_samples.json       the latest held-out evaluation's sums per sample (train/metrics.py)
        tensorboard/               the same numbers as TensorBoard scalars
        draft_config.json          the draft's config.json (model.checkpoint.draft_config_json)
        vocab.safetensors          d2t of a pruned draft vocabulary (absent for the full one)
        follow.json                the windows of a run following a dump (train/follow.py)
        checkpoints/step-N/        DeepSpeed's files, copies of draft_config.json and
                                   vocab.safetensors, complete.json (train/checkpoints.py; its
                                   marker also records the verifier folder)
        draft/                     the exported vLLM draft (its README.md: model/card.py)
        summary.json               what `fit` returns
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from model.checkpoint import draft_config_from_json
from model.draft import DraftConfig
from train.checkpoints import checkpoint_marker, newest_verified, save_checkpoint, verified_checkpoint

METRICS = "metrics.jsonl"
HELDOUT_SAMPLES = "heldout_samples.json"
TENSORBOARD = "tensorboard"
DRAFT_CONFIG = "draft_config.json"
VOCAB = "vocab.safetensors"
CHECKPOINTS = "checkpoints"
EXPORT_DIR = "draft"
SUMMARY = "summary.json"
FOLLOW = "follow.json"
_VERIFIER = "verifier"        # the marker's record of the verifier folder


@dataclass(frozen=True)
class RunFolder:
    """The paths of one run folder (the layout above), and the checkpoint calls that take them."""

    root: Path
    metrics: Path = field(init=False)
    heldout_samples: Path = field(init=False)
    tensorboard: Path = field(init=False)
    draft_config: Path = field(init=False)
    vocab: Path = field(init=False)
    checkpoints: Path = field(init=False)
    export_dir: Path = field(init=False)
    summary: Path = field(init=False)
    follow: Path = field(init=False)

    def __post_init__(self) -> None:
        layout = {"metrics": METRICS, "heldout_samples": HELDOUT_SAMPLES, "tensorboard": TENSORBOARD, "draft_config": DRAFT_CONFIG,
                  "vocab": VOCAB, "checkpoints": CHECKPOINTS, "export_dir": EXPORT_DIR,
                  "summary": SUMMARY, "follow": FOLLOW}
        for name, relative in layout.items():
            object.__setattr__(self, name, self.root / relative)     # frozen: set once, here

    def resolve_resume(self, resume: str | None) -> Path | None:
        """train.resume -> the verified checkpoint to load, or None for a fresh start.

        null / "never": fresh; "auto": the newest checkpoint of this run that verifies, fresh if
        there is none; a path: that checkpoint, or the newest complete one in a checkpoints or run
        folder, which must verify. A checkpoint without its marker is never returned."""
        if resume in (None, "never", False):
            return None
        if resume == "auto":
            return newest_verified(self.checkpoints)
        return find_checkpoint(Path(str(resume)))

    def save_checkpoint(self, engine, step: int, keep: int, client_state: dict[str, Any],
                        verifier: Path | None) -> Path:
        """checkpoints/step-N, carrying this run's draft config and pruned vocabulary and naming
        the verifier folder in its marker; the newest `keep` checkpoints stay."""
        carry = {DRAFT_CONFIG: self.draft_config} | ({VOCAB: self.vocab} if self.vocab.exists() else {})
        record = {_VERIFIER: str(verifier)} if verifier is not None else {}
        return save_checkpoint(engine, self.checkpoints, step, keep, client_state, carry, record)

    def write_summary(self, summary: dict[str, Any]) -> None:
        self.summary.write_text(json.dumps(summary, indent=2, default=str) + "\n")


def find_checkpoint(path: Path) -> Path:
    """A checkpoint folder, a checkpoints folder or a run folder -> the verified checkpoint it
    names (the newest complete one in a folder of them)."""
    run = RunFolder(path)
    return verified_checkpoint(run.checkpoints if run.checkpoints.is_dir() else path)


@dataclass(frozen=True)
class CheckpointDraft:
    """What exporting a checkpoint takes besides its weights."""

    config: DraftConfig
    d2t: torch.Tensor | None           # a pruned vocabulary's; None for the full one
    verifier: Path | None              # the folder it was trained against, where known


def checkpoint_draft(folder: Path) -> CheckpointDraft:
    """The draft config, d2t and verifier folder of a checkpoint, from the checkpoint itself (every
    checkpoint with a format-2 marker carries them). The marker is checked against its seal
    (FileNotFoundError where the draft config is missing)."""
    marker = checkpoint_marker(folder)
    config, vocab = folder / DRAFT_CONFIG, folder / VOCAB
    verifier = Path(marker[_VERIFIER]) if marker.get(_VERIFIER) else None
    if not config.is_file():
        raise FileNotFoundError(f"checkpoint {folder} carries no {DRAFT_CONFIG} (every checkpoint the "
                                "trainer saves does): it was removed since the save")
    d2t = load_file(str(vocab))["d2t"] if vocab.exists() else None
    return CheckpointDraft(draft_config_from_json(json.loads(config.read_text()), config), d2t, verifier)
