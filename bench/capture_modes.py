"""`make bench-capture`: the capture engine eager (the CPU config) against compiled (the GPU
config's enforce_eager false), on this machine.

The capture switches vLLM's aux outputs on before the model is traced (dump/capture.py), so it
does not need eager mode; this shows what each mode costs. Both on the same prompts, one engine
after the other: engine start-up, vLLM prefill alone (max_tokens=1, capture disarmed) and prefill
with capture, medians of rounds. Writes bench/results/capture_modes.json.
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from typing import Any

import infra

infra.configure_environment()  # offline hubs, caches in the repo: before transformers loads below


from bench.dump import prompt_bench_args, prompts_of, timed  # noqa: E402
from dump.capture import HiddenStateCapture, capture_spec, start_capture_engine  # noqa: E402
from dump.engine import shutdown_llm  # noqa: E402
from config import compose_config  # noqa: E402
from model.verifier_handle import Verifier  # noqa: E402

# Eager: the CPU config as `make dump` runs it. Compiled: the GPU config's setting
# (enforce_eager false) with vLLM's default compilation, which on CPU also fixes the rotary op.
MODES = {
    "eager": ["engine.enforce_eager=true"],
    "compiled": ["engine.enforce_eager=false", "engine.compilation_config=null"],
}


def measure(mode: str, prompts: list[list[int]], rounds: int) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt

    cfg = compose_config("dump", MODES[mode])
    verifier = Verifier.from_conf(cfg.verifier)
    spec = capture_spec(verifier)
    began = time.perf_counter()
    llm = start_capture_engine(verifier.path, cfg.engine, spec, int(cfg.max_len),
                               trust_remote_code=cfg.verifier.trust_remote_code)
    start_s = time.perf_counter() - began
    try:
        capture = HiddenStateCapture(llm, spec)

        def prefill_only() -> None:
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                         SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)

        prefill_only()  # warm-up (compiled: the first shapes)
        prefill_s, capture_s = [], []
        for _ in range(rounds):
            prefill_s.append(timed(prefill_only))
            capture_s.append(timed(lambda: capture.capture(prompts)))
    finally:
        shutdown_llm(llm)
    return {"engine_start_s": start_s, "prefill_s": prefill_s, "capture_s": capture_s,
            "prefill_median_s": statistics.median(prefill_s), "capture_median_s": statistics.median(capture_s)}


def main() -> None:
    args = prompt_bench_args(__doc__, 16, "bench/results/capture_modes.json")
    cfg = compose_config("dump")
    tokenizer = Verifier.from_conf(cfg.verifier).tokenizer()
    prompts = [[int(t) for t in s.input_ids] for s in prompts_of(cfg, args.samples, tokenizer)]
    tokens = sum(len(p) for p in prompts)
    runs = {mode: measure(mode, prompts, args.rounds) for mode in MODES}
    eager, compiled = runs["eager"], runs["compiled"]
    result = {
        "what": "capture engine eager vs compiled on the same prompts: prefill alone and prefill with "
                "capture, medians of rounds; ratios eager / compiled (above 1: eager is slower)",
        "command": "make bench-capture  (python -m bench.capture_modes " + " ".join(sys.argv[1:]) + ")",
        "machine": platform.processor() or platform.machine(),
        "verifier": cfg.verifier.name,
        "samples": len(prompts),
        "tokens": tokens,
        "rounds": args.rounds,
        "prefill_tokens_per_s": {m: tokens / r["prefill_median_s"] for m, r in runs.items()},
        "capture_tokens_per_s": {m: tokens / r["capture_median_s"] for m, r in runs.items()},
        "eager_over_compiled_prefill_time": eager["prefill_median_s"] / compiled["prefill_median_s"],
        "eager_over_compiled_capture_time": eager["capture_median_s"] / compiled["capture_median_s"],
        "capture_over_prefill_time": {m: r["capture_median_s"] / r["prefill_median_s"] for m, r in runs.items()},
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
