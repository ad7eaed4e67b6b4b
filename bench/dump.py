"""`make bench-dump`: what capturing and storing costs next to vLLM's own prefill.

One engine, the same tokenized prompts, alternating rounds of
  - baseline: vLLM prefill only (max_tokens=1, capture hooks disarmed),
  - dump: the same prefill with capture, then the store writer (lossless, then fp8) committing
    the samples to disk, as `python -m dump` does (regeneration off: it is generation, not dump),
and the median of each. Writes bench/results/dump.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from itertools import islice
from pathlib import Path

import infra

infra.configure_environment()  # offline hubs, caches in the repo: before transformers loads below

import psutil  # noqa: E402

from data.conversations import load_conversations  # noqa: E402
from data.template import SampleRejected, tokenize_conversation  # noqa: E402
from dump.capture import HiddenStateCapture, capture_spec, start_capture_engine  # noqa: E402
from dump.engine import shutdown_llm  # noqa: E402
from infra import REPO_ROOT  # noqa: E402
from config import compose_config  # noqa: E402
from model.verifier_handle import Verifier  # noqa: E402
from store import StoreWriter, inspect_store  # noqa: E402


class PeakRSS:
    """Peak resident memory of this process and its children (vLLM's engine), polled."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(interval_s,), daemon=True)

    def _poll(self, interval_s: float) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            procs = [me, *me.children(recursive=True)]
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(interval_s)

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def prompts_of(cfg, n: int, tokenizer) -> list:
    samples = []
    for conv in load_conversations(cfg.data, "train"):
        try:
            samples.append(tokenize_conversation(tokenizer, conv, cfg.max_len, cfg.over_long))
        except SampleRejected:
            continue
        if len(samples) == n:
            break
    return samples


def prompt_bench_args(doc: str, samples: int, out: str) -> argparse.Namespace:
    """--samples, --rounds and --out, the arguments of the benchmarks that prefill prompts."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--samples", type=int, default=samples)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / out)
    return parser.parse_args()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    args = prompt_bench_args(__doc__, 48, "bench/results/dump.json")

    cfg = compose_config("dump")
    verifier = Verifier.from_conf(cfg.verifier)
    tokenizer = verifier.tokenizer()
    samples = prompts_of(cfg, args.samples, tokenizer)
    tokens = sum(len(s.input_ids) for s in samples)
    prompts = [[int(t) for t in s.input_ids] for s in samples]
    identity = verifier.identity
    aux_ids = list(verifier.aux_layer_ids)              # vLLM's convention, as the writer is told
    hidden = identity["hidden_size"]
    work = Path(tempfile.mkdtemp(prefix="bench-dump-"))

    from vllm import SamplingParams, TokensPrompt

    def prefill_only() -> None:
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                     SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)

    def dump_into(mode: str, round_: int) -> Path:
        store = work / f"{mode}-{round_}"
        storage = compose_config("dump", [f"store={'lossless' if mode == 'bf16' else mode}"]).store
        writer = StoreWriter(store, identity, aux_ids, storage, aux_convention="vllm")
        for sample, states in zip(samples, capture.capture(prompts)):
            writer.add(sample.id, sample.input_ids, sample.loss_mask, states.aux, states.final)
        writer.close()
        return store

    with PeakRSS() as rss:
        spec = capture_spec(verifier)
        llm = start_capture_engine(verifier.path, cfg.engine, spec, cfg.max_len,
                                   trust_remote_code=cfg.verifier.trust_remote_code)
        capture = HiddenStateCapture(llm, spec)
        prefill_only()  # warm-up
        base_s, dump_s, fp8_s = [], [], []
        for r in range(args.rounds):
            base_s.append(timed(prefill_only))
            dump_s.append(timed(lambda: dump_into("bf16", r)))
            fp8_s.append(timed(lambda: dump_into("fp8", r)))
        shutdown_llm(llm)
    reports = {m: inspect_store(work / f"{m}-0", verify=False) for m in ("bf16", "fp8")}
    public = 4 * hidden * 2  # 3 aux + final in bf16, uncompressed: what public tools store
    base_tps = tokens / statistics.median(base_s)
    result = {
        "what": "dump tokens/s vs vLLM prefill-only on the same prompts and engine; bytes/token "
                "vs the uncompressed bf16 4*H*2 of public tools; medians of rounds",
        "verifier": identity["name"], "hidden_size": hidden, "samples": len(samples),
        "tokens": tokens, "rounds": args.rounds, "engine": cfg.engine.name,
        "prefill_tokens_per_s": base_tps,
        "dump_tokens_per_s": tokens / statistics.median(dump_s),
        "dump_fp8_tokens_per_s": tokens / statistics.median(fp8_s),
        "dump_over_prefill": (tokens / statistics.median(dump_s)) / base_tps,
        "dump_fp8_over_prefill": (tokens / statistics.median(fp8_s)) / base_tps,
        "bytes_per_token_lossless": reports["bf16"]["bytes_per_token"],
        "bytes_per_token_fp8": reports["fp8"]["bytes_per_token"],
        "public_bytes_per_token": public,
        "lossless_over_public": reports["bf16"]["bytes_per_token"] / public,
        "fp8_over_public": reports["fp8"]["bytes_per_token"] / public,
        "peak_rss_bytes": rss.peak,
        "raw_seconds": {"prefill": base_s, "dump": dump_s, "dump_fp8": fp8_s},
    }
    shutil.rmtree(work)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "raw_seconds"}, indent=2))


if __name__ == "__main__":
    main()
