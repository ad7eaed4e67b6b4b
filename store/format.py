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
    manifest/rank-00000.done         the rank has written its whole share; .waiting: its writer
    manifest/retired.json            waits for room under store.max_bytes; retired.json: shards a
                                     following trainer deleted, with their manifest entries
                                     (store/progress.py, which describes these three)

The shards folder is the truth and the manifests its index: a shard committed just before a
crash, before its manifest was updated, is verified and adopted when its rank reopens the store.

A manifest entry's `heldout` (and its shard's attribute of that name) says the shard holds only
held-out samples (the trainer's split, conf/heldout_split, and the conversations the dump read on for
the held-out set, data/heldout_set.py; the writer puts them in shards of their own): the trainer holds
out every sample of such a shard, and a following trainer never retires it. Entries written before
the split was routed lack it: False. A retired shard is gone from shards/ but stays in its rank's
manifest: its samples are done.

A manifest's "rejected" maps each sample id the rank rejected to its record (data/rejection.py's
Rejection): {"kind", "file", "line", "reason"}. kind is one of RejectionKind's values ("no
assistant turn", "chat template", "over-long", "no assistant token", "non-finite hidden states",
"no tokens"); file and line name the input record the sample came from (both null where
unknown); reason says what exactly was wrong. A rejected sample is done: a resumed dump skips it.
A manifest that maps an id to anything else (the sentence older versions kept) is refused as
damaged, naming the sample.

