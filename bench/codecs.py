"""Measure numcodecs compressors on real verifier hidden states, to choose the store's codec.

    .venv/bin/python -m bench.codecs [--verifier DIR] [--conversations 16] [--max-tokens 1024]

Runs the verifier (Hugging Face transformers, fp32, CPU) on a few ShareGPT train
conversations rendered with its chat template, takes the aux hidden states (the ids of
conf/verifier/kimi_tiny.yaml, vLLM convention: id k = hidden_states[k]) and the final hidden
state, and stores them the way the store package does: bf16 bits as uint16 (lossless mode) and
e4m3 bytes with per-token scales (fp8 mode). Each codec then compresses the same chunks of
`target_chunk_bytes` (conf/store/lossless.yaml), one thread, and the script reports the ratio
(raw / compressed) and encode / decode MB/s of raw bytes. Results go to
bench/results/codecs.json.

The verifier defaults to the shipped, trained kimi-tiny (model/verifier/kimi_tiny): hidden
states of a trained model are what the store will hold, and they compress differently from
random-init ones.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numcodecs
import numcodecs.blosc
import numpy as np
import torch
from numcodecs.abc import Codec
from omegaconf import OmegaConf

import infra
from data.conversations import load_conversations
from infra import REPO_ROOT, resolve
from config import compose_config
from store import (StoreReader, StoreWriter, encode_bf16, encode_bf16_planes, encode_fp8, inspect_store,
                   verifier_identity)

infra.configure_environment()  # offline hubs, caches in the repo: before the functions below load transformers

TRAINED_VERIFIER = REPO_ROOT / "model/verifier/kimi_tiny"
RESULTS = REPO_ROOT / "bench/results/codecs.json"
# Enough repeats that the timings of a 4 MiB chunk are not all noise on a shared machine.
REPEATS = 3


@dataclass
class Measurement:
    array: str
    codec: str
    raw_bytes: int
    compressed_bytes: int
    ratio: float
    encode_mb_s: float
    decode_mb_s: float


def candidate_codecs(typesize: int) -> dict[str, Codec]:
    """The compressors compared: zstd levels, and blosc with bit- or byte-shuffle."""
    codecs: dict[str, Codec] = {f"zstd-{level}": numcodecs.Zstd(level=level) for level in (1, 3, 9)}
    shuffles = {"byteshuffle": numcodecs.Blosc.SHUFFLE, "bitshuffle": numcodecs.Blosc.BITSHUFFLE}
    for cname, levels in (("zstd", (1, 3, 5)), ("lz4", (5,))):
        for shuffle_name, shuffle in shuffles.items():
            if typesize == 1 and shuffle_name == "byteshuffle":
                shuffle_name, shuffle = "noshuffle", numcodecs.Blosc.NOSHUFFLE  # the same thing
            for level in levels:
                name = f"blosc-{cname}-{level}-{shuffle_name}"
                codecs[name] = numcodecs.Blosc(cname=cname, clevel=level, shuffle=shuffle,
                                               typesize=typesize)
    return codecs


def find_verifier(given: str | None) -> Path:
    if given:
        return resolve(given)
    return TRAINED_VERIFIER


def token_batches(verifier: Path, n_conversations: int, max_tokens: int) -> Iterator[torch.Tensor]:
    """Token ids [1, T] of ShareGPT train conversations rendered with the verifier's template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(verifier)
    data_cfg = compose_config("dump", ["data=sharegpt", f"data.max_samples={n_conversations}"]).data
    for conversation in load_conversations(data_cfg, "train"):
        messages = [{"role": m.role, "content": m.content} for m in conversation.messages]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
        yield torch.tensor([list(ids)[:max_tokens]])


@dataclass
class Conversation:
    input_ids: torch.Tensor  # [T]
    aux: torch.Tensor        # [T, n_aux, H] fp32
    final: torch.Tensor      # [T, H] fp32


