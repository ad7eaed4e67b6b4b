"""Where a run's numbers go: a JSONL log and TensorBoard scalars, at the paths the run folder
gives (train/run_folder.py: metrics.jsonl, tensorboard/), written by rank 0 only.

metrics.jsonl holds one JSON object per line: {"split": "train" | "heldout", "step": s, ...}.
A resumed run first drops the lines of steps after its checkpoint (a killed run may have logged
a few more), so the file always reads as one uninterrupted run.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from torch import Tensor

from train.objective import simulated_accept_length


def step_metrics(stats: Tensor, prefix: str = "") -> dict[str, float]:
    """stats [4, K] (train/objective.py's StepStats summed over batches and ranks) -> per step k:
    loss_k and acc_k (top-1 agreement over step k's counted positions), chain_k (share of chains
    still fully accepted after draft k); accept_length = 1 + sum_k prod_{i<=k} acc_i (the usual
    estimate, as if steps were independent) and chain_accept_length = 1 + sum_k chain_k (greedy
    chain drafting replayed on the same text: what vLLM would accept on it)."""
    loss_sum, correct, count, chain = stats.double().cpu()
    out: dict[str, float] = {}
    acc = []
    chains = float(count[0])
    for k in range(stats.shape[1]):
        n = float(count[k])
        out[f"{prefix}loss_{k}"] = float(loss_sum[k]) / n if n else math.nan
        acc.append(float(correct[k]) / n if n else 0.0)
        out[f"{prefix}acc_{k}"] = acc[-1]
        out[f"{prefix}chain_{k}"] = float(chain[k]) / chains if chains else 0.0
    out[f"{prefix}accept_length"] = simulated_accept_length(acc)
    out[f"{prefix}chain_accept_length"] = 1.0 + sum(out[f"{prefix}chain_{k}"] for k in range(stats.shape[1]))
    out[f"{prefix}tokens_counted"] = chains
    return out


class RunLog:
    """JSONL + TensorBoard writer of rank 0; other ranks get one that does nothing."""

    def __init__(self, jsonl: Path, tensorboard: Path, enabled: bool, resume_step: int = 0,
                 samples: Path | None = None) -> None:
        self.enabled = enabled
        self.path = Path(jsonl)
        self.samples_path = samples
        self._tb = None
        if not enabled:
            return
        if self.path.exists():
            self._truncate_after(resume_step)
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(str(tensorboard), purge_step=resume_step + 1)

    def _truncate_after(self, step: int) -> None:
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, split: str, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"split": split, "step": step, **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in values.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(f"{split}/{key}", value, step)

    def write_samples(self, step: int, sample_ids: list[str], per_sample: Tensor) -> None:
        """The samples file (train/run_folder.py heldout_samples): the latest evaluation's sums per held-out
        sample (train/heldout.py), by sample id: positions (chains counted), chain_sum (the sum
        over its positions of the drafts accepted, so chain accept length = 1 + chain_sum /
        positions), correct and count per TTT step."""
        if not self.enabled or self.samples_path is None:
            return
        loss_sum, correct, count, chain = per_sample.double().unbind(1)     # each [samples, K]
        samples = {sid: {"positions": float(count[i, 0]), "chain_sum": float(chain[i].sum()),
                         "correct": correct[i].tolist(), "count": count[i].tolist()}
                   for i, sid in enumerate(sample_ids)}
        tmp = self.samples_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "samples": samples}) + "\n")
        tmp.replace(self.samples_path)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: Path, split: str | None = None) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (of one split when given)."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in records if split is None or r["split"] == split]
