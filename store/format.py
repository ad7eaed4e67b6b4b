"""The on-disk format of a store: its layout, array names, codecs and hidden-state encodings.

A store is a folder:

    store.json                       written once, atomically, by whichever rank comes first:
                                     format version, verifier identity, aux layer ids, their
                                     convention and what they capture, storage settings, dump
                                     config; then a line "sha256:<hex of the JSON above it>"
    shards/r00000-000000.zarr/       one Zarr v3 group per committed shard; its attributes repeat
                                     store.json (a shard describes itself) and list the sample ids
    shards/.tmp-r00000-000001.zarr/  a shard being written, renamed into place once complete and
                                     flushed to disk: the rename is the commit point
    manifest/rank-00000.json         per rank: its committed shards (sample ids, token counts, the
                                     sha256 of each of their zarr.json files) and rejected samples,
                                     rewritten atomically after each shard; the same sha256 line
    manifest/rank-00000.lock         the rank's write lock, naming the process that holds it

The shards folder is the truth and the manifests its index: a shard committed just before a
crash, before its manifest was updated, is verified and adopted when its rank reopens the store.

Arrays of a shard holding S samples and N tokens:
    input_ids       [N] int32
    loss_mask       [N] bool
    aux_hidden      [N, n_aux, H] bf16 bits as uint16 (Zarr v3 has no bfloat16); in fp8 mode
                    float8_e4m3fn bits as uint8, with
    aux_scale       [N, n_aux] float32, fp8 mode only: aux = e4m3 * scale, scale = amax_H / 448;
                    in fp32 mode float32
    final_hidden    [N, H] bf16 bits as uint16, float32 in fp32 mode; never lossy (it defines
                    the training target)
    sample_offsets  [S + 1] int64: sample i holds tokens offsets[i]:offsets[i + 1]
Every array is chunked along its first axis to about `target_chunk_bytes`; Zarr's sharding codec
packs all chunks of an array into one file, and every chunk is encoded bytes -> compressor ->
crc32c, so each chunk (and each shard index) carries its own checksum.

So every file a reader reads is checked: chunks and shard indexes by their crc32c, each zarr.json
(whose codec parameters, blosc's shuffle say, a decoder never reads back) against the sha256 its
manifest entry holds, store.json and the manifests by their sha256 line. Every reader and
`verify` checks these; a damaged file is named (StoreCorruptError, ShardCorruptError).

Format versions. 2 is the above. 1 had no sha256 anywhere: its stores are still read (their JSON
and zarr.json files are taken as they are, and `inspect` says so), but never written to: finish
such a store with the code that started it, or start a new one. A JSON file without the sha256
line is read as version 1 only when it says version 1: a version-2 file cannot lose that line to
one damaged byte, so damage never makes a new file pass for an old one.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from omegaconf import DictConfig, ListConfig, OmegaConf
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from infra import failpoint

FORMAT_VERSION = 2
LEGACY_VERSION = 1  # read, never written (the module's docstring)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# bf16: hidden states as bf16 (what a bf16 verifier computes: lossless); fp8: aux states as e4m3
# with per-token scales, final as bf16; fp32: both as float32 (exact for a verifier computing in
# fp32, as kimi-tiny does on CPU; twice the bytes of bf16).
MODES = ("bf16", "fp8", "fp32")

STORE_META = "store.json"
SHARDS_DIR = "shards"
MANIFEST_DIR = "manifest"
TMP_PREFIX = ".tmp-"
CORRUPT_PREFIX = ".corrupt-"
_SHARD_NAME = re.compile(r"^r(\d{5})-(\d{6})\.zarr$")

INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
AUX = "aux_hidden"
AUX_SCALE = "aux_scale"
FINAL = "final_hidden"
OFFSETS = "sample_offsets"


@dataclass(frozen=True)
class StorageSettings:
    """conf/store/*.yaml."""

    mode: str                   # one of MODES
    compressor: dict[str, Any]  # {name: zstd, level} | {name: blosc, cname, clevel, shuffle} | {name: none}
    target_chunk_bytes: int     # uncompressed bytes per chunk of each array
    shard_bytes: int            # uncompressed bytes a rank buffers before committing a shard

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any]) -> StorageSettings:
        values = _plain(cfg)
        settings = cls(mode=values["mode"], compressor=dict(values["compressor"]),
                       target_chunk_bytes=int(values["target_chunk_bytes"]),
                       shard_bytes=int(values["shard_bytes"]))
        if settings.mode not in MODES:
            raise ValueError(f"storage mode {settings.mode!r}: use one of {MODES}")
        _compressor_codec(settings.compressor)  # fail on a bad compressor now, not at the first shard
        if settings.target_chunk_bytes < 1 or settings.shard_bytes < 1:
            raise ValueError("target_chunk_bytes and shard_bytes must be positive")
        return settings


def _plain(value: Any) -> Any:
    """Config values (OmegaConf or plain) as JSON-ready dicts and lists."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _compressor_codec(cfg: Mapping[str, Any]) -> ZstdCodec | BloscCodec | None:
    name = cfg.get("name")
    if name == "zstd":
        return ZstdCodec(level=int(cfg["level"]))
    if name == "blosc":
        # typesize is left to Zarr, which sets it from each array's dtype.
        return BloscCodec(cname=cfg["cname"], clevel=int(cfg["clevel"]), shuffle=cfg["shuffle"])
    if name == "none":
        return None
    raise ValueError(f"compressor {dict(cfg)!r}: name must be zstd, blosc or none")


# ---------------------------------------------------------------------------------------------
# Encoding of hidden states


def encode_bf16(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """bf16 bits as uint16, same shape; wider floats are rounded to nearest even."""
    # A copy, never a view: the caller may reuse its buffer once a sample is added.
    bits = torch.as_tensor(x).detach().to("cpu", torch.bfloat16, copy=True).contiguous()
    return bits.view(torch.int16).numpy().view(np.uint16)


def decode_bf16(bits: np.ndarray) -> torch.Tensor:
    """The bfloat16 tensor whose bits `encode_bf16` stored."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def encode_fp8(x: torch.Tensor | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float8_e4m3fn bits as uint8 [..., H] and float32 scales [...], one per row of H values.

    scale = amax / 448 maps each row's largest value onto e4m3's largest, so every element keeps
    3 mantissa bits: |x - decoded| <= |x| / 16 + scale * 2**-10 (the second term for values that
    fall into e4m3's subnormal range, below scale * 2**-6).
    """
    values = torch.as_tensor(x).detach().to("cpu", torch.float32)
    amax = values.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # all-zero rows: 1
    # The clamp only catches the float32 rounding of amax / scale past 448.
    codes = (values / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8).numpy(), scale.squeeze(-1).numpy()


def decode_fp8(codes: np.ndarray, scale: np.ndarray, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """codes [..., H] * scale [...] as `dtype`."""
    values = torch.from_numpy(np.ascontiguousarray(codes)).view(torch.float8_e4m3fn).float()
    return (values * torch.from_numpy(np.ascontiguousarray(scale)).unsqueeze(-1)).to(dtype)


# ---------------------------------------------------------------------------------------------
# Shards on disk


def shard_name(rank: int, index: int) -> str:
    return f"r{rank:05d}-{index:06d}.zarr"


def _data_file(array: str, ndim: int) -> str:
    """Where an array's data lies in its shard folder: the key of its one Zarr shard."""
    return "/".join([array, "c", *["0"] * ndim])


def _shard_rank(name: str) -> int:
    return int(_SHARD_NAME.match(name).group(1))  # type: ignore[union-attr]


def _shard_index(name: str) -> int:
    return int(_SHARD_NAME.match(name).group(2))  # type: ignore[union-attr]


def _chunk_shape(data: np.ndarray, target_chunk_bytes: int) -> tuple[int, ...]:
    """Chunks along the first (token) axis holding about target_chunk_bytes: sized from H."""
    row_bytes = max(1, data[0].nbytes if data.ndim > 1 else data.itemsize)
    rows = max(1, min(len(data), target_chunk_bytes // row_bytes))
    return (rows, *data.shape[1:])


def _write_shard(folder: Path, arrays: Mapping[str, np.ndarray], attributes: dict[str, Any],
                 storage: StorageSettings) -> None:
    """One Zarr v3 group; each array is one file (one Zarr shard) of crc32c-checked chunks."""
    group = zarr.open_group(str(folder), mode="w-", zarr_format=3, attributes=attributes)
    compressor = _compressor_codec(storage.compressor)
    for name, data in arrays.items():
        chunks = _chunk_shape(data, storage.target_chunk_bytes)
        whole = (math.ceil(len(data) / chunks[0]) * chunks[0], *data.shape[1:])
        array = group.create_array(
            name, shape=data.shape, dtype=data.dtype, chunks=chunks, shards=whole,
            compressors=[c for c in (compressor, Crc32cCodec()) if c is not None],
            fill_value=0, attributes=_array_attributes(name, storage.mode),
            # An all-zero chunk is written too, so that every chunk is there with its checksum.
            config={"write_empty_chunks": True})
        array[...] = data
        failpoint("store.shard.array_written")


# The dtype a hidden-state array means, per mode; bf16 and e4m3 are stored as their raw bits
# (uint16, uint8) since Zarr v3 has neither.
_LOGICAL_DTYPES = {(AUX, "bf16"): "bfloat16", (FINAL, "bf16"): "bfloat16",
                   (AUX, "fp8"): "float8_e4m3fn", (FINAL, "fp8"): "bfloat16",
                   (AUX, "fp32"): "float32", (FINAL, "fp32"): "float32"}


def _array_attributes(name: str, mode: str) -> dict[str, str]:
    if name == AUX_SCALE:
        return {"meaning": "amax over H / 448, per token and aux layer"}
    logical = _LOGICAL_DTYPES.get((name, mode))
    if logical in ("bfloat16", "float8_e4m3fn"):
        decode = {"decode": "aux_hidden * aux_scale[..., None]"} if logical == "float8_e4m3fn" else {}
        return {"logical_dtype": logical, "stored_as": "raw bits", **decode}
    return {}
