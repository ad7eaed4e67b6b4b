"""The draft recipe at the peer setting, lever by lever: `make bench-recipe [ARGS=...]`.

    .venv/bin/python -m bench.recipe [--store STORE] [--variants NAME ...] [--jobs 2]
        [--fresh] [--out bench/results/recipe.json]

The peer setting: the store `make dump` writes by default (`make demo`'s), the trainer's own
train / held-out split, 100 optimizer steps of 2 packed rows of up to 2,048 tokens (about 3.1k
real tokens), TTT 4, held-out figures for 4 drafts (eval.ttt_steps=4), 2 torch threads, 1 data
worker. Every variant is `python -m train` with the PEER overrides, its lever overrides and
hydra.run.dir=runs/bench-recipe/<name>, so any row can be rerun by hand. A variant whose run
folder already holds a finished summary.json is read back, not retrained (--fresh retrains).

Variants form a ladder: each names the variant it builds on and the overrides it adds, so a
row's delta is one lever's effect. The first rung, `before`, is the code and recipe this project
had before the ladder (commit BEFORE_COMMIT, checked out as a git worktree under runs/), in fp32
(its default bf16 is ~30x slower on a CPU: `before-bf16` times a few steps); `before-head` is the
same recipe on today's code (the code's own speed-ups: attention that skips earlier samples).

Per variant: the held-out chain accept length (1 + sum over k of the share of positions whose
drafts 1..k all equal the verifier's top-1; what vLLM counts for greedy chain drafting) and the
top-1 agreement per TTT position; the steady training tokens/s (median of steps 11-100, alone
on the machine: with --jobs 2 two variants share it and their speed is not recorded); the
trainer process's peak RSS and its RSS at steps 20 and 100 (flat means no growth).
Results: bench/results/recipe.json and the table bench/results/recipe.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra import REPO_ROOT
from train.metrics import read_jsonl

RUNS = REPO_ROOT / "runs" / "bench-recipe"
OUT = REPO_ROOT / "bench" / "results" / "recipe.json"
PEER = ["train.steps=100", "train.grad_accum=2", "train.micro_batch=1", "train.max_len=2048",
        "train.ttt.steps=4", "train.num_workers=1", "eval.ttt_steps=4", "eval.every=100",
        "train.checkpoint_every=100", "seed=0"]
SHARED = "shared_machine"   # marker: trained beside another variant
STEADY_FROM = 11        # first step of the steady-state speed window (warm-up and page faults before)

# The recipe as it stood before this ladder (explicit, so the row keeps its meaning whatever the
# conf defaults become).
BEFORE = ["train.precision=fp32", "train.loss.target_topk=null", "draft.fc_norm=false",
          "draft.norm_output=false", "draft.norm_before_residual=false", "draft.train_norm=false",
          "draft.train_head=false", "train.ttt.decay=0.8", "train.lr=1.0e-3", "draft.draft_vocab_size=null"]


BEFORE_COMMIT = "1fa9cd6"   # the trainer as it stood when the peer comparison was made


@dataclass(frozen=True)
class Variant:
    name: str
    parent: str | None          # the rung it builds on (its overrides come first)
    overrides: tuple[str, ...]
    lever: str                  # what this rung changes, in words
    speed_only: bool = False    # a few steps, for tokens/s only
    commit: str | None = None   # run that commit's code (a worktree), not this checkout's


VARIANTS = [
    Variant("before", None, ("train.precision=fp32",), "the code and recipe before, in fp32",
            commit=BEFORE_COMMIT),
    Variant("before-bf16", None, ("train.precision=bf16", "train.steps=6", "eval.every=0"),
            "the code and recipe before, bf16 (its default; 6 steps, speed only)", speed_only=True,
            commit=BEFORE_COMMIT),
    Variant("before-head", "before", tuple(BEFORE), "the same recipe on today's code"),
    Variant("topk", "before-head", ("train.loss.target_topk=64",),
            "verifier top-64 computed once per micro-batch, bucket CE (speed)"),
    Variant("norms", "before-head", ("draft.fc_norm=true", "draft.norm_output=true", "draft.train_norm=true"),
            "speculators' three: aux states normed before fc, normed hidden fed back, trainable final norm"),
    Variant("norms-decay1", "norms", ("train.ttt.decay=1.0",), "TTT steps weighed equally"),
    Variant("norms-lr3e-3", "norms", ("train.lr=3.0e-3",), "lr 3e-3"),
    Variant("fc_norm", "before-head", ("draft.fc_norm=true",), "RMSNorm per aux state before fc"),
    Variant("norm_output", "fc_norm", ("draft.norm_output=true",), "normed hidden fed back between steps"),
    Variant("train_norm", "norm_output", ("draft.train_norm=true",), "trainable final norm"),
    Variant("norm_before_residual", "train_norm", ("draft.norm_before_residual=true",),
            "residual taken after hidden_norm"),
    Variant("decay1", "train_norm", ("train.ttt.decay=1.0",), "TTT steps weighed equally"),
    Variant("lr3e-3", "train_norm", ("train.lr=3.0e-3",), "lr 3e-3"),
    Variant("vocab4096", "train_norm", ("draft.draft_vocab_size=4096",), "draft vocabulary 4,096 of 8,192"),
    Variant("train_head", "train_norm", ("draft.train_head=true",), "trainable lm_head too"),
    # What this checkout ships: conf/train.yaml and conf/draft as they are (no lever overrides).
    Variant("after", None, (), "today's defaults (conf/train.yaml, conf/draft/kimi_tiny.yaml)"),
    # The issue-21 rungs: the defaults before it (fp32 on every CPU, free micro-batch lengths), and
    # the acceptance terms on today's defaults; a second seed of what is kept.
    Variant("fp32-free", None, ("train.precision=fp32", "train.pad_multiple=1"),
            "the defaults before: fp32 on every CPU, micro-batch lengths free"),
    Variant("tv", "after", ("train.loss.acceptance=tv",), "+ total variation 1 - sum min(p, q)"),
    Variant("lk", "after", ("train.loss.acceptance=lk",), "+ -log sum min(p, q)"),
    Variant("after-seed1", "after", ("seed=1",), "today's defaults, seed 1"),
    Variant("fp32-free-seed1", "fp32-free", ("seed=1",), "the defaults before, seed 1"),
]
BY_NAME = {v.name: v for v in VARIANTS}


def overrides_of(name: str) -> list[str]:
    """The variant's full override list: its ancestors' first, then its own (later ones win). A
    variant of another commit's code takes its own overrides only (that code may lack today's keys)."""
    v = BY_NAME[name]
    inherited = overrides_of(v.parent) if v.parent and not v.commit else []
    return inherited + list(v.overrides)


def code_tree(commit: str | None) -> Path:
    """The folder whose code a variant runs: this checkout, or a worktree of `commit` under runs/."""
    if commit is None:
        return REPO_ROOT
    tree = RUNS / f"tree-{commit}"
    if not (tree / "train").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), commit], cwd=REPO_ROOT, check=True)
    return tree


def train_variant(name: str, store: Path, jobs: int, fresh: bool) -> Path:
    run_dir = RUNS / name
    if (run_dir / "summary.json").exists() and not fresh:
        return run_dir
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    threads = 2 if jobs == 1 else 1
    if jobs > 1:            # its speed is not this recipe's alone
        (run_dir / SHARED).touch()
    cmd = [sys.executable, "-m", "train", f"store_dir={store}", *PEER, *overrides_of(name),
           f"train.threads={threads}", f"hydra.run.dir={run_dir}"]
    tree = code_tree(BY_NAME[name].commit)
    (run_dir.parent / f"{name}.cmd").write_text(f"cd {tree} && " + " ".join(cmd) + "\n")
    began = time.perf_counter()
    with open(run_dir.parent / f"{name}.log", "w") as log:
        subprocess.run(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT, check=True)
    (run_dir / "wall_s.txt").write_text(f"{time.perf_counter() - began:.1f}\n")
    return run_dir


def figures(name: str, run_dir: Path, timed: bool) -> dict[str, Any]:
    """What the table shows, from the run folder's metrics.jsonl and summary.json."""
    train = read_jsonl(run_dir / "metrics.jsonl", "train")
    heldout = read_jsonl(run_dir / "metrics.jsonl", "heldout")
    steady = [r["tokens_per_s"] for r in train if r["step"] >= STEADY_FROM] or [r["tokens_per_s"] for r in train]
    rss = {r["step"]: r.get("rss_bytes") for r in train}      # None from code that did not record it
    v = BY_NAME[name]
    out: dict[str, Any] = {
        "lever": v.lever, "parent": v.parent, "overrides": overrides_of(name), "commit": v.commit,
        "steps": len(train),
        "tokens_per_step_median": statistics.median(r["tokens"] for r in train),
        "tokens_per_s_steady_median": statistics.median(steady) if timed else None,
        "peak_rss_bytes": max((r.get("peak_rss_bytes") or 0) for r in train) or None,
        "rss_bytes_step20": rss.get(20), "rss_bytes_last": rss.get(len(train)),
        "wall_s": float((run_dir / "wall_s.txt").read_text()) if (run_dir / "wall_s.txt").exists() else None,
    }
    if heldout and not v.speed_only:
        last = heldout[-1]
        K = sum(1 for key in last if key.startswith("acc_"))
        out |= {"chain_accept_length": last["chain_accept_length"], "accept_length": last["accept_length"],
                "top1": [last[f"acc_{k}"] for k in range(K)], "heldout_loss": [last.get(f"loss_{k}") for k in range(K)],
                "heldout_positions": last.get("tokens_counted")}
    return out


