"""The dump's sampled copies against none: `python -m bench.sampled_share [--shares 0 0.125 0.25]`.

    .venv/bin/python -m bench.sampled_share [--shares 0 0.125 0.25] [--prompts 96] [--seed 0] [--runs DIR]
        [--out bench/results/sampled_share.json]

For each share s, the demo's three stages with their defaults but two, into DIR/<s>/:
`python -m dump regenerate.sampled_share=<s>` (that share of the training conversations answered a
second time at regenerate.sampled_temperature, dump/regenerate.py) into DIR/<s>/store, `python -m
train` on it (`eval.every=0`, as the demo; `seed=<seed>`: the draft's initialisation and shuffle),
and `python -m evaluation` on its draft with `num_prompts=<prompts>` per category (96 by default:
on the demo's 24 a sampled figure moves by more than the levers it should tell). A stage whose output is already in DIR/<s>/ is not run again,
so a stopped run resumes. Writes, per share: the dump's wall time and the store's samples and
tokens, the trainer's held-out chain accept length (greedy text; held-out conversations never get
a copy) and tokens/s, the evaluation's accept lengths per category (vLLM and simulated, greedy and
sampled), and each figure's difference from the first share's. One seed per call (another with
`--seed N --runs <another DIR>` on the same stores); nothing else should run on the machine meanwhile.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.demo import eval_figures, train_figures
from bench.machine import machine
from infra import REPO_ROOT

OUT = REPO_ROOT / "bench" / "results" / "sampled_share.json"
RUNS = REPO_ROOT / "runs" / "bench-sampled-share"


def run_stage(args: list[str], done: Path) -> None:
    """`python -m <args>` unless `done` (the stage's last output) exists."""
    if done.exists():
        print(f"bench.sampled_share: {done} is there: {args[0]} not run again", flush=True)
        return
    print(f"bench.sampled_share: {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, check=True)


def run_share(share: float, runs: Path, prompts: int, seed: int) -> dict[str, Any]:
    run = runs / f"{share:g}"
    store, dump, train, evaluation = run / "store", run / "dump", run / "train", run / "eval"
    run_stage(["dump", f"regenerate.sampled_share={share}", f"output_dir={store}", f"hydra.run.dir={dump}"],
              dump / "dump_summary.json")
    run_stage(["train", f"store_dir={store}", f"seed={seed}", "eval.every=0", f"hydra.run.dir={train}"],
              train / "summary.json")
    run_stage(["evaluation", f"draft_dir={train / 'draft'}", f"num_prompts={prompts}", "card=false",
               f"hydra.run.dir={evaluation}"], evaluation / "eval.json")
    summary = json.loads((dump / "dump_summary.json").read_text())
    trained = train_figures(train)
    return {"sampled_share": share, "seed": seed, "run": str(run),
            "dump": {"wall_s": summary["wall_s"], "samples": summary["samples_written"],
                     "tokens": summary["tokens_written"]},
            "train": {"heldout_chain_accept_length": trained["heldout_chain_accept_length"],
                      "tokens_per_s_steady_median": trained["tokens_per_s_steady_median"]},
            "eval": eval_figures(evaluation)}


def differences(row: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """Each accept length of `row` minus the same one of `base`."""
    out = {"heldout_chain_accept_length": row["train"]["heldout_chain_accept_length"]
           - base["train"]["heldout_chain_accept_length"]}
    for name, cat in row["eval"]["categories"].items():
        for key in ("vllm_greedy", "vllm_sampled", "sim_greedy", "sim_sampled"):
            out[f"{name}.{key}"] = cat[key] - base["eval"]["categories"][name][key]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.125, 0.25])
    parser.add_argument("--prompts", type=int, default=96, help="evaluation prompts per category")
    parser.add_argument("--seed", type=int, default=0, help="the training's seed (conf/train.yaml seed)")
    parser.add_argument("--runs", type=Path, default=RUNS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    rows = [run_share(share, args.runs.resolve(), args.prompts, args.seed) for share in args.shares]
    for row in rows[1:]:
        row["minus_first"] = differences(row, rows[0])
    report = {"what": __doc__.splitlines()[0], "command": "python -m bench.sampled_share " + " ".join(argv or sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine(),
              "prompts_per_category": args.prompts, "runs": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for row in rows:
        cats = row["eval"]["categories"]
        print(f"bench.sampled_share: share {row['sampled_share']:g}: held-out chain "
              f"{row['train']['heldout_chain_accept_length']:.3f}; " + "; ".join(
                  f"{name} vLLM greedy {c['vllm_greedy']:.3f} sampled {c['vllm_sampled']:.3f}" for name, c in cats.items()))
    return report


if __name__ == "__main__":
    main()