@torch.no_grad()
def hidden_states(verifier: Path, aux_ids: list[int], batches: Iterator[torch.Tensor]
                  ) -> list[Conversation]:
    """aux states (HF hidden_states[k] for the vLLM-convention id k) and the final one."""
    from transformers import DeepseekV3ForCausalLM

    verifier_model = DeepseekV3ForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    conversations = []
    for ids in batches:
        states = verifier_model.model(ids, output_hidden_states=True).hidden_states
        aux = torch.stack([states[k][0] for k in aux_ids], dim=1)
        conversations.append(Conversation(ids[0], aux, states[-1][0]))
    return conversations


def chunks(data: np.ndarray, chunk_bytes: int) -> list[np.ndarray]:
    """Token-axis chunks of about chunk_bytes, as the store cuts them."""
    tokens = max(1, chunk_bytes // (data[0].nbytes))
    return [np.ascontiguousarray(data[i:i + tokens]) for i in range(0, len(data), tokens)]


def timed(fn: Callable[[], object]) -> float:
    """Best wall time of REPEATS calls (the least disturbed by the other jobs on the machine)."""
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(array: str, name: str, codec: Codec, pieces: list[np.ndarray]) -> Measurement:
    encoded = [codec.encode(p) for p in pieces]
    for piece, enc in zip(pieces, encoded):  # a codec that loses data is no candidate
        decoded = np.frombuffer(codec.decode(enc), dtype=piece.dtype)
        assert np.array_equal(decoded, piece.reshape(-1)), f"{name} is not lossless"
    raw = sum(p.nbytes for p in pieces)
    packed = sum(len(e) for e in encoded)
    encode_s = timed(lambda: [codec.encode(p) for p in pieces])
    decode_s = timed(lambda: [codec.decode(e) for e in encoded])
    return Measurement(array, name, raw, packed, raw / packed, raw / encode_s / 1e6,
                       raw / decode_s / 1e6)


def arrays_to_measure(aux: torch.Tensor, final: torch.Tensor) -> dict[str, np.ndarray]:
    """The arrays as the store holds them: bf16 bits, and e4m3 bytes + fp32 scales."""
    aux_fp8, aux_scale = encode_fp8(aux)
    return {
        "aux_hidden bf16": encode_bf16(aux),
        "final_hidden bf16": encode_bf16(final),
        # The store's bf16 layout (format 3): high and low byte planes, each plane its own chunks
        # (plane-major here, so that `chunks` cuts them apart as the store does).
        "aux_hidden bf16 planes": plane_major(encode_bf16_planes(aux)),
        "final_hidden bf16 planes": plane_major(encode_bf16_planes(final)),
        "aux_hidden fp8": aux_fp8,
        "aux_scale fp32": aux_scale,
    }


def plane_major(planes: np.ndarray) -> np.ndarray:
    """[N, 2, ...] byte planes as [2 * N, ...]: all high bytes, then all low bytes."""
    return np.ascontiguousarray(np.moveaxis(planes, 1, 0)).reshape(-1, *planes.shape[2:])


# End-to-end candidates: the best ratio per MB/s of the codec table, written through StoreWriter.
STORE_COMPRESSORS = {
    "zstd-1": {"name": "zstd", "level": 1},
    "zstd-3": {"name": "zstd", "level": 3},
    "blosc-zstd-3-byteshuffle": {"name": "blosc", "cname": "zstd", "clevel": 3, "shuffle": "shuffle"},
    "blosc-lz4-5-byteshuffle": {"name": "blosc", "cname": "lz4", "clevel": 5, "shuffle": "shuffle"},
}


@dataclass
class StoreFigures:
    mode: str
    codec: str
    bytes_per_token: float
    reference_bytes_per_token: int
    ratio_to_reference: float
    write_mb_s: float  # logical (uncompressed storage-dtype) MB per second of StoreWriter
    read_mb_s: float   # the same, for StoreReader.read_sample over every sample


def storage_cfg(mode: str) -> dict[str, Any]:
    """conf/store/<mode>.yaml as Hydra composes it."""
    cfg = OmegaConf.to_container(compose_config("dump", [f"store={mode}"]).store, resolve=True)
    assert isinstance(cfg, dict)
    return cfg


def store_figures(verifier: Path, aux_ids: list[int], conversations: list[Conversation],
                  mode: str, codec: str) -> StoreFigures:
    """Write every conversation as a sample of a fresh store, inspect it, read it back."""
    cfg = {**storage_cfg(mode), "compressor": STORE_COMPRESSORS[codec]}
    identity = verifier_identity(verifier, verifier.name)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        with StoreWriter(folder, identity, aux_ids, cfg, aux_convention="vllm", rank=0,
                         world_size=1) as writer:
            for i, c in enumerate(conversations):
                writer.add(f"c{i}", c.input_ids, torch.ones_like(c.input_ids, dtype=torch.bool),
                           c.aux, c.final)
                writer.commit_if_full()
        write_s = time.perf_counter() - start
        report = inspect_store(folder)
        assert not report["problems"], report["problems"]
        reader = StoreReader(folder)
        start = time.perf_counter()
        for ref in reader.samples():
            reader.read_sample(ref)
        read_s = time.perf_counter() - start
    logical = report["logical_bytes_per_token"] * report["tokens"]
    return StoreFigures(mode, codec, report["bytes_per_token"], report["reference_bytes_per_token"],
                        report["ratio_to_reference"], logical / write_s / 1e6, logical / read_s / 1e6)


def print_store_table(figures: list[StoreFigures]) -> None:
    print(f"{'mode':9} {'codec':26} {'B/token':>9} {'ref B/token':>11} {'ref/disk':>8} "
          f"{'write MB/s':>10} {'read MB/s':>9}")
    for f in figures:
        print(f"{f.mode:9} {f.codec:26} {f.bytes_per_token:9.1f} {f.reference_bytes_per_token:11} "
              f"{f.ratio_to_reference:8.3f} {f.write_mb_s:10.0f} {f.read_mb_s:9.0f}")


def print_table(results: list[Measurement]) -> None:
    print(f"{'array':20} {'codec':32} {'ratio':>6} {'enc MB/s':>9} {'dec MB/s':>9}")
    for m in results:
        print(f"{m.array:20} {m.codec:32} {m.ratio:6.3f} {m.encode_mb_s:9.0f} {m.decode_mb_s:9.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--verifier", help="checkpoint folder (default: the shipped kimi-tiny)")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=1024, help="per conversation")
    args = parser.parse_args()

    torch.set_num_threads(1)
    numcodecs.blosc.set_nthreads(1)
    verifier = find_verifier(args.verifier)
    aux_ids = list(compose_config("dump", ["verifier=kimi_tiny"]).verifier.aux_layer_ids)
    chunk_bytes = storage_cfg("lossless")["target_chunk_bytes"]
    batches = token_batches(verifier, args.conversations, args.max_tokens)
    conversations = hidden_states(verifier, aux_ids, batches)
    aux = torch.cat([c.aux for c in conversations])
    final = torch.cat([c.final for c in conversations])
    print(f"verifier {verifier}: {aux.shape[0]} tokens, aux {tuple(aux.shape)}, chunks of {chunk_bytes} B")

    results = []
    for array, data in arrays_to_measure(aux, final).items():
        pieces = chunks(data, chunk_bytes)
        for name, codec in candidate_codecs(data.dtype.itemsize).items():
            results.append(measure(array, name, codec, pieces))
    print_table(results)
    figures = [store_figures(verifier, aux_ids, conversations, mode, codec)
               for mode in ("lossless", "fp8") for codec in STORE_COMPRESSORS]
    print_store_table(figures)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "verifier": str(verifier), "tokens": aux.shape[0], "hidden_size": aux.shape[-1],
        "aux_layer_ids": aux_ids, "chunk_bytes": chunk_bytes,
        "threads": 1, "repeats": REPEATS, "numcodecs": numcodecs.__version__,
        "machine": platform.processor() or platform.machine(),
        "codecs": [asdict(m) for m in results],
        "store": [asdict(f) for f in figures],
    }, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
