"""Learning curves of the draft: `make bench-quality [ARGS=...]`.

    .venv/bin/python -m bench.quality [--store STORE] [--steps 200] [--every 25]
        [--fractions 0.25 0.5 1.0] [--fresh] [--out bench/results/quality.json]

Held-out chain accept length (4 drafts, as bench/recipe.py's peer setting) against training
tokens and data size, so that steps and data are chosen from a curve: one run per share of the
training split (train.train_fraction: nested subsets, the held-out samples fixed), each with the
default recipe (conf/train.yaml) for --steps optimizer steps, evaluated every --every steps.
Every run is `python -m train` into runs/bench-quality/<share>; a finished run is read back.
Results: bench/results/quality.json and quality.png.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from infra import REPO_ROOT
from train.metrics import read_jsonl

RUNS = REPO_ROOT / "runs" / "bench-quality"
OUT = REPO_ROOT / "bench" / "results" / "quality.json"


def train_share(store: Path, fraction: float, steps: int, every: int, fresh: bool) -> Path:
    run_dir = RUNS / f"share-{fraction:g}"
    if (run_dir / "summary.json").exists() and not fresh:
        return run_dir
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "train", f"store_dir={store}", f"train.train_fraction={fraction}",
           f"train.steps={steps}", f"eval.every={every}", "eval.ttt_steps=4", "train.num_workers=1",
           f"train.checkpoint_every={steps}", "train.export=false", f"hydra.run.dir={run_dir}"]
    (RUNS / f"share-{fraction:g}.cmd").write_text(" ".join(cmd) + "\n")
    with open(RUNS / f"share-{fraction:g}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return run_dir


def curve(run_dir: Path) -> dict[str, Any]:
    """Held-out chain accept length at each evaluation, against the training tokens seen so far."""
    train = read_jsonl(run_dir / "metrics.jsonl", "train")
    seen, tokens_at = 0.0, {}
    for r in train:
        seen += r["tokens"]
        tokens_at[r["step"]] = seen
    summary = json.loads((run_dir / "summary.json").read_text())
    points = [{"step": h["step"], "train_tokens": tokens_at[h["step"]],
               "chain_accept_length": h["chain_accept_length"],
               "top1": [h[f"acc_{k}"] for k in range(4)]}
              for h in read_jsonl(run_dir / "metrics.jsonl", "heldout")]
    return {"train_samples": None, "points": points, "train_tokens_per_s": summary.get("train_tokens_per_s")}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for share, run in report["runs"].items():
        xs = [p["train_tokens"] / 1e3 for p in run["points"]]
        ax.plot(xs, [p["chain_accept_length"] for p in run["points"]], marker="o",
                label=f"{float(share):.0%} of the training split ({run['train_samples']} samples)")
    ax.set_xlabel("training tokens seen (thousands)")
    ax.set_ylabel("held-out chain accept length (4 drafts)")
    ax.set_title(f"kimi-tiny draft, default recipe, {report['steps']} steps")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=REPO_ROOT / "runs" / "store" / "kimi-tiny-sharegpt_subset")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if not (args.store / "store.json").exists():
        parser.error(f"{args.store}: no store (run `make dump` first)")
    from config import compose_config
    from train.batches import StoreSplit

    cfg = compose_config("train")
    split = StoreSplit.open(args.store, float(cfg.eval.heldout_fraction), int(cfg.eval.heldout_seed))
    report: dict[str, Any] = {"what": __doc__.splitlines()[0], "store": str(args.store), "steps": args.steps,
                              "every": args.every, "heldout_samples": len(split.heldout), "runs": {}}
    for fraction in args.fractions:
        run = curve(train_share(args.store.resolve(), fraction, args.steps, args.every, args.fresh))
        run["train_samples"] = len(split.with_train_fraction(fraction).train)
        report["runs"][f"{fraction:g}"] = run
        print(f"share {fraction:g}: " + ", ".join(f"{p['train_tokens'] / 1e3:.0f}k tok {p['chain_accept_length']:.3f}"
                                                   for p in run["points"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    return report


if __name__ == "__main__":
    main()
