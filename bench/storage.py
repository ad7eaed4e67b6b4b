"""Storage modes judged by what they cost the draft: `make bench-storage [ARGS=...]`.

    .venv/bin/python -m bench.storage [--source STORE] [--modes lossless fp8 fp4 compact]
        [--train-steps 100] [--vllm-modes lossless compact] [--kimi-tokens 4096] [--out bench/results/storage.json]

1. The source: an fp32 store of the default data (`make dump`'s conversations, answers as
   written so that building it takes minutes, not the half hour of regeneration), dumped by
   vLLM once under runs/bench-storage/source unless --source names one. Every mode is written
   from it by `python -m dump transcode`, so all modes hold the same samples, and the writer's
   encode throughput is measured there (the capture before it is the same for every mode).
2. Per mode: bytes on disk per token and per array (`python -m dump inspect`'s figures), the
   ratio to 4 x H x 2 (what public tools write: three aux states and the final one in bf16), the
   same figure computed for Kimi's H = 7168 from the measured bytes per stored value, and the
   reader's tokens/s (StoreReader.read_sample, decoded to bf16, one process).
3. Per mode, the same training (`python -m train`: same rows, steps, seed and recipe; only the
   store differs), then (a) the simulated greedy accept length (3 drafts, topk 1) of the exported
   draft on the trainer's held-out samples read from the LOSSLESS store, so every draft meets the
   same exact aux states, as at serving time; (b) for the --vllm-modes, `python -m evaluation` on
   the draft, greedy: vLLM's accept length per category, and the simulation on its own texts;
   (c) every draft's greedy simulation on the texts of the lossless draft's evaluation (greedy
   speculative decoding writes the verifier's own greedy text whatever the draft): 24 held-out
   prompts per category, the same for every mode. Deltas are against the lossless mode of the
   same run; `--resimulate` redoes (a)'s trainer figures and (c) from the drafts left behind.
   On a CPU training runs in fp32 (bf16 without bf16 matmul units is ~25x slower).
4. Kimi-K2 shapes: a synthetic store (H = 7168, 3 aux states, outliers in a few channels) per
   mode, read back: reader tokens/s against an upper bound of the trainer's tokens/s at the
   Kimi-K2 draft's shapes (the datasheet bf16 peak of an H200 / the draft's model FLOPs per token,
   bench/gpu_train.py: a trainer at 100% MFU), and the reader processes that keep 10x ahead of it.

Results: bench/results/storage.json and the table bench/results/storage.md.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import infra
from infra import REPO_ROOT
from config import compose_config

infra.configure_environment()

WORK = REPO_ROOT / "runs/bench-storage"
RESULTS = REPO_ROOT / "bench/results/storage.json"
TABLE = REPO_ROOT / "bench/results/storage.md"
KIMI_H = 7168
N_AUX = 3
PY = sys.executable


def run(cmd: list[str], log: Path) -> None:
    """A stage as its own process (the engines and DeepSpeed keep global state), logged to a file."""
    print("+", " ".join(cmd), f"(log {log.relative_to(REPO_ROOT)})", flush=True)
    with log.open("w") as out:
        done = subprocess.run(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}; see {log}")


# ---- 1. source -----------------------------------------------------------------------------
def build_source(path: Path) -> None:
    run([PY, "-m", "dump", "store=fp32", "regenerate.enabled=false", f"output_dir={path}",
         f"hydra.run.dir={WORK / 'logs/dump'}"], WORK / "dump.log")


# ---- 2. bytes and reading ------------------------------------------------------------------
def store_figures(path: Path, hidden: int) -> dict[str, Any]:
    """Bytes per token (total, per array), per stored value, and the figure at Kimi's width."""
    from store import StoreReader, inspect_store

    report = inspect_store(path)
    if report["problems"]:
        raise SystemExit(f"store {path} does not verify: {report['problems'][:3]}")
    reader = StoreReader(path)
    tokens = sum(ref.num_tokens for ref in reader.samples())
    arrays = {name: figures["bytes"] for name, figures in report["arrays"].items()}
    total = sum(path.joinpath(*p.parts).stat().st_size for p in _files(path))
    return {"tokens": tokens, "bytes": total, "bytes_per_token": total / tokens,
            "array_bytes_per_token": {name: b / tokens for name, b in arrays.items()},
            "kimi_bytes_per_token": kimi_width(arrays, tokens, hidden, reader.aux_encoding),
            "reference_bytes_per_token": (N_AUX + 1) * hidden * 2}


