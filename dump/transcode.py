"""Re-encode a store in other storage settings: `python -m dump transcode <src> <dst> [overrides]`.

The samples of `src` are read back and written to `dst` with conf/store as composed from the
overrides (`store=compact`, `store.topk=64`, ...), shard by shard through StoreWriter, so `dst`
is what `make dump store=...` would have written from the same engine output: same samples, same
order, same identity. It is how a user shrinks a store already dumped, and how the storage
benchmark gives every mode the same conversations.

Only a conversion that loses nothing the destination promises is done: the aux states and the
final states are read at the source's precision, so the source must be at least as exact as the
destination for each (fp32 > bf16 > fp8 > fp4; full final states can become top-k targets, never
the reverse), and a source holding final states only on target rows cannot fill every row.
Resumable like a dump: samples already in `dst` are skipped.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dump.pipeline import target_head_for
from infra import resolve
from config import compose_config
from config.groups import StoreConf
from model.verifier_handle import Verifier
from store import StoreReader, StoreWriter, storage_settings

# Finer first: a destination may take an encoding at this rank or after its source's.
_AUX_PRECISION = ("fp32", "bf16", "fp8", "fp4")
_FINAL_PRECISION = ("fp32", "bf16", "topk")


class TranscodeError(ValueError):
    """A conversion that would claim more than the source holds."""


def check_conversion(source: StoreReader, storage: StoreConf) -> None:
    """Refuse a destination more exact than the source, naming the source and the setting."""
    src = f"store {source.path}"
    aux, final = storage.aux, storage.final
    if _AUX_PRECISION.index(aux) < _AUX_PRECISION.index(source.aux_encoding):
        raise TranscodeError(f"{src} keeps aux states as {source.aux_encoding}: it cannot give {aux}")
    if source.final_encoding == "topk":
        if final != "topk" or storage.topk > source.topk:
            raise TranscodeError(f"{src} keeps the top-{source.topk} targets only: it cannot give "
                                 f"final {final}" + (f" with topk {storage.topk}" if final == "topk" else ""))
    elif _FINAL_PRECISION.index(final) < _FINAL_PRECISION.index(source.final_encoding):
        raise TranscodeError(f"{src} keeps final states as {source.final_encoding}: it cannot give {final}")
    if source.final_rows == "loss" and storage.final_rows == "all":
        raise TranscodeError(f"{src} keeps final states on target rows only: it cannot give final_rows all")


def transcode(src: str | Path, dst: str | Path, overrides: list[str] | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Write every sample of `src` into the store `dst` with the composed conf/store; returns a
    summary (samples, tokens, seconds, tokens/s of the writer, bytes/token of `dst`)."""
    source = StoreReader(resolve(src))
    cfg = compose_config("dump", list(overrides or []))
    check_conversion(source, storage_settings(cfg.store))
    verifier = Verifier.from_conf(cfg.verifier)
    identity = verifier.identity
    if identity != source.identity:
        raise TranscodeError(f"store {source.path} was dumped from verifier {source.identity.get('name')!r} "
                             f"({source.identity}); the composed config names {identity}: pass its "
                             "verifier=... override")
    record = dict(source.dump_config, transcoded_from=str(source.path))
    writer = StoreWriter(resolve(dst), identity, source.aux_layer_ids, cfg.store, record,
                         aux_convention=source.aux_convention, aux_capture=source.aux_capture,
                         rank=0, world_size=1, target_head=target_head_for(cfg.store, verifier))
    done = writer.done_sample_ids()
    todo = [ref for ref in source.samples() if ref.sample_id not in done]
    tokens, seconds = 0, 0.0
    with writer:
        for ref in tqdm(todo, desc=f"transcode -> {cfg.store.mode}", unit="sample", disable=not progress):
            sample = source.read_sample(ref, dtype=_read_dtype(source))
            start = time.perf_counter()
            writer.add(sample.sample_id, sample.input_ids, sample.loss_mask, sample.aux, _final_of(sample))
            writer.commit_if_full()
            seconds += time.perf_counter() - start
            tokens += ref.num_tokens
        start = time.perf_counter()
    seconds += time.perf_counter() - start   # the last shard's commit, in the writer's close
    return {"source": str(source.path), "store": str(resolve(dst)), "mode": cfg.store.mode,
            "samples": len(todo), "samples_done_earlier": len(done), "tokens": tokens,
            "writer_seconds": seconds, "writer_tokens_per_s": tokens / seconds if seconds else None,
            "bytes_per_token": writer.bytes_per_token()}


def _read_dtype(source: StoreReader):
    import torch
    return torch.float32 if "fp32" in (source.aux_encoding, source.final_encoding) else torch.bfloat16


def _final_of(sample):
    if sample.final is None:
        raise TranscodeError(f"sample {sample.sample_id}: the source keeps no final states")
    return sample.final


def main(argv: list[str]) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m dump transcode",
                                     description="Re-encode a store in other storage settings.")
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("overrides", nargs="*", help="hydra overrides of conf/dump.yaml, e.g. store=compact")
    args = parser.parse_args(argv)
    try:
        summary = transcode(args.src, args.dst, args.overrides)
    except TranscodeError as error:
        print(f"python -m dump transcode: {error}")
        return 2
    print(json.dumps(summary, indent=2))
    return 0


__all__ = ["TranscodeError", "check_conversion", "main", "transcode"]
