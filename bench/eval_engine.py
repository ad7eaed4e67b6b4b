"""How the evaluation's engines run, timed on one draft: `python -m bench.eval_engine --draft <folder>`.

    .venv/bin/python -m bench.eval_engine --draft runs/demo/train/draft [--out bench/results/eval_dtype.json]

Runs `python -m evaluation` on the same draft three times, one after another, each as the user
would (its own process, its own engines):
- float32, processes: the speculative engine decodes in conf/engine's dtype (`decode_dtype=engine`)
  and vLLM runs its engine core and worker in processes of their own (`engine.in_process=false`);
- bfloat16, processes: `decode_dtype=auto` (bfloat16 on a CPU with bf16 units), processes as before;
- bfloat16, in process: `decode_dtype=auto` with the engines in the calling process (the defaults).
For each: the stage's wall time, the speculative call's wall time, and vLLM's and the simulation's
accept lengths per category. On a CPU without bf16 units `auto` is float32 and the first two rows
are the same setting. Nothing else should run on the machine meanwhile.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.demo import eval_figures
from bench.machine import machine
from infra import REPO_ROOT

OUT = REPO_ROOT / "bench" / "results" / "eval_dtype.json"
RUNS = REPO_ROOT / "runs" / "bench-eval-engine"
VARIANTS = {
    "float32_processes": ["decode_dtype=engine", "engine.in_process=false"],
    "bfloat16_processes": ["decode_dtype=auto", "engine.in_process=false"],
    "bfloat16_in_process": ["decode_dtype=auto", "engine.in_process=true"],
}


def run_variant(name: str, overrides: list[str], draft: Path) -> dict[str, Any]:
    out_dir = RUNS / name
    cmd = [sys.executable, "-m", "evaluation", f"draft_dir={draft}", f"hydra.run.dir={out_dir}", "card=false",
           "plot=false", *overrides]
    print(f"bench.eval_engine: {name}: {' '.join(cmd[1:])}", flush=True)
    began = time.perf_counter()
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - began
    report = json.loads((out_dir / "eval.json").read_text())
    categories = eval_figures(out_dir)["categories"]
    speculative_s = next(iter(report["categories"].values()))["real"]["greedy"]["wall_s"]  # one call for all
    return {"overrides": overrides, "decode_dtype": report["decode_dtype"], "stage_s": wall,
            "speculative_call_s": speculative_s, "categories": categories}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", type=Path, required=True, help="an exported draft folder")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    runs = {name: run_variant(name, overrides, args.draft.resolve()) for name, overrides in VARIANTS.items()}
    base = runs["float32_processes"]["stage_s"]
    report = {"what": __doc__.splitlines()[0], "command": f"python -m bench.eval_engine --draft {args.draft}",
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine(), "runs": runs,
              "stage_s_over_float32_processes": {name: r["stage_s"] / base for name, r in runs.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, r in runs.items():
        print(f"bench.eval_engine: {name}: {r['stage_s']:.0f} s (speculative call {r['speculative_call_s']:.0f} s), "
              + "; ".join(f"{c}: vLLM {v['vllm_greedy']:.3f} / {v['vllm_sampled']:.3f}" for c, v in r["categories"].items()))
    return report


if __name__ == "__main__":
    main()