def _files(path: Path) -> list[Path]:
    return [p.relative_to(path) for p in path.rglob("*") if p.is_file()]


def kimi_width(array_bytes: dict[str, int], tokens: int, hidden: int, aux_encoding: str) -> float:
    """Bytes per token at H = 7168: arrays whose size grows with H (the hidden states; fp4's
    scales, one per block of H) scale by 7168 / H at the measured bytes per value; the others
    (ids, mask, offsets, fp8's per-token scales, top-k targets) do not depend on H."""
    grows = {"aux_hidden", "final_hidden"} | ({"aux_scale"} if aux_encoding == "fp4" else set())
    return sum(b / tokens * (KIMI_H / hidden if name in grows else 1.0) for name, b in array_bytes.items())


def read_tokens_per_s(path: Path, repeats: int = 3) -> float:
    """StoreReader.read_sample over every sample, decoded to bf16 (what the trainer reads): the
    median of `repeats` passes, each with a fresh reader (no Zarr metadata cached)."""
    from store import StoreReader

    rates = []
    for _ in range(repeats):
        reader = StoreReader(path)
        refs = reader.samples()
        start = time.perf_counter()
        for ref in refs:
            reader.read_sample(ref, torch.bfloat16)
        rates.append(sum(r.num_tokens for r in refs) / (time.perf_counter() - start))
    return statistics.median(rates)


# ---- 3. the draft each store trains -----------------------------------------------------------
def train_draft(mode: str, store: Path, steps: int, extra: list[str]) -> Path:
    run_dir = WORK / "train" / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    run([PY, "-m", "train", f"store_dir={store}", f"train.steps={steps}", "train.resume=null",
         f"eval.every={steps}", f"hydra.run.dir={run_dir}", *extra], WORK / f"train-{mode}.log")
    return run_dir


def heldout_metrics(run_dir: Path) -> dict[str, Any]:
    from train.metrics import read_jsonl

    rows = read_jsonl(run_dir / "metrics.jsonl", "heldout")
    return rows[-1] if rows else {}


def simulate_heldout(draft_dir: Path, lossless: Path) -> dict[str, Any]:
    """Greedy simulated accept length (3 drafts) on the trainer's held-out samples of the lossless
    store, whatever store the draft was trained on."""
    from evaluation.simulate import simulate_store
    from train.batches import StoreSplit

    cfg = compose_config("train", [])
    split = StoreSplit.open(lossless, float(cfg.eval.heldout_fraction), int(cfg.eval.heldout_seed))
    draft, head, chunk = _draft_and_head(draft_dir)
    with torch.no_grad():
        result = simulate_store(draft, head, split.reader, 3, None, chunk, refs=split.heldout).summary()
    return {"samples": result["samples"], "answer_tokens": result["answer_tokens"],
            "greedy_accept_length": result["greedy"]["accept_length"],
            "greedy_all_positions_accept_length": result["greedy_all_positions"]["accept_length"]}


