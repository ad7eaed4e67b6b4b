"""What a draft folder says of the training that made it: training.json beside config.json.

The trainer writes it at the end of a run (train/loop.py), so that whatever reads a draft folder
(the model card, `make eval`) needs nothing of the trainer's run folder: a draft folder copied
elsewhere still tells its store, its recipe, its held-out figures and the command that made it.
A folder exported outside a run (`python -m train export`, a published draft) has none.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

TRAINING_FILE = "training.json"


@dataclass(frozen=True)
class TrainingFacts:
    store_dir: str
    steps: int
    world_size: int
    zero_stage: int
    precision: str              # bf16 | fp32
    micro_batch: int            # packed rows per rank per micro-step
    grad_accum: int
    max_len: int                # tokens per packed row
    lr: float                   # the peak, after warmup (train/deepspeed_setup.py peak_lr)
    warmup: str                 # "N steps" or "r of the steps"
    min_lr_ratio: float
    grad_clip: float
    ttt_steps: int
    ttt_decay: float
    loss: str                   # the objective in words
    heldout_accept_length: float | None
    heldout_chain_accept_length: float | None
    command: str                # the overrides the run was started with

    def write(self, draft_dir: Path) -> Path:
        path = Path(draft_dir) / TRAINING_FILE
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, draft_dir: Path) -> TrainingFacts | None:
        """The folder's facts; None for a folder no training run wrote them into."""
        path = Path(draft_dir) / TRAINING_FILE
        if not path.exists():
            return None
        record = json.loads(path.read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(known - record.keys())
        if missing:
            raise ValueError(f"{path}: no {', '.join(missing)} (written by another version of the trainer?)")
        return cls(**{k: record[k] for k in known})
