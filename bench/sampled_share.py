"""The dump's sampled copies against none: `python -m bench.sampled_share [--shares 0 0.125 0.25]`.

    .venv/bin/python -m bench.sampled_share [--shares 0 0.125 0.25] [--prompts 96] [--seed 0] [--runs DIR]
        [--out bench/results/sampled_share.json]

bench/variants.py with one variant per share s, named s: `python -m dump
regenerate.sampled_share=<s>` (that share of the training conversations answered a second time at
regenerate.sampled_temperature, dump/regenerate.py), then the demo's training and an evaluation on
96 prompts per category, into DIR/<s>/. Each row also names its share; the held-out conversations
never get a copy, so the held-out chain compares across shares. One seed per call (another with
`--seed N --runs <another DIR>` on the same stores); nothing else should run on the machine meanwhile.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from bench.variants import compare
from infra import REPO_ROOT

OUT = REPO_ROOT / "bench" / "results" / "sampled_share.json"
RUNS = REPO_ROOT / "runs" / "bench-sampled-share"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.125, 0.25])
    parser.add_argument("--prompts", type=int, default=96, help="evaluation prompts per category")
    parser.add_argument("--seed", type=int, default=0, help="the training's seed (conf/train.yaml seed)")
    parser.add_argument("--runs", type=Path, default=RUNS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    variants = [(f"{share:g}", [f"regenerate.sampled_share={share}"]) for share in args.shares]
    report = compare(variants, args.runs, args.prompts, args.seed,
                     "python -m bench.sampled_share " + shlex.join(argv or sys.argv[1:]), __doc__.splitlines()[0])
    for share, row in zip(args.shares, report["runs"]):
        row["sampled_share"] = share
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