def _draft_and_head(draft_dir: Path) -> tuple[Any, torch.Tensor, int]:
    """The exported draft, the verifier's lm_head [V, H] and the rows of one 128 MB logits block."""
    from model.checkpoint import load_draft
    from model.verifier_handle import Verifier

    verifier = Verifier.from_conf(compose_config("train", []).verifier)
    head = verifier.lm_head(torch.float32)
    return load_draft(draft_dir, verifier=verifier).eval(), head, max(1, (128 << 20) // (4 * head.shape[0]))


def vllm_eval(mode: str, draft_dir: Path) -> dict[str, Any]:
    run_dir = WORK / "eval" / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    run([PY, "-m", "evaluation", f"draft_dir={draft_dir}", "sampled.enabled=false", "card=false",
         "plot=false", f"hydra.run.dir={run_dir}"], WORK / f"eval-{mode}.log")
    report = json.loads((run_dir / "eval.json").read_text())
    out = {}
    for name, cat in report["categories"].items():
        out[name] = {"vllm": cat["real"]["greedy"]["accept_length"],
                     "simulated": cat["sim"]["greedy"]["accept_length"]}
    return out


# ---- 4. Kimi-K2 shapes ----------------------------------------------------------------------
def synthetic_store(path: Path, mode: str, tokens: int, seed: int = 0) -> Path:
    """`tokens` tokens of Kimi-width states (8 samples) in `mode`: Gaussian values with four
    channels 100x larger (the outliers residual streams carry), 70% of tokens loss-masked."""
    from store import StoreWriter

    shutil.rmtree(path, ignore_errors=True)
    g = torch.Generator().manual_seed(seed)
    cfg = compose_config("dump", [f"store={mode}"]).store
    identity = {"name": "synthetic-kimi-width", "hidden_size": KIMI_H, "vocab_size": 8192}
    head = torch.randn(8192, KIMI_H, generator=g) * 0.02 if str(cfg.final) == "topk" else None
    writer = StoreWriter(path, identity, [2, 30, 58], cfg, {"synthetic": True}, aux_convention="vllm",
                         rank=0, world_size=1,
                         target_head=head)
    per_sample = tokens // 8
    with writer:
        for i in range(8):
            aux = torch.randn(per_sample, N_AUX, KIMI_H, generator=g)
            aux[..., :4] *= 100
            final = torch.randn(per_sample, KIMI_H, generator=g)
            mask = torch.rand(per_sample, generator=g) < 0.7
            writer.add(f"s{i}", torch.randint(0, 8192, (per_sample,), generator=g), mask, aux, final)
            writer.commit_if_full()
    return path


def trainer_bound() -> dict[str, Any]:
    """Upper bounds of the Kimi-K2 draft trainer's tokens/s: its model FLOPs per token against an
    H200's datasheet bf16 peak (100% MFU), and against this machine's measured fp32 matmul
    FLOP/s (bench/train.py's matmul_flops: 100% of what this CPU does)."""
    from bench.gpu_train import PEAK_BF16, model_flops, synthetic_batch
    from bench.train import matmul_flops
    from model.draft import DraftConfig, Eagle3Draft

    cfg = compose_config("train", ["verifier=kimi_k2", "draft=kimi_k2"])
    draft_cfg = DraftConfig.from_conf(cfg.draft)
    with torch.device("meta"):
        draft = Eagle3Draft(draft_cfg)
    T = int(cfg.train.max_len)
    batch = synthetic_batch(draft_cfg, T, torch.device("cpu"))
    flops = model_flops(draft, batch, int(cfg.train.ttt.steps)) / T
    name, peak = next((name, flops_) for pattern, name, flops_ in PEAK_BF16 if "H200" in name)
    cpu = matmul_flops(torch.float32, torch.device("cpu"))
    return {"draft": str(cfg.draft.name), "max_len": T, "ttt_steps": int(cfg.train.ttt.steps),
            "model_flops_per_token": flops, "gpu": name, "peak_bf16_flop_per_s": peak,
            "tokens_per_s_at_100pct_mfu": peak / flops, "this_machine_matmul_flop_per_s": cpu,
            "this_machine_tokens_per_s_bound": cpu / flops}


# ---- report --------------------------------------------------------------------------------
def table(report: dict[str, Any]) -> str:
    lines = ["| mode | B/token kimi-tiny (H=256) | ratio | B/token Kimi (H=7168) | ratio "
             "| sim accept dialogue / code | delta | vLLM accept dialogue / code | delta "
             "| sim accept trainer held-out | delta | writer tok/s | reader tok/s | reader tok/s at H=7168 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = list((report["modes"].get("lossless", {}).get("vllm") or {}).keys())   # dialogue, code
    for mode, m in report["modes"].items():
        sims = m.get("simulated_eval_texts") or {}
        sims = {cat: sims[cat] for cat in order + sorted(set(sims) - set(order)) if cat in sims}
        vllm = m.get("vllm") or {}
        held = (m.get("simulated_heldout") or {}).get("greedy_accept_length")
        lines.append(
            f"| {mode} | {m['bytes_per_token']:.0f} | {m['ratio']:.3f} | {m['kimi_bytes_per_token']:.0f} "
            f"| {m['kimi_ratio']:.3f} | {' / '.join(_f(v) for v in sims.values()) or '-'} | {_pct(m.get('sim_delta'))} "
            f"| {' / '.join(_f(v.get('vllm')) for v in vllm.values()) or '-'} | {_pct(m.get('vllm_delta'))} "
            f"| {_f(held)} | {_pct(m.get('sim_heldout_delta'))} "
            f"| {m['writer_tokens_per_s']:.0f} | {m['reader_tokens_per_s']:.0f} "
            f"| {_f(m.get('kimi_reader_tokens_per_s'), 0)} |")
    return "\n".join(lines) + "\n"


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, help="an fp32 (or bf16) store with final states on every row")
    parser.add_argument("--modes", nargs="+", default=["lossless", "fp8", "fp4", "compact"])
    parser.add_argument("--train-steps", type=int, default=100)
    parser.add_argument("--no-train", action="store_true", help="bytes and throughput only")
    parser.add_argument("--vllm-modes", nargs="*", default=["lossless", "compact"],
                        help="modes whose draft `python -m evaluation` measures by vLLM (none: skip)")
    parser.add_argument("--kimi-tokens", type=int, default=4096, help="tokens of the synthetic H=7168 stores")
    parser.add_argument("--resimulate", action="store_true",
                        help="only redo the accept-length figures of the drafts an earlier run left in "
                             "runs/bench-storage (into --out's JSON)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("train_overrides", nargs="*", help="hydra overrides of conf/train.yaml for every mode")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not any(o.startswith("train.precision=") for o in args.train_overrides):
        # A CPU without bf16 matmul units trains bf16 some 25x slower than fp32 (a 2-core x86 here:
        # ~30 against ~800 tokens/s), and the comparison between stores is the same in either.
        args.train_overrides.append("train.precision=fp32")
    if args.resimulate:
        report = json.loads(args.out.read_text())
        add_accept_figures(report)
        _save(report, args.out)
        print(table(report))
        return report
    from dump.transcode import transcode
    from store import StoreReader

    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "logs").mkdir(exist_ok=True)
    source = args.source or WORK / "source"
    if not (source / "store.json").exists():
        build_source(source)
    hidden = StoreReader(source).hidden_size
    modes = list(dict.fromkeys(["lossless", *args.modes]))   # lossless first: the baseline
    report: dict[str, Any] = {
        "command": " ".join([Path(PY).name, "-m", "bench.storage", *(sys.argv[1:] if argv is None else argv)]),
        "machine": platform.machine(), "cpus": torch.get_num_threads(), "torch": torch.__version__,
        "source": str(source), "hidden_size": hidden, "train_steps": None if args.no_train else args.train_steps,
        "train_overrides": args.train_overrides, "modes": {}}
    for mode in modes:
        path = WORK / "stores" / mode
        shutil.rmtree(path, ignore_errors=True)
        summary = transcode(source, path, [f"store={mode}"], progress=False)
        figures = store_figures(path, hidden)
        entry = {**figures, "ratio": figures["bytes_per_token"] / figures["reference_bytes_per_token"],
                 "kimi_ratio": figures["kimi_bytes_per_token"] / ((N_AUX + 1) * KIMI_H * 2),
                 "writer_tokens_per_s": summary["writer_tokens_per_s"],
                 "reader_tokens_per_s": read_tokens_per_s(path)}
        report["modes"][mode] = entry
        print(f"{mode}: {entry['bytes_per_token']:.0f} B/token ({entry['ratio']:.3f}x), at H=7168 "
              f"{entry['kimi_bytes_per_token']:.0f} ({entry['kimi_ratio']:.3f}x); writer "
              f"{entry['writer_tokens_per_s']:.0f} tok/s, reader {entry['reader_tokens_per_s']:.0f} tok/s", flush=True)
    bound = trainer_bound()
    report["kimi_shapes"] = {"trainer_bound": bound, "tokens": args.kimi_tokens}
    for mode in modes:
        path = synthetic_store(WORK / "kimi" / mode, mode, args.kimi_tokens)
        tok_s = read_tokens_per_s(path)
        entry = report["modes"][mode]
        entry["kimi_reader_tokens_per_s"] = tok_s
        entry["kimi_reader_over_trainer_bound"] = tok_s / bound["tokens_per_s_at_100pct_mfu"]
        entry["kimi_reader_processes_for_10x"] = math.ceil(10 * bound["tokens_per_s_at_100pct_mfu"] / tok_s)
        entry["kimi_reader_over_this_machine_trainer_bound"] = tok_s / bound["this_machine_tokens_per_s_bound"]
        shutil.rmtree(path, ignore_errors=True)
    _save(report, args.out)
    if not args.no_train:
        lossless = WORK / "stores" / "lossless"
        for mode in modes:
            entry = report["modes"][mode]
            run_dir = train_draft(mode, WORK / "stores" / mode, args.train_steps, args.train_overrides)
            entry["simulated_heldout"] = simulate_heldout(run_dir / "draft", lossless)
            if mode in args.vllm_modes:
                entry["vllm"] = vllm_eval(mode, run_dir / "draft")
            _save(report, args.out)
        add_accept_figures(report)
    _save(report, args.out)
    print(table(report))
    return report


def add_accept_figures(report: dict[str, Any]) -> None:
    """Per mode: the trainer's own held-out figures; the greedy simulation on the texts the
    lossless draft's `python -m evaluation` run had vLLM produce (greedy speculative decoding
    gives the verifier's own greedy text whatever the draft, so these are held-out texts every
    draft can be replayed on: 24 prompts per category, more tokens than the trainer's held-out
    split); deltas against the lossless mode."""
    texts = WORK / "eval" / "lossless" / "stores"
    for mode, entry in report["modes"].items():
        run_dir = WORK / "train" / mode
        entry["train_heldout"] = heldout_metrics(run_dir)
        if texts.is_dir():
            entry["simulated_eval_texts"] = simulate_texts(run_dir / "draft", texts)
    base = report["modes"]["lossless"]
    for entry in report["modes"].values():
        entry["sim_heldout_delta"] = (entry["simulated_heldout"]["greedy_accept_length"]
                                      / base["simulated_heldout"]["greedy_accept_length"] - 1)
        if "simulated_eval_texts" in entry:
            entry["sim_delta"] = _mean(entry["simulated_eval_texts"]) / _mean(base["simulated_eval_texts"]) - 1
        if "vllm" in entry:
            mine = {cat: v["vllm"] for cat, v in entry["vllm"].items()}
            theirs = {cat: v["vllm"] for cat, v in base["vllm"].items()}
            entry["vllm_delta"] = _mean(mine) / _mean(theirs) - 1


def _mean(by_category: dict[str, float]) -> float:
    return sum(by_category.values()) / len(by_category)


def simulate_texts(draft_dir: Path, texts: Path) -> dict[str, float]:
    """Greedy simulated accept length (3 drafts) per category on the stores under `texts`
    (<category>/greedy, written by `python -m evaluation`)."""
    from evaluation.simulate import simulate_store
    from store import StoreReader

    draft, head, chunk = _draft_and_head(draft_dir)
    out = {}
    with torch.no_grad():
        for category in sorted(p.name for p in texts.iterdir() if (p / "greedy").is_dir()):
            reader = StoreReader(texts / category / "greedy")
            out[category] = simulate_store(draft, head, reader, 3, None, chunk).summary()["greedy"]["accept_length"]
    return out


def _save(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    (out.with_suffix(".md")).write_text(table(report))


if __name__ == "__main__":
    main()
