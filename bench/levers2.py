"""The draft's levers at the peer setting, each rung with two seeds and standard errors:
`make bench-levers [ARGS=...]`.

    .venv/bin/python -m bench.levers2 [--store STORE] [--rungs NAME ...] [--seeds 0 1] [--jobs 2]
        [--fresh] [--runs runs/bench-levers2] [--out bench/results/levers2.json]

The peer setting is bench/recipe.py's (PEER: 100 optimizer steps of 2 packed rows of up to 2,048
tokens, TTT 4, 4 drafts evaluated, 1 data worker) on the store `make dump` writes, whose held-out
set is one part per held-out conversation (data/heldout_set.py, conf/dump.yaml heldout_set). Every run is `python -m train`
with PEER, the rung's overrides and `seed=<s>`, in <runs>/<rung>-s<seed> (its command in
<rung>-s<seed>.cmd beside it; one --runs folder per store); a run folder with a summary.json is read
back, not retrained.

Per rung: the held-out chain accept length per seed (1 + sum_k share of positions whose drafts
1..k all equal the verifier's top-1), and against the rung it builds on, per seed, the difference
on the same positions with its standard error clustered by conversation (evaluation/paired.py);
over the seeds, the mean difference and its standard error from the seeds' spread (training noise
and evaluation noise together; with two seeds, half their distance). A rung's speed is recorded only
when it trained alone (--jobs 1).
Results: bench/results/levers2.json and the table bench/results/levers2.md.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.recipe import PEER, SHARED, STEADY_FROM, write_report
from evaluation.paired import HeldoutSums, paired_difference
from infra import REPO_ROOT
from train.metrics import read_jsonl

RUNS = REPO_ROOT / "runs" / "bench-levers2"
OUT = REPO_ROOT / "bench" / "results" / "levers2.json"
SAMPLES = "heldout_samples.json"     # train/run_folder.py HELDOUT_SAMPLES


@dataclass(frozen=True)
class Rung:
    name: str
    parent: str | None          # the rung it is compared with (its overrides come first)
    overrides: tuple[str, ...]
    lever: str                  # what this rung changes, in words


RUNGS = [
    # The recipe before this ladder, pinned (the defaults have since moved to what it kept).
    Rung("base", None, ("train.lr=1.0e-3", "train.grad_clip=0.5"),
         "the defaults before this ladder (lr 1e-3, gradient norm clipped at 0.5)"),
    Rung("lk", "base", ("train.loss.acceptance=lk",), "+ LK alpha: -log sum min(p, q), beside the soft CE (weight 1)"),
    Rung("lk-lambda", "base", ("train.loss.acceptance=hybrid", "train.loss.acceptance_weight=3.0"),
         "LK lambda: lambda CE + (1 - lambda) TV, lambda = exp(-eta alpha) per position, eta 3"),
    Rung("init-verifier", "base", ("train.init_from_verifier=7",),
         "draft layer from the verifier's: layer 7's attention and norms, layer 0's dense MLP, fc on the last aux state"),
    Rung("lr2e-3", "base", ("train.lr=2.0e-3",), "lr 2e-3"),
    Rung("lr3e-3", "base", ("train.lr=3.0e-3",), "lr 3e-3"),
    Rung("lr5e-3", "base", ("train.lr=5.0e-3",), "lr 5e-3"),
    # On the lr that paid: the levers that might add to it.
    Rung("lr3e-3-lk-lambda", "lr3e-3", ("train.loss.acceptance=hybrid", "train.loss.acceptance_weight=3.0"),
         "lr 3e-3 + LK lambda (eta 3)"),
    Rung("lr3e-3-warmup5", "lr3e-3", ("train.warmup_steps=5",), "lr 3e-3 + 5 warm-up steps"),
    Rung("lr3e-3-aux-noise", "lr3e-3", ("train.aux_noise=0.05",), "lr 3e-3 + aux-state noise 0.05"),
    Rung("lr3e-3-decay1", "lr3e-3", ("train.ttt.decay=1.0",), "lr 3e-3 + TTT steps weighed equally (not 0.8^k)"),
    Rung("lr3e-3-decay0.6", "lr3e-3", ("train.ttt.decay=0.6",), "lr 3e-3 + TTT step k weighs 0.6^k (not 0.8^k)"),
    Rung("lr3e-3-ttt6", "lr3e-3", ("train.ttt.steps=6",), "lr 3e-3 + 6 TTT steps trained, 4 evaluated"),
    Rung("lr3e-3-min-lr0", "lr3e-3", ("train.min_lr_ratio=0.0",), "lr 3e-3 + cosine to 0 (not 0.1 x lr)"),
    Rung("lr3e-3-clip1", "lr3e-3", ("train.grad_clip=1.0",), "lr 3e-3 + gradient norm clipped at 1.0 (not 0.5)"),
    Rung("lr3e-3-clip0.25", "lr3e-3", ("train.grad_clip=0.25",), "lr 3e-3 + gradient norm clipped at 0.25 (not 0.5)"),
    Rung("lr3e-3-clip0.1", "lr3e-3", ("train.grad_clip=0.1",), "lr 3e-3 + gradient norm clipped at 0.1 (not 0.5)"),
]
BY_NAME = {r.name: r for r in RUNGS}


def overrides_of(name: str) -> list[str]:
    rung = BY_NAME[name]
    return (overrides_of(rung.parent) if rung.parent else []) + list(rung.overrides)


def run_dir(runs: Path, name: str, seed: int) -> Path:
    return runs / f"{name}-s{seed}"


def train_run(runs: Path, name: str, seed: int, store: Path, jobs: int, fresh: bool) -> Path:
    out = run_dir(runs, name, seed)
    if (out / "summary.json").exists() and not fresh:
        return out
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    if jobs > 1:
        (out / SHARED).touch()
    cmd = [sys.executable, "-m", "train", f"store_dir={store}", *PEER, *overrides_of(name), f"seed={seed}",
           f"train.threads={2 if jobs == 1 else 1}", f"hydra.run.dir={out}"]
    (runs / f"{out.name}.cmd").write_text(f"cd {REPO_ROOT} && " + " ".join(cmd) + "\n")
    began = time.perf_counter()
    with open(runs / f"{out.name}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    (out / "wall_s.txt").write_text(f"{time.perf_counter() - began:.1f}\n")
    return out


def run_figures(out: Path) -> dict[str, Any]:
    train = read_jsonl(out / "metrics.jsonl", "train")
    last = read_jsonl(out / "metrics.jsonl", "heldout")[-1]
    steady = [r["tokens_per_s"] for r in train if r["step"] >= STEADY_FROM]
    K = sum(1 for key in last if key.startswith("acc_"))
    return {"chain_accept_length": last["chain_accept_length"], "top1": [last[f"acc_{k}"] for k in range(K)],
            "heldout_positions": last["tokens_counted"],
            "tokens_per_s_steady_median": None if (out / SHARED).exists() else statistics.median(steady),
            "peak_rss_gib": max(r["peak_rss_bytes"] for r in train) / 1024 ** 3}


def rung_figures(runs: Path, name: str, seeds: list[int], compared: bool) -> dict[str, Any]:
    """compared: its parent was run too (a rung asked for brings its parent, not the parent's)."""
    rung = BY_NAME[name]
    figures = {s: run_figures(run_dir(runs, name, s)) for s in seeds}
    out: dict[str, Any] = {"lever": rung.lever, "parent": rung.parent, "overrides": overrides_of(name),
                           "seeds": {str(s): r for s, r in figures.items()},
                           "chain_accept_mean": statistics.mean(r["chain_accept_length"] for r in figures.values())}
    if rung.parent is None or not compared:
        return out
    diffs = {s: paired_difference(HeldoutSums.read(run_dir(runs, name, s) / SAMPLES),
                                  HeldoutSums.read(run_dir(runs, rung.parent, s) / SAMPLES)) for s in seeds}
    values = [d.diff for d in diffs.values()]
    out["vs_parent"] = {str(s): d.to_json() for s, d in diffs.items()}
    out["delta_mean"] = statistics.mean(values)
    out["delta_se_seeds"] = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    out["delta_se_clustered"] = math.sqrt(sum(d.se_clustered ** 2 for d in diffs.values())) / len(diffs)
    return out


def table(report: dict[str, Any]) -> str:
    seeds = report["seeds"]
    lines = ["| rung | vs | lever | chain accept per seed | mean | delta per seed (clustered s.e.) | "
             "mean delta (s.e. over seeds) | tokens/s | peak RSS GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["rungs"].items():
        per_seed = " / ".join(f"{r['seeds'][str(s)]['chain_accept_length']:.3f}" for s in seeds)
        speeds = [r["seeds"][str(s)]["tokens_per_s_steady_median"] for s in seeds]
        speed = " / ".join("-" if v is None else f"{v:.0f}" for v in speeds)
        rss = max(r["seeds"][str(s)]["peak_rss_gib"] for s in seeds)
        if "vs_parent" in r:
            deltas = " / ".join(f"{r['vs_parent'][str(s)]['diff']:+.3f} ({r['vs_parent'][str(s)]['se_clustered']:.3f})"
                                for s in seeds)
            se = r["delta_se_seeds"]
            mean = f"{r['delta_mean']:+.3f} ({'-' if se is None else f'{se:.3f}'})"
        else:
            deltas, mean = "", ""
        lines.append(f"| {name} | {r['parent'] or ''} | {r['lever']} | {per_seed} | {r['chain_accept_mean']:.3f} "
                     f"| {deltas} | {mean} | {speed} | {rss:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=REPO_ROOT / "runs" / "store" / "kimi-tiny-sharegpt_subset")
    parser.add_argument("--rungs", nargs="*", default=[r.name for r in RUNGS])
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1])
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once (1 thread each when > 1)")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--runs", type=Path, default=RUNS, help="the run folders (one set per store)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    unknown = [n for n in args.rungs if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown rungs {unknown}; known: {list(BY_NAME)}")
    wanted = list(dict.fromkeys(p for n in args.rungs for p in (BY_NAME[n].parent, n) if p))
    jobs = [(n, s) for n in wanted for s in args.seeds]
    runs = args.runs.resolve()
    runs.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda job: train_run(runs, *job, args.store.resolve(), args.jobs, args.fresh), jobs))
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    report |= {"what": __doc__.splitlines()[0], "store": str(args.store), "runs": str(runs), "peer": PEER,
               "seeds": args.seeds, "steady_from_step": STEADY_FROM}
    rows = report.setdefault("rungs", {})
    for name in wanted:
        rows[name] = rung_figures(runs, name, args.seeds, BY_NAME[name].parent in wanted)
    report["rungs"] = {r.name: rows[r.name] for r in RUNGS if r.name in rows}
    write_report(args.out, report, table(report))
    return report


if __name__ == "__main__":
    main()