Storage settings (conf/store/*.yaml; store.json's "storage" block; one type, config.groups.StoreConf,
checked and recorded by store/settings.py): `mode`, a label (the preset's
name: lossless, fp8, fp4, compact, fp32), and what decides the bytes: `aux`, the encoding of the
aux hidden states (bf16 | fp32 | fp8 | fp4, with `fp4_block` values per scale); `final`, that of
the final hidden state (bf16 | fp32 | topk, with `topk` = k); `final_rows`, which rows of it are
kept (all | loss). Then the compressor, chunk and shard sizes, which a reader needs not know.

Arrays of a shard holding S samples and N tokens (M: the rows of the final side, below):
    input_ids        [N] int32
    loss_mask        [N] bool
    aux_hidden       [N, 2, n_aux, H]   aux bf16: byte planes of the bf16 bits, uint8 (Zarr v3 has
                                        no bfloat16): [:, 0] the high bytes, [:, 1] the low bytes
                                        (store/encoding.py: encode_bf16_planes)
                     [N, n_aux, H]      fp32: float32; fp8: float8_e4m3fn bits as uint8;
                     [N, n_aux, H / 2]  fp4: e2m1 codes as uint8, two per byte (the value of even
                                        index in the low nibble)
    aux_scale        [N, n_aux]         fp8 only: float32, aux = e4m3 * scale, scale = amax_H / 448
                     [N, n_aux, H / B]  fp4 only: bf16 bits as uint16, one per block of B =
                                        fp4_block values along H: aux = e2m1 * scale,
                                        scale = amax_block / 6 rounded up to a bf16 (1 for an
                                        all-zero block)
    final_hidden     [M, 2, H]          final bf16: byte planes as aux_hidden's
                     [M, H]             final fp32: float32
    target_ids       [M, k] int32       final topk, in place of final_hidden: the verifier's k most
    target_logprobs  [M, k] float16     likely next tokens, descending, and their log-probabilities
                                        log_softmax(final @ lm_head.T) over the full vocabulary
                                        (float16; below -65504 clamped to it)
    sample_offsets   [S + 1] int64      sample i holds tokens offsets[i]:offsets[i + 1]
    final_offsets    [S + 1] int64      final_rows loss only: sample i holds final-side rows
                                        final_offsets[i]:final_offsets[i + 1]
With final_rows all, M = N: every token has its final-side row. With final_rows loss, a sample of
T tokens keeps only its target rows (`target_rows`): row j where j + 1 < T and loss_mask[j + 1],
the only rows whose final state a training loss reads (at any TTT step the loss at a position
is taken against the verifier's distribution for an assistant token that follows it); a reader
puts them back in place and fills the others with 0 (final_hidden), -1 (target_ids) and -inf
(target_logprobs). Each array's zarr.json attributes say how its bytes decode.

Error bounds: bf16 and fp32 are exactly what the verifier computed in that dtype. fp8 keeps 3
mantissa bits: |x - stored| <= |x| / 16 + scale * 2**-10. fp4: |x - stored| <= max(scale, |x|)/4
with scale = amax_block / 6 rounded up to bf16's 8 significant bits. topk: ids exact, log-probabilities to float16 rounding
(relative 2**-11) of the float32 values, the rest of the distribution dropped.

Every array is chunked along its first axis to about `target_chunk_bytes` (byte planes also along
their plane axis, so each plane compresses on its own); Zarr's sharding codec
packs all chunks of an array into one file, and every chunk is encoded bytes -> compressor ->
crc32c, so each chunk (and each shard index) carries its own checksum.

So every file a reader reads is checked: chunks and shard indexes by their crc32c, each zarr.json
(whose codec parameters, blosc's shuffle say, a decoder never reads back) against the sha256 its
manifest entry holds, store.json and the manifests by their sha256 line. Every reader and
`verify` checks these; a damaged file is named (StoreCorruptError, ShardCorruptError).

Format version 3 is the above, the only one read and written. A store of an older version (1
and 2, written by older versions of the dump) is refused on opening, naming its version: dump
again into a new store. A store of a newer version, or whose settings name an encoding this code
does not know, is refused on opening, naming it: upgrade the code to read it. A JSON file
without its sha256 line is damaged, but for a store.json that says version 1 (which sealed
nothing): refused as that version, never read.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from omegaconf import DictConfig, ListConfig, OmegaConf
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from config.choices import AuxEncoding, FinalEncoding, FinalRows, names
from config.groups import CompressorConf, StoreConf
from infra import failpoint

FORMAT_VERSION = 3  # the only one read and written (the module's docstring)

AUX_ENCODINGS = names(AuxEncoding)
FINAL_ENCODINGS = names(FinalEncoding)
FINAL_ROWS = names(FinalRows)
# The presets of conf/store; `mode` is their label, the encodings above decide the bytes.
MODES = ("lossless", "fp8", "fp4", "compact", "fp32")

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
TARGET_IDS = "target_ids"
TARGET_LOGPROBS = "target_logprobs"
OFFSETS = "sample_offsets"
FINAL_OFFSETS = "final_offsets"


def final_arrays(storage: StoreConf) -> tuple[str, ...]:
    """The arrays of the final side, whose rows final_rows chooses."""
    return (TARGET_IDS, TARGET_LOGPROBS) if storage.final == "topk" else (FINAL,)


def shard_arrays(storage: StoreConf) -> tuple[str, ...]:
    """Every array a shard written with these settings (store/settings.py) holds."""
    scale = (AUX_SCALE,) if storage.aux in ("fp8", "fp4") else ()
    offsets = (FINAL_OFFSETS,) if storage.final_rows == "loss" else ()
    return (INPUT_IDS, LOSS_MASK, AUX, *scale, *final_arrays(storage), OFFSETS, *offsets)


def _plain(value: Any) -> Any:
    """Config values (OmegaConf or plain) as JSON-ready dicts and lists."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True, enum_to_str=True)
    return value


def _compressor_codec(spec: CompressorConf) -> ZstdCodec | BloscCodec | None:
    """The codec of a compressor (conf/store's `compressor`, or the one a store.json records)."""
    if spec.name == "zstd":
        return ZstdCodec(level=int(spec.level))
    if spec.name == "blosc":
        # typesize is left to Zarr, which sets it from each array's dtype.
        return BloscCodec(cname=spec.cname, clevel=int(spec.clevel), shuffle=spec.shuffle)
    if spec.name == "none":
        return None
    given = {k: v for k, v in vars(spec).items() if v is not None}
    raise ValueError(f"compressor {given!r}: name must be zstd, blosc or none")


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


def _chunk_shape(data: np.ndarray, target_chunk_bytes: int, planes: bool = False) -> tuple[int, ...]:
    """Chunks along the first (token) axis holding about target_chunk_bytes: sized from H. Byte
    planes (encode_bf16_planes) are also cut along their plane axis: one plane per chunk."""
    inner = (1, *data.shape[2:]) if planes else data.shape[1:]
    row_bytes = max(1, data.itemsize * math.prod(inner))
    rows = max(1, min(len(data), target_chunk_bytes // row_bytes))
    return (rows, *inner)


def is_planes(name: str, storage: StoreConf) -> bool:
    """Whether an array holds bf16 byte planes: bf16 hidden states."""
    return (name == AUX and storage.aux == "bf16") or (name == FINAL and storage.final == "bf16")


def _write_shard(folder: Path, arrays: Mapping[str, np.ndarray], attributes: dict[str, Any],
                 storage: StoreConf) -> None:
    """One Zarr v3 group; each array is one file (one Zarr shard) of crc32c-checked chunks (an
    array of no rows, a final side no sample has a target row in, has no file)."""
    group = zarr.open_group(str(folder), mode="w-", zarr_format=3, attributes=attributes)
    compressor = _compressor_codec(storage.compressor)
    for name, data in arrays.items():
        chunks = _chunk_shape(data, storage.target_chunk_bytes, is_planes(name, storage))
        whole = (max(1, math.ceil(len(data) / chunks[0])) * chunks[0], *data.shape[1:])
        array = group.create_array(
            name, shape=data.shape, dtype=data.dtype, chunks=chunks, shards=whole,
            compressors=[c for c in (compressor, Crc32cCodec()) if c is not None],
            fill_value=0, attributes=_array_attributes(name, storage),
            # An all-zero chunk is written too, so that every chunk is there with its checksum.
            config={"write_empty_chunks": True})
        array[...] = data
        failpoint("store.shard.array_written")


def logical_dtypes(storage: StoreConf) -> dict[str, str]:
    """What each array's values are (store.json's "dtypes"); bf16, e4m3 and e2m1 are stored as
    raw bits (uint16, uint8, two per uint8) since Zarr v3 has none of them."""
    aux = {"bf16": "bfloat16", "fp32": "float32", "fp8": "float8_e4m3fn", "fp4": "float4_e2m1"}
    final = ({TARGET_IDS: "int32", TARGET_LOGPROBS: "float16"} if storage.final == "topk" else
             {FINAL: {"bf16": "bfloat16", "fp32": "float32"}[storage.final]})
    return {AUX: aux[storage.aux], **final, INPUT_IDS: "int32", LOSS_MASK: "bool"}


_LOSS_ROWS = ("target rows only: row j of a sample of T tokens where j + 1 < T and "
              "loss_mask[j + 1]; sample i holds rows final_offsets[i]:final_offsets[i + 1]")


def _array_attributes(name: str, storage: StoreConf) -> dict[str, Any]:
    """How an array's bytes decode, for someone reading the shard without this code."""
    found = dict(_DESCRIPTIONS.get((name, storage.aux if name in (AUX, AUX_SCALE) else storage.final),
                                   {}))
    if storage.aux == "fp4" and name in (AUX, AUX_SCALE):
        found["block"] = storage.fp4_block
    if name in final_arrays(storage) and storage.final_rows == "loss":
        found["rows"] = _LOSS_ROWS
    if name in (TARGET_IDS, TARGET_LOGPROBS):
        found["k"] = storage.topk
    if name == FINAL_OFFSETS:
        found["meaning"] = "sample i holds final-side rows final_offsets[i]:final_offsets[i + 1]"
    return found


_RAW_BF16 = {"logical_dtype": "bfloat16", "stored_as": "byte planes of the bits along axis 1: "
             "[:, 0] the high bytes, [:, 1] the low bytes; bits = high << 8 | low"}
_DESCRIPTIONS: dict[tuple[str, str], dict[str, str]] = {
    (AUX, "bf16"): _RAW_BF16,
    (AUX, "fp8"): {"logical_dtype": "float8_e4m3fn", "stored_as": "raw bits",
                   "decode": "aux_hidden * aux_scale[..., None]"},
    (AUX_SCALE, "fp8"): {"meaning": "amax over H / 448, per token and aux layer"},
    (AUX, "fp4"): {"logical_dtype": "float4_e2m1", "stored_as": "two codes per byte, the value of "
                   "even index in the low nibble; bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, "
                   "3, 4, 6", "decode": "e2m1 value * the aux_scale of its block of `block` "
                   "consecutive values along H"},
    (AUX_SCALE, "fp4"): {"logical_dtype": "bfloat16", "stored_as": "raw bits",
                         "meaning": "per block of `block` values along H: its amax / 6, rounded up "
                         "to a bfloat16 (1 for an all-zero block)"},
    (FINAL, "bf16"): _RAW_BF16,
    (TARGET_IDS, "topk"): {"meaning": "the verifier's k most likely next tokens, descending"},
    (TARGET_LOGPROBS, "topk"): {"meaning": "their log_softmax(final_hidden @ lm_head.T) over the "
                                "full vocabulary, float32 rounded to float16 (clamped at -65504)"},
}
