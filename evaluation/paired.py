"""Two drafts on the same held-out samples: the difference of their chain accept lengths and its
standard error, clustered by conversation.

The positions of one conversation are not independent draws (a draft that misreads a topic misreads
it all along), so the honest error of a difference counts conversations, not positions: with d_c
the difference of the two drafts' accepted drafts summed over conversation c's n_c positions, N the
positions and D = sum_c d_c / N, the cluster-robust variance of D is
    G / (G - 1) * sum_c (d_c - D n_c)^2 / N^2      over G conversations
(the sandwich estimator of a mean over clusters). Each draft's sums per sample come from its run
folder's heldout_samples.json (train/metrics.py RunLog.write_samples).
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.split import sharegpt_split_key


@dataclass(frozen=True)
class HeldoutSums:
    """A draft's held-out sums per sample: positions and drafts accepted (chain_sum)."""

    step: int
    positions: dict[str, float]
    chain_sum: dict[str, float]

    @classmethod
    def read(cls, path: Path) -> HeldoutSums:
        record = json.loads(Path(path).read_text())
        samples = record["samples"]
        return cls(record["step"], {s: v["positions"] for s, v in samples.items()},
                   {s: v["chain_sum"] for s, v in samples.items()})

    def chain_accept_length(self) -> float:
        return 1.0 + sum(self.chain_sum.values()) / sum(self.positions.values())

    def shared_with(self, other: HeldoutSums) -> tuple[HeldoutSums, HeldoutSums]:
        """Both drafts' sums on the samples both were scored on with the same number of positions:
        two stores whose held-out sets overlap (a dump setting that changes the set's size, or
        answers decoded again) compare there."""
        shared = [s for s in self.positions if other.positions.get(s) == self.positions[s]]
        if not shared:
            raise ValueError("the two drafts share no held-out sample with the same positions")
        return self._on(shared), other._on(shared)

    def _on(self, samples: list[str]) -> HeldoutSums:
        return HeldoutSums(self.step, {s: self.positions[s] for s in samples},
                           {s: self.chain_sum[s] for s in samples})


@dataclass(frozen=True)
class PairedDifference:
    """a - b on the same positions, with its clustered and its per-position standard errors."""

    a: float                    # chain accept length of draft a
    b: float
    diff: float
    se_clustered: float         # by conversation
    conversations: int
    positions: float
    largest_share: float        # the largest share of the positions one conversation holds

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def paired_difference(a: HeldoutSums, b: HeldoutSums,
                      conversation_of: Callable[[str], str] = sharegpt_split_key) -> PairedDifference:
    """The difference of two drafts' chain accept lengths on the held-out samples both were scored
    on (the same store's split: refused otherwise), clustered by `conversation_of(sample id)`."""
    if a.positions.keys() != b.positions.keys():
        only = sorted(a.positions.keys() ^ b.positions.keys())[:5]
        raise ValueError(f"the two drafts were scored on different held-out samples (e.g. {only}): "
                         "compare runs on one store and one split")
    mismatched = [s for s in a.positions if a.positions[s] != b.positions[s]]
    if mismatched:
        raise ValueError(f"samples {mismatched[:5]} count different positions in the two runs "
                         "(different eval.ttt_steps or loss settings?)")
    n: Mapping[str, float] = defaultdict(float)
    d: Mapping[str, float] = defaultdict(float)
    for sample, positions in a.positions.items():
        c = conversation_of(sample)
        n[c] += positions
        d[c] += a.chain_sum[sample] - b.chain_sum[sample]
    total = sum(n.values())
    diff = sum(d.values()) / total
    groups = len(n)
    spread = sum((d[c] - diff * n[c]) ** 2 for c in n)
    se = math.sqrt(groups / (groups - 1) * spread) / total if groups > 1 else math.inf
    return PairedDifference(a.chain_accept_length(), b.chain_accept_length(), diff, se, groups, total,
                            max(n.values()) / total)
