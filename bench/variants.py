"""Pipeline settings against each other, each through the demo's three stages: `python -m bench.variants`.

    .venv/bin/python -m bench.variants --variant NAME='OVERRIDE ...' [--variant ...]
        [--prompts 96] [--seed 0] [--runs DIR] [--out bench/results/variants.json]

Each variant is a name and the overrides that make it (none: the defaults): `python -m dump`'s,
`python -m train`'s written with a `train:` prefix (`train:train.lr=1.7e-3`) and `python -m
evaluation`'s with an `eval:` prefix (a variant that changes what the verifier is asked for, such as
`verifier.aux_layer_ids`, gives it to all three). Into DIR/<name>/:
`python -m dump <its overrides>` into DIR/<name>/store, `python -m train` on it with the demo's
`eval.every=0`, `seed=<seed>` (the draft's initialisation and shuffle) and its overrides, and
`python -m evaluation` on its draft with `num_prompts=<prompts>` per category (96 by default: on the
demo's 24 a figure moves by more than the levers it should tell). A stage whose output is already
in DIR/<name>/ is not run again, so a stopped run resumes, and variants that dump alike can share
one store (a link to it at DIR/<name>/store and DIR/<name>/dump). Writes, per variant: the dump's
wall time and the store's samples and tokens, the trainer's held-out chain accept length and
tokens/s, the evaluation's accept lengths per category (vLLM and simulated, greedy and sampled),
and each figure's difference from the first variant's. The held-out chain also compares with the
first's on the samples both held-out sets hold with the same positions (`heldout_shared`,
clustered by conversation), so a variant that changes the set compares too; the evaluation's
prompts are the same for all. Nothing else should run on the machine meanwhile.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.demo import eval_figures, train_figures
from bench.machine import machine
from evaluation.paired import HeldoutSums, paired_difference
from infra import REPO_ROOT

OUT = REPO_ROOT / "bench" / "results" / "variants.json"
RUNS = REPO_ROOT / "runs" / "bench-variants"


def run_stage(args: list[str], done: Path) -> None:
    """`python -m <args>` unless `done` (the stage's last output) exists."""
    if done.exists():
        print(f"bench.variants: {done} is there: {args[0]} not run again", flush=True)
        return
    print(f"bench.variants: {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, check=True)


TRAIN = "train:"     # an override of `python -m train`
EVAL = "eval:"       # an override of `python -m evaluation`; the unprefixed ones are `python -m dump`'s


def stage_overrides(overrides: list[str]) -> tuple[list[str], list[str], list[str]]:
    """A variant's overrides -> (the dump's, the trainer's, the evaluation's), prefixes dropped."""
    dump = [o for o in overrides if not o.startswith((TRAIN, EVAL))]
    train = [o[len(TRAIN):] for o in overrides if o.startswith(TRAIN)]
    evaluation = [o[len(EVAL):] for o in overrides if o.startswith(EVAL)]
    return dump, train, evaluation


def run_variant(name: str, overrides: list[str], runs: Path, prompts: int, seed: int) -> dict[str, Any]:
    """Dump and train with `overrides`, train with `seed`, evaluate on `prompts` per category, in runs/<name>."""
    run = runs / name
    store, dump, train, evaluation = run / "store", run / "dump", run / "train", run / "eval"
    dump_args, train_args, eval_args = stage_overrides(overrides)
    run_stage(["dump", *dump_args, f"output_dir={store}", f"hydra.run.dir={dump}"], dump / "dump_summary.json")
    run_stage(["train", f"store_dir={store}", f"seed={seed}", "eval.every=0", *train_args, f"hydra.run.dir={train}"],
              train / "summary.json")
    run_stage(["evaluation", f"draft_dir={train / 'draft'}", f"num_prompts={prompts}", "card=false", *eval_args,
               f"hydra.run.dir={evaluation}"], evaluation / "eval.json")
    summary = json.loads((dump / "dump_summary.json").read_text())
    trained = train_figures(train)
    return {"variant": name, "overrides": overrides, "seed": seed, "run": str(run),
            "dump": {"wall_s": summary["wall_s"], "samples": summary["samples_written"],
                     "tokens": summary["tokens_written"]},
            "train": {"heldout_chain_accept_length": trained["heldout_chain_accept_length"],
                      "tokens_per_s_steady_median": trained["tokens_per_s_steady_median"]},
            "eval": eval_figures(evaluation)}


def heldout_shared(row: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The held-out chain difference, row minus base, on the held-out samples both drafts were
    scored on with the same positions, with its standard error clustered by conversation."""
    sums = [HeldoutSums.read(Path(r["run"]) / "train" / "heldout_samples.json") for r in (row, base)]
    return paired_difference(*sums[0].shared_with(sums[1])).to_json()


def differences(row: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Each accept length of `row` minus the same one of `base`; the held-out chain both on each
    store's own held-out set and on the samples the two sets share."""
    out = {"heldout_chain_accept_length": row["train"]["heldout_chain_accept_length"]
           - base["train"]["heldout_chain_accept_length"],
           "heldout_shared": heldout_shared(row, base)}
    for name, cat in row["eval"]["categories"].items():
        for key in ("vllm_greedy", "vllm_sampled", "sim_greedy", "sim_sampled"):
            out[f"{name}.{key}"] = cat[key] - base["eval"]["categories"][name][key]
    return out


def compare(variants: list[tuple[str, list[str]]], runs: Path, prompts: int, seed: int,
            command: str, what: str) -> dict[str, Any]:
    """Every variant's row, the later ones with their differences from the first: the report."""
    rows = [run_variant(name, overrides, runs.resolve(), prompts, seed) for name, overrides in variants]
    for row in rows[1:]:
        row["minus_first"] = differences(row, rows[0])
    for row in rows:
        cats = row["eval"]["categories"]
        print(f"bench.variants: {row['variant']}: held-out chain "
              f"{row['train']['heldout_chain_accept_length']:.3f}; " + "; ".join(
                  f"{name} vLLM greedy {c['vllm_greedy']:.3f} sampled {c['vllm_sampled']:.3f}" for name, c in cats.items()))
    return {"what": what, "command": command, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": machine(), "prompts_per_category": prompts, "runs": rows}


def parse_variant(text: str) -> tuple[str, list[str]]:
    """NAME=OVERRIDES (space-separated Hydra overrides, `train:` before the trainer's, `eval:` before the
    evaluation's) -> (name, overrides)."""
    name, sep, overrides = text.partition("=")
    if not sep or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME='override override ...'")
    return name, overrides.split()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        help="NAME='OVERRIDE ...': the first is the baseline")
    parser.add_argument("--prompts", type=int, default=96, help="evaluation prompts per category")
    parser.add_argument("--seed", type=int, default=0, help="the training's seed (conf/train.yaml seed)")
    parser.add_argument("--runs", type=Path, default=RUNS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    command = "python -m bench.variants " + shlex.join(argv or sys.argv[1:])
    report = compare(args.variant, args.runs, args.prompts, args.seed, command, __doc__.splitlines()[0])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