def table(report: dict[str, Any]) -> str:
    rows = report["variants"]
    lines = ["| variant | builds on | lever | chain accept | delta | top-1 per TTT position | held-out positions | tokens/s | peak RSS GiB | RSS step 20 / last GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    gib = 1024 ** 3
    for name, r in rows.items():
        parent = rows.get(r["parent"]) if r["parent"] else None
        chain = r.get("chain_accept_length")
        delta = (f"{chain - parent['chain_accept_length']:+.3f}"
                 if chain is not None and parent and parent.get("chain_accept_length") is not None else "")
        top1 = " / ".join(f"{a:.3f}" for a in r.get("top1", []))
        speed = f"{r['tokens_per_s_steady_median']:.0f}" if r["tokens_per_s_steady_median"] else "-"
        peak = f"{r['peak_rss_bytes'] / gib:.2f}" if r["peak_rss_bytes"] else "-"
        flat = (f"{r['rss_bytes_step20'] / gib:.2f} / {r['rss_bytes_last'] / gib:.2f}"
                if r["rss_bytes_step20"] and r["rss_bytes_last"] else "-")
        lines.append(f"| {name} | {r['parent'] or ''} | {r['lever']} | {'-' if chain is None else f'{chain:.3f}'} "
                     f"| {delta} | {top1} | {r.get('heldout_positions') or '-'} | {speed} | {peak} | {flat} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=REPO_ROOT / "runs" / "store" / "kimi-tiny-sharegpt_subset")
    parser.add_argument("--variants", nargs="*", default=[v.name for v in VARIANTS])
    parser.add_argument("--jobs", type=int, default=1, help="variants trained at once (1 thread each when > 1)")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    unknown = [n for n in args.variants if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(BY_NAME)}")
    if not (args.store / "store.json").exists():
        parser.error(f"{args.store}: no store (run `make dump` first)")
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = dict(zip(args.variants, pool.map(
            lambda n: train_variant(n, args.store.resolve(), args.jobs, args.fresh), args.variants)))
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    report |= {"what": __doc__.splitlines()[0], "store": str(args.store), "peer": PEER,
               "steady_from_step": STEADY_FROM}
    rows = report.setdefault("variants", {})
    for name, run_dir in runs.items():
        rows[name] = figures(name, run_dir, timed=not (run_dir / SHARED).exists())
    report["variants"] = {v.name: rows[v.name] for v in VARIANTS if v.name in rows}
    write_report(args.out, report, table(report))
    return report


def write_report(out: Path, report: dict[str, Any], text: str) -> None:
    """<out> (JSON) and its table beside it (<out>.md), printed too."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
