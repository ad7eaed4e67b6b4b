"""`make demo`: the whole pipeline on the embedded default, timed stage by stage.

    .venv/bin/python -m bench.demo [--out bench/results/demo.json]

Runs the three commands a user would (`python -m dump`, `python -m train`, `python -m evaluation`,
each with its defaults but one: training evaluates its held-out set once, at the end
(`eval.every=0`; the default also does every 100 steps), since a pass is a forward over about as
many tokens as the training split holds and the demo reports the last one only) into fixed
folders, runs/demo/{dump,train,eval}, with the store at the dump's default output_dir, so that
running it again resumes: the dump skips the samples it stored and training continues from its
newest checkpoint. Prints each stage's wall time, then writes bench/results/demo.json: stage
times, the store's size, the trainer's held-out figures, tokens/s and peak RSS, and the
evaluation's accept lengths per category (vLLM and simulated, greedy and sampled) with the
proposal method, next to the verifier's held-out perplexity (which the draft cannot change: it
comes from the verifier's training log).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.machine import machine
from infra import REPO_ROOT, resolve
from config import compose_config
from train.metrics import read_jsonl

DEMO = REPO_ROOT / "runs" / "demo"
OUT = REPO_ROOT / "bench" / "results" / "demo.json"


def stage(name: str, args: list[str], times: dict[str, float]) -> None:
    cmd = [sys.executable, "-m", *args]
    print(f"make demo: {name}: {' '.join(args)}", flush=True)
    began = time.perf_counter()
    subprocess.run(cmd, cwd=REPO_ROOT, check=True)
    times[name] = time.perf_counter() - began
    print(f"make demo: {name} done in {times[name]:.0f} s", flush=True)


def verifier_perplexity() -> float:
    verifier = resolve(compose_config("train").verifier.path)
    facts = json.loads((verifier / "training_log.json").read_text())["facts"]
    return math.exp(facts["heldout_loss"])


def store_figures(store: Path) -> dict[str, Any]:
    from store import StoreReader

    reader = StoreReader(store)
    tokens = sum(ref.num_tokens for ref in reader.samples())
    return {"path": str(store.relative_to(REPO_ROOT)), "samples": len(reader.samples()), "tokens": tokens,
            "bytes": sum(p.stat().st_size for p in store.rglob("*") if p.is_file())}


def train_figures(run: Path) -> dict[str, Any]:
    train = read_jsonl(run / "metrics.jsonl", "train")
    heldout = read_jsonl(run / "metrics.jsonl", "heldout")[-1]
    steady = sorted(r["tokens_per_s"] for r in train if r["step"] > 10)
    K = sum(1 for key in heldout if key.startswith("acc_"))
    return {"steps": len(train), "tokens": sum(r["tokens"] for r in train),
            "tokens_per_s_steady_median": steady[len(steady) // 2] if steady else None,
            "peak_rss_bytes": max((r.get("peak_rss_bytes") or 0) for r in train) or None,
            "heldout_chain_accept_length": heldout["chain_accept_length"],
            "heldout_top1": [heldout[f"acc_{k}"] for k in range(K)]}


def eval_figures(run: Path) -> dict[str, Any]:
    report = json.loads((run / "eval.json").read_text())
    out: dict[str, Any] = {"draft_sample": report["draft_sample"], "decode_dtype": report["decode_dtype"],
                           "sampled": report["sampled"],
                           "max_tokens": report["max_tokens"], "categories": {}}
    for name, cat in report["categories"].items():
        row = {"benchmark": cat["benchmark"], "prompts": cat["n"]}
        for mode in ("greedy", "sampled"):
            real = cat.get("real", {}).get(mode)
            sim = cat.get("sim", {}).get(mode)
            row[f"vllm_{mode}"] = real["accept_length"] if real else None
            row[f"sim_{mode}"] = sim["accept_length"] if sim else None
            if real and sim:
                row[f"sim_over_vllm_{mode}"] = sim["accept_length"] / real["accept_length"]
        out["categories"][name] = row
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    times: dict[str, float] = {}
    began = time.perf_counter()
    store = resolve(compose_config("dump").output_dir)
    stage("dump", ["dump", f"hydra.run.dir={DEMO / 'dump'}"], times)
    stage("train", ["train", "eval.every=0", f"hydra.run.dir={DEMO / 'train'}"], times)
    stage("eval", ["evaluation", f"draft_dir={DEMO / 'train' / 'draft'}", f"hydra.run.dir={DEMO / 'eval'}"], times)
    times["total"] = time.perf_counter() - began
    report = {"what": __doc__.splitlines()[0], "command": "make demo",
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine(), "stage_seconds": times,
              "store": store_figures(store), "train": train_figures(DEMO / "train"),
              "eval": eval_figures(DEMO / "eval"), "verifier_heldout_perplexity": verifier_perplexity()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("make demo: stage times " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
    for name, row in report["eval"]["categories"].items():
        print(f"make demo: {name}: vLLM greedy {row['vllm_greedy']}, sampled {row['vllm_sampled']}; "
              f"simulated greedy {row['sim_greedy']}, sampled {row['sim_sampled']}")
    print(f"make demo: report {args.out.relative_to(REPO_ROOT)}, draft {DEMO / 'train' / 'draft'}")
    return report


if __name__ == "__main__":
    main()
