"""THE shard contract between the stages: writer, reader, manifest, checksums, format version.

Stage 1 writes with `StoreWriter`; stage 2 reads with `StoreReader` only. A store is a folder:

    store.json                       written once, atomically, by whichever rank comes first:
                                     format version, verifier identity, aux layer ids, their
                                     convention and what they capture, storage settings, dump
                                     config
    shards/r00000-000000.zarr/       one Zarr v3 group per committed shard; its attributes repeat
                                     store.json (a shard describes itself) and list the sample ids
    shards/.tmp-r00000-000001.zarr/  a shard being written, renamed into place once complete and
                                     flushed to disk: the rename is the commit point
    manifest/rank-00000.json         per rank: its committed shards (sample ids, token counts) and
                                     rejected samples, rewritten atomically after each shard

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
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import uuid
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
import zarr
from omegaconf import DictConfig, ListConfig, OmegaConf
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# bf16: hidden states as bf16 (what a bf16 verifier computes: lossless); fp8: aux states as e4m3
# with per-token scales, final as bf16; fp32: both as float32 (exact for a verifier computing in
# fp32, as kimi-tiny does on CPU; twice the bytes of bf16).
MODES = ("bf16", "fp8", "fp32")
# What the hidden state of an aux id is (conf/verifier `aux_capture`): residual_stream, the
# DeepSeek-V3 hidden + residual entering layer k (Kimi-K2, kimi-tiny); for Kimi-K3, whose blocks
# keep a prefix sum of their layers' outputs, prefix_only (that prefix sum: vLLM's default, what
# EAGLE-3 drafts are served with) or attn_res_stream (the AttnRes-mixed stream). A draft trained
# on one and served with another loses most of its acceptance, so a store records it.
AUX_CAPTURES = ("residual_stream", "prefix_only", "attn_res_stream")
# Stores written before store.json named the capture were all of DeepSeek-V3 verifiers.
LEGACY_AUX_CAPTURE = "residual_stream"

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

# config.json keys that change with the tool that saved the checkpoint, not with the model.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")
# Files that define how text becomes token ids (Kimi ships tiktoken.model and Python code).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json",
                    "merges.txt", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")
# Readers keep this many shards' Zarr metadata open (a trainer touches shards at random).
_OPEN_SHARDS = 64
_MAX_NAMED = 10  # sample ids shown in one message


class StoreMismatchError(ValueError):
    """The store was written with another verifier, aux layers, storage mode or format."""


class ShardCorruptError(RuntimeError):
    """A shard's data cannot be read back: a checksum mismatch, a truncated file, bad metadata."""

    def __init__(self, shard: str, array: str | None, sample_ids: Sequence[str], detail: str):
        self.shard, self.array, self.sample_ids = shard, array, tuple(sample_ids)
        where = f"shard {shard}" + (f", array {array}" if array else "")
        super().__init__(f"{where}: {detail} (samples {_name_some(self.sample_ids)})")


# ---------------------------------------------------------------------------------------------
# Identity, ranks, settings


def verifier_identity(checkpoint: str | Path, name: str) -> dict[str, Any]:
    """What makes hidden states comparable: hashes of the config and tokenizer, and the shapes."""
    folder = Path(checkpoint)
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)  # multimodal checkpoints nest the language model
    return {
        "name": name,
        "config_sha256": _sha256_json({k: v for k, v in config.items()
                                       if k not in _VOLATILE_CONFIG_KEYS}),
        "tokenizer_sha256": _tokenizer_sha256(folder),
        "hidden_size": int(text["hidden_size"]),
        "vocab_size": int(text["vocab_size"]),
        "num_hidden_layers": int(text["num_hidden_layers"]),
    }


def _sha256_json(value: Any) -> str:
    # Canonical JSON: the same config saved with other indentation or key order hashes the same.
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _tokenizer_sha256(folder: Path) -> str:
    files = [folder / n for n in _TOKENIZER_FILES] + sorted(folder.glob("tokenization_*.py"))
    present = [f for f in files if f.is_file()]
    if not present:
        raise FileNotFoundError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {folder}")
    digest = hashlib.sha256()
    for path in present:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def dist_env(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size): the given values where set, else torchrun's RANK / WORLD_SIZE,
    else SLURM's SLURM_PROCID / SLURM_NTASKS, else a single process (0, 1)."""
    env = os.environ
    for rank_key, size_key in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_key in env and size_key in env:  # one launcher's pair, never a mix of two
            env_rank, env_size = int(env[rank_key]), int(env[size_key])
            break
    else:
        env_rank, env_size = 0, 1
    rank = env_rank if rank is None else int(rank)
    world_size = env_size if world_size is None else int(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    return rank, world_size


def rank_of(sample_id: str, world_size: int) -> int:
    """The rank that owns a sample: a stable hash of its id, so ownership does not depend on the
    order of the data nor on which samples an earlier run already wrote."""
    digest = hashlib.blake2b(sample_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % world_size


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
# store.json, manifests, durable files


def _store_meta(identity: Mapping[str, Any], aux_layer_ids: Sequence[int], aux_convention: str,
                aux_capture: str, storage: StorageSettings, dump_cfg: Any) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "verifier": dict(_plain(identity)),
        "aux_layer_ids": [int(i) for i in _plain(aux_layer_ids)],
        "aux_convention": str(aux_convention),
        "aux_capture": check_aux_capture(aux_capture),
        "storage": asdict(storage),
        "dtypes": {AUX: _LOGICAL_DTYPES[(AUX, storage.mode)],
                   FINAL: _LOGICAL_DTYPES[(FINAL, storage.mode)],
                   INPUT_IDS: "int32", LOSS_MASK: "bool"},
        "checksum": "crc32c",
        "dump": _plain(dump_cfg) if dump_cfg is not None else {},
    }


def check_aux_capture(aux_capture: str) -> str:
    """The capture mode, refused unless one of AUX_CAPTURES."""
    if aux_capture not in AUX_CAPTURES:
        raise ValueError(f"aux capture {aux_capture!r}: use one of {AUX_CAPTURES}")
    return str(aux_capture)


def aux_capture_of(meta: Mapping[str, Any]) -> str:
    """The capture mode a store.json (or a shard's attributes) records; legacy ones have none."""
    return str(meta.get("aux_capture", LEGACY_AUX_CAPTURE))


def _compatibility(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The fields two writers of one store must agree on (names may differ, hashes may not)."""
    verifier = meta["verifier"]
    keys = ("config_sha256", "tokenizer_sha256", "hidden_size", "vocab_size", "num_hidden_layers")
    return {
        "format_version": meta["format_version"],
        **{f"verifier.{k}": verifier.get(k) for k in keys},
        "aux_layer_ids": list(meta["aux_layer_ids"]),
        "aux_convention": meta["aux_convention"],
        "aux_capture": aux_capture_of(meta),
        "storage.mode": meta["storage"]["mode"],
    }


def _mismatches(found: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    have, want = _compatibility(found), _compatibility(wanted)
    return [f"{key}: store has {have[key]!r}, this run has {want[key]!r}"
            for key in have if have[key] != want[key]]


def _create_or_check_meta(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """store.json: created by the first rank (hard link: atomic, never overwrites), else checked."""
    target = path / STORE_META
    if not target.exists():
        tmp = path / f".{STORE_META}.{uuid.uuid4().hex}.tmp"
        _write_json_durably(tmp, meta)
        try:
            os.link(tmp, target)
            _fsync_dir(path)
        except FileExistsError:
            pass  # another rank was first; its store.json is checked below
        finally:
            tmp.unlink()
    existing = read_store_meta(path)
    problems = _mismatches(existing, meta)
    if problems:
        raise StoreMismatchError(f"cannot write to store {path}: it was written with other "
                                 f"settings ({'; '.join(problems)}); use a new store folder")
    if existing["verifier"].get("name") != meta["verifier"].get("name"):
        logger.warning("store %s: verifier named %r there, %r here (same hashes)", path,
                       existing["verifier"].get("name"), meta["verifier"].get("name"))
    return existing


def read_store_meta(path: str | Path) -> dict[str, Any]:
    """store.json of a store, checked for a format version this code reads."""
    target = Path(path) / STORE_META
    if not target.is_file():
        raise FileNotFoundError(f"{path} is not a hidden-state store: {STORE_META} is missing")
    meta = json.loads(target.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise StoreMismatchError(f"store {path} has format version {meta.get('format_version')}; "
                                 f"this code reads version {FORMAT_VERSION}")
    return meta


def _write_json_durably(path: Path, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())


def _replace_json_durably(path: Path, value: Any) -> None:
    """Write tmp, fsync, rename over, fsync the folder: a reader sees the old or the new file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    _write_json_durably(tmp, value)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Every file and folder under root on disk, so a rename after it commits complete data."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(folder))


@dataclass
class ShardEntry:
    """One committed shard as a manifest lists it."""

    name: str
    sample_ids: list[str]
    num_tokens: list[int]  # per sample
    nbytes: int            # on disk


@dataclass
class Manifest:
    rank: int
    shards: list[ShardEntry] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)  # sample id -> reason


def _manifest_path(path: Path, rank: int) -> Path:
    return path / MANIFEST_DIR / f"rank-{rank:05d}.json"


def _read_manifest(file: Path) -> Manifest:
    raw = json.loads(file.read_text())
    return Manifest(rank=raw["rank"], shards=[ShardEntry(**s) for s in raw["shards"]],
                    rejected=raw["rejected"])


def _load_manifest(path: Path, rank: int) -> Manifest:
    file = _manifest_path(path, rank)
    return _read_manifest(file) if file.exists() else Manifest(rank=rank)


def _write_manifest(path: Path, manifest: Manifest) -> None:
    raw = {"format_version": FORMAT_VERSION, **asdict(manifest)}
    _replace_json_durably(_manifest_path(path, manifest.rank), raw)


def _all_manifests(path: Path) -> list[Manifest]:
    folder = path / MANIFEST_DIR
    files = sorted(folder.glob("rank-*.json")) if folder.is_dir() else []
    return [_read_manifest(f) for f in files]


def shard_name(rank: int, index: int) -> str:
    return f"r{rank:05d}-{index:06d}.zarr"


def _committed_shards(path: Path) -> list[str]:
    """Names of committed shards; in-progress (.tmp-) and quarantined (.corrupt-) ones are hidden."""
    folder = path / SHARDS_DIR
    if not folder.is_dir():
        return []
    return sorted(e.name for e in os.scandir(folder) if _SHARD_NAME.match(e.name))


def _nbytes_on_disk(folder: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


# ---------------------------------------------------------------------------------------------
# Shards on disk


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


class _OpenShard:
    """A committed shard's Zarr group, arrays and offsets, opened for reading."""

    def __init__(self, folder: Path):
        self.name = folder.name
        try:
            group = zarr.open_group(str(folder), mode="r", zarr_format=3)
            self.attributes = dict(group.attrs)
            self.sample_ids: list[str] = list(self.attributes["sample_ids"])
            self.arrays = {name: array for name, array in group.arrays()}
        except Exception as error:  # metadata missing or not JSON: the whole shard is unreadable
            raise ShardCorruptError(self.name, None, (), f"cannot open: {error!r}") from error
        offsets = self.read(OFFSETS, slice(None), self.sample_ids)
        self.offsets: np.ndarray = offsets.astype(np.int64)
        if len(self.offsets) != len(self.sample_ids) + 1:
            raise ShardCorruptError(self.name, OFFSETS, self.sample_ids,
                                    f"{len(self.offsets)} offsets for {len(self.sample_ids)} samples")

    def read(self, name: str, rows: slice, sample_ids: Sequence[str]) -> np.ndarray:
        """array[rows]; a failed read (checksum, truncation, decompression) names the samples."""
        if name not in self.arrays:
            raise ShardCorruptError(self.name, name, sample_ids, "array is missing")
        try:
            return self.arrays[name][rows]
        except Exception as error:
            raise ShardCorruptError(self.name, name, sample_ids, f"cannot read: {error}") from error

    def samples_in(self, start: int, stop: int) -> list[str]:
        """Ids of the samples with tokens in [start, stop)."""
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        last = int(np.searchsorted(self.offsets, stop, side="left"))
        return self.sample_ids[max(first, 0):last]


def _entry_of(folder: Path) -> ShardEntry:
    """A shard's manifest entry, read from the shard itself."""
    shard = _OpenShard(folder)
    return ShardEntry(name=folder.name, sample_ids=shard.sample_ids,
                      num_tokens=np.diff(shard.offsets).tolist(), nbytes=_nbytes_on_disk(folder))


# ---------------------------------------------------------------------------------------------
# Writer


@dataclass
class WriterStats:
    samples: int = 0    # written (committed) by this writer
    tokens: int = 0
    bytes: int = 0      # on disk
    shards: int = 0
    rejected: dict[str, str] = field(default_factory=dict)  # sample id -> reason, this run
    removed_tmp: list[str] = field(default_factory=list)    # unfinished shards of a crashed run
    adopted: list[str] = field(default_factory=list)        # committed shards missing from the manifest
    quarantined: list[str] = field(default_factory=list)    # such shards that failed verification


@dataclass
class _Pending:
    sample_id: str
    arrays: dict[str, np.ndarray]  # this sample's rows of the token arrays

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


class StoreWriter:
    """Writes one rank's share of a store: `add` buffers samples, `commit_if_full` (called where
    the caller allows a shard to end) and `close` commit them a shard at a time.

    Reopening a store after a crash resumes it: this rank's unfinished shards are removed, its
    committed shards missing from its manifest adopted, and `done_sample_ids()` says what to skip.
    """

    def __init__(self, path: str | Path, identity: Mapping[str, Any], aux_layer_ids: Sequence[int],
                 storage_cfg: Mapping[str, Any], dump_cfg: Any = None, *, aux_convention: str,
                 aux_capture: str = LEGACY_AUX_CAPTURE, rank: int | None = None,
                 world_size: int | None = None):
        self.path = Path(path)
        self.rank, self.world_size = dist_env(rank, world_size)
        self.storage = StorageSettings.from_cfg(storage_cfg)
        for folder in (self.path, self.path / SHARDS_DIR, self.path / MANIFEST_DIR):
            folder.mkdir(parents=True, exist_ok=True)
        wanted = _store_meta(identity, aux_layer_ids, aux_convention, aux_capture, self.storage,
                             dump_cfg)
        self.meta = _create_or_check_meta(self.path, wanted)
        self._lock = _lock_rank(self.path, self.rank)
        # This run's settings go into its shards (the same as store.json where it matters).
        self._shard_attributes = {k: v for k, v in wanted.items() if k != "format_version"}
        self.hidden_size = int(wanted["verifier"]["hidden_size"])
        self.vocab_size = int(wanted["verifier"]["vocab_size"])
        self.num_aux = len(wanted["aux_layer_ids"])
        self.stats = WriterStats()
        self._manifest = self._recover()
        self._done = _done_ids(self.path)
        self._next_index = 1 + max((_shard_index(s.name) for s in self._manifest.shards), default=-1)
        self._pending: list[_Pending] = []
        self._pending_ids: set[str] = set()
        self._pending_bytes = 0
        self._closed = False

    # -- resume ---------------------------------------------------------------------------------

    def _recover(self) -> Manifest:
        """This rank's manifest, made to agree with its committed shards on disk."""
        self._remove_unfinished()
        manifest = _load_manifest(self.path, self.rank)
        on_disk = {n for n in _committed_shards(self.path) if _shard_rank(n) == self.rank}
        listed = {s.name for s in manifest.shards}
        lost = listed - on_disk
        if lost:  # someone deleted shards: their samples are not done, redo them
            logger.warning("store %s: shards %s are listed but missing; their samples will be "
                           "written again", self.path, sorted(lost))
            manifest.shards = [s for s in manifest.shards if s.name in on_disk]
        for name in sorted(on_disk - listed):
            self._adopt(manifest, name)
        manifest.shards.sort(key=lambda s: s.name)
        if lost or on_disk - listed or not _manifest_path(self.path, self.rank).exists():
            _write_manifest(self.path, manifest)
        return manifest

    def _remove_unfinished(self) -> None:
        """Shards this rank was writing when it died (other ranks may be writing theirs now)."""
        for folder in (self.path / SHARDS_DIR).glob(f"{TMP_PREFIX}r{self.rank:05d}-*"):
            shutil.rmtree(folder)
            self.stats.removed_tmp.append(folder.name)
        for tmp in (self.path / MANIFEST_DIR).glob(f".rank-{self.rank:05d}.json.*.tmp"):
            tmp.unlink()

    def _adopt(self, manifest: Manifest, name: str) -> None:
        """A shard committed just before a crash, before the manifest caught up with it."""
        folder = self.path / SHARDS_DIR / name
        try:
            entry = _entry_of(folder)
            problems = _verify_shard(folder, self.meta)
        except ShardCorruptError as error:
            problems = [Problem(name, error.array, error.sample_ids, str(error))]
        if problems:
            quarantine = folder.with_name(f"{CORRUPT_PREFIX}{uuid.uuid4().hex[:8]}-{name}")
            os.rename(folder, quarantine)
            logger.error("store %s: shard %s failed verification (%s); moved to %s, its samples "
                         "will be written again", self.path, name, problems[0], quarantine.name)
            self.stats.quarantined.append(name)
            return
        manifest.shards.append(entry)
        self.stats.adopted.append(name)

    def done_sample_ids(self) -> set[str]:
        """Samples a resumed dump must skip: committed by any rank, or rejected (they would be
        rejected again), as of this writer's opening, plus the ones it committed or rejected since."""
        return set(self._done)

    def owns(self, sample_id: str) -> bool:
        """Whether this rank writes the sample (`rank_of` its id)."""
        return rank_of(sample_id, self.world_size) == self.rank

    # -- writing --------------------------------------------------------------------------------

    def add(self, sample_id: str, input_ids: torch.Tensor | np.ndarray,
            loss_mask: torch.Tensor | np.ndarray, aux: torch.Tensor | np.ndarray,
            final: torch.Tensor | np.ndarray) -> bool:
        """Buffer a sample (input_ids [T], loss_mask [T], aux [T, n_aux, H], final [T, H]);
        False when it is rejected for non-finite hidden states or no tokens. Nothing is written
        until `commit_if_full` or `close`."""
        if self._closed:
            raise RuntimeError(f"store writer for {self.path} is closed")
        self._check_new(sample_id)
        ids, mask, aux_t, final_t = (torch.as_tensor(v) for v in (input_ids, loss_mask, aux, final))
        self._check_shapes(sample_id, ids, mask, aux_t, final_t)
        reason = _rejection(ids, aux_t, final_t)
        if reason:
            self._record_rejection(sample_id, reason)
            return False
        pending = _Pending(sample_id, self._encode(ids, mask, aux_t, final_t))
        self._pending.append(pending)
        self._pending_ids.add(sample_id)
        self._pending_bytes += pending.nbytes
        return True

    def commit_if_full(self) -> bool:
        """Commit the buffered samples as a shard once they reach storage.shard_bytes.

        The caller chooses where shards may end: calling this only between batches of its work
        means a resumed run restarts on a batch boundary and forms the same batches again.
        """
        if self._pending_bytes < self.storage.shard_bytes:
            return False
        self._commit()
        return True

    def bytes_per_token(self) -> float:
        """Bytes on disk per token of the shards this writer committed (0 before the first)."""
        return self.stats.bytes / self.stats.tokens if self.stats.tokens else 0.0

    def _check_new(self, sample_id: str) -> None:
        if not isinstance(sample_id, str):
            raise TypeError(f"sample ids are strings, got {sample_id!r}")
        if not self.owns(sample_id):
            raise ValueError(f"sample {sample_id!r} belongs to rank "
                             f"{rank_of(sample_id, self.world_size)}, not {self.rank}")
        if sample_id in self._done or sample_id in self._pending_ids:
            raise ValueError(f"sample {sample_id!r} is already in the store {self.path}")

    def _check_shapes(self, sample_id: str, ids: torch.Tensor, mask: torch.Tensor,
                      aux: torch.Tensor, final: torch.Tensor) -> None:
        """A wrong shape is a bug of the caller, not a bad sample: raise."""
        t, n, h = len(ids), self.num_aux, self.hidden_size
        expected = {"input_ids": (t,), "loss_mask": (t,), "aux": (t, n, h), "final": (t, h)}
        actual = {"input_ids": ids.shape, "loss_mask": mask.shape, "aux": aux.shape,
                  "final": final.shape}
        wrong = [f"{k} {tuple(actual[k])} (expected {v})" for k, v in expected.items()
                 if tuple(actual[k]) != v]
        if wrong:
            raise ValueError(f"sample {sample_id!r}: {', '.join(wrong)}")
        if t and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"sample {sample_id!r}: token ids outside [0, {self.vocab_size})")

    def reject(self, sample_id: str, reason: str) -> None:
        """Record a sample the caller could not use (a chat template failure, say): named in the
        manifest with the next commit, and skipped by a resumed run like a written one."""
        self._check_new(sample_id)
        self._record_rejection(sample_id, reason)

    def _record_rejection(self, sample_id: str, reason: str) -> None:
        logger.warning("store %s: sample %r rejected: %s", self.path, sample_id, reason)
        self.stats.rejected[sample_id] = reason
        self._manifest.rejected[sample_id] = reason  # recorded with the next manifest write
        self._done.add(sample_id)

    def _encode(self, ids: torch.Tensor, mask: torch.Tensor, aux: torch.Tensor,
                final: torch.Tensor) -> dict[str, np.ndarray]:
        # Copies (the caller may reuse its buffers), as encode_bf16 and encode_fp8 make too.
        arrays = {INPUT_IDS: ids.to("cpu", torch.int32, copy=True).numpy(),
                  LOSS_MASK: mask.to("cpu", torch.bool, copy=True).numpy()}
        if self.storage.mode == "fp32":
            arrays[AUX] = aux.to("cpu", torch.float32, copy=True).numpy()
            arrays[FINAL] = final.to("cpu", torch.float32, copy=True).numpy()
            return arrays
        if self.storage.mode == "fp8":
            arrays[AUX], arrays[AUX_SCALE] = encode_fp8(aux)
        else:
            arrays[AUX] = encode_bf16(aux)
        arrays[FINAL] = encode_bf16(final)
        return arrays

    def _commit(self) -> None:
        """Write the buffered samples as one shard: tmp folder, fsync, rename, then manifest."""
        name = shard_name(self.rank, self._next_index)
        final_folder = self.path / SHARDS_DIR / name
        tmp_folder = final_folder.with_name(TMP_PREFIX + name)
        arrays = _concatenate(self._pending)
        sample_ids = [p.sample_id for p in self._pending]
        attributes = {"format_version": FORMAT_VERSION, "shard": name, "rank": self.rank,
                      "sample_ids": sample_ids, **self._shard_attributes}
        _write_shard(tmp_folder, arrays, attributes, self.storage)
        _fsync_tree(tmp_folder)
        os.rename(tmp_folder, final_folder)  # the commit point
        _fsync_dir(final_folder.parent)
        entry = ShardEntry(name, sample_ids, np.diff(arrays[OFFSETS]).tolist(),
                           _nbytes_on_disk(final_folder))
        self._manifest.shards.append(entry)
        _write_manifest(self.path, self._manifest)
        self._after_commit(entry)

    def _after_commit(self, entry: ShardEntry) -> None:
        self.stats.samples += len(entry.sample_ids)
        self.stats.tokens += sum(entry.num_tokens)
        self.stats.bytes += entry.nbytes
        self.stats.shards += 1
        self._done.update(entry.sample_ids)
        self._next_index += 1
        self._pending, self._pending_ids, self._pending_bytes = [], set(), 0

    def close(self) -> WriterStats:
        """Commit the last, partial shard and record rejections; the writer cannot add after."""
        if self._closed:
            return self.stats
        if self._pending:
            self._commit()
        elif self.stats.rejected:
            _write_manifest(self.path, self._manifest)
        self._closed = True
        self._lock.close()  # releases the rank's lock
        return self.stats

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, error_type: type[BaseException] | None, *_: object) -> None:
        if error_type is None:
            self.close()
            return
        # The caller failed between two of the points where it lets a shard end: leave the store
        # as a crash would, so that a resumed run redoes exactly the uncommitted samples.
        logger.warning("store %s: %d buffered samples not committed after %s", self.path,
                       len(self._pending), error_type.__name__)
        self._closed = True
        self._lock.close()


def _lock_rank(path: Path, rank: int) -> IO[bytes]:
    """An exclusive lock on this rank of the store, so that two processes that both think they
    are rank r (a launcher whose environment was not read, say) cannot delete each other's
    unfinished shards; the kernel releases it when the process dies, even by SIGKILL."""
    lock = open(path / MANIFEST_DIR / f"rank-{rank:05d}.lock", "wb")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise RuntimeError(f"rank {rank} of store {path} is being written by another process; "
                           "check dump.rank / dump.world_size or RANK / SLURM_PROCID") from None
    return lock


def _shard_rank(name: str) -> int:
    return int(_SHARD_NAME.match(name).group(1))  # type: ignore[union-attr]


def _shard_index(name: str) -> int:
    return int(_SHARD_NAME.match(name).group(2))  # type: ignore[union-attr]


def _rejection(ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor) -> str | None:
    """Why a sample cannot be stored, or None."""
    if len(ids) == 0:
        return "no tokens"
    reasons = []
    for name, values in (("aux", aux), ("final", final)):
        bad = int((~torch.isfinite(values)).sum())
        if bad:
            reasons.append(f"{name} hidden states have {bad} non-finite values (NaN/Inf)")
    return "; ".join(reasons) or None


def _concatenate(pending: Sequence[_Pending]) -> dict[str, np.ndarray]:
    arrays = {name: np.concatenate([p.arrays[name] for p in pending])
              for name in pending[0].arrays}
    lengths = [len(p.arrays[INPUT_IDS]) for p in pending]
    arrays[OFFSETS] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return arrays


def _store_index(path: Path) -> tuple[list[ShardEntry], list[Problem]]:
    """Every committed shard, from the manifests or, for shards none lists yet, from the shard."""
    listed = {s.name: s for m in _all_manifests(path) for s in m.shards}
    entries, problems = [], []
    for name in _committed_shards(path):
        if name in listed:
            entries.append(listed[name])
            continue
        try:
            entries.append(_entry_of(path / SHARDS_DIR / name))
        except ShardCorruptError as error:
            problems.append(Problem(name, error.array, error.sample_ids, str(error)))
    return entries, problems


def _done_ids(path: Path) -> set[str]:
    entries, _ = _store_index(path)
    done = {sample_id for entry in entries for sample_id in entry.sample_ids}
    for manifest in _all_manifests(path):
        done.update(manifest.rejected)
    return done


# ---------------------------------------------------------------------------------------------
# Reader


@dataclass(frozen=True)
class SampleRef:
    shard: str
    sample_id: str
    index: int       # within the shard
    num_tokens: int


@dataclass(frozen=True)
class Sample:
    sample_id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    aux: torch.Tensor        # [T, n_aux, H]
    final: torch.Tensor      # [T, H]


@dataclass(frozen=True)
class Problem:
    """Something `verify` found wrong, with where it is and which samples it spoils."""

    shard: str
    array: str | None
    sample_ids: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        where = f"shard {self.shard}" + (f", array {self.array}" if self.array else "")
        return f"{where}: {self.message} (samples {_name_some(self.sample_ids)})"


def _name_some(sample_ids: Sequence[str]) -> str:
    shown = ", ".join(repr(s) for s in sample_ids[:_MAX_NAMED])
    more = len(sample_ids) - _MAX_NAMED
    return shown + (f" and {more} more" if more > 0 else "") if sample_ids else "none known"


class StoreReader:
    """The committed samples of a store, as torch tensors; the only door of stage 2 to stage 1."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = read_store_meta(self.path)
        self._entries, self._index_problems = _store_index(self.path)
        self._refs = [SampleRef(entry.name, sample_id, i, tokens) for entry in self._entries
                      for i, (sample_id, tokens) in enumerate(zip(entry.sample_ids, entry.num_tokens))]
        self._open: OrderedDict[str, _OpenShard] = OrderedDict()

    @property
    def identity(self) -> dict[str, Any]:
        return self.meta["verifier"]

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.meta["aux_layer_ids"]

    @property
    def aux_convention(self) -> str:
        return self.meta["aux_convention"]

    @property
    def aux_capture(self) -> str:
        return aux_capture_of(self.meta)

    @property
    def hidden_size(self) -> int:
        return int(self.identity["hidden_size"])

    @property
    def mode(self) -> str:
        return self.meta["storage"]["mode"]

    @property
    def dump_config(self) -> dict[str, Any]:
        return self.meta["dump"]

    def shards(self) -> list[ShardEntry]:
        return list(self._entries)

    def samples(self) -> list[SampleRef]:
        """Every committed sample, in shard order."""
        return list(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    def __getitem__(self, i: int) -> Sample:
        return self.read_sample(self._refs[i])

    def read_sample(self, ref: SampleRef, dtype: torch.dtype = torch.bfloat16) -> Sample:
        """One sample, hidden states decoded to `dtype`; ShardCorruptError names a bad shard."""
        shard, rows = self._locate(ref)
        input_ids, loss_mask = self._tokens(shard, rows, ref)
        return Sample(ref.sample_id, input_ids, loss_mask, self._aux(shard, rows, ref, dtype),
                      self._hidden(shard, FINAL, rows, ref).to(dtype))

    def read_tokens(self, ref: SampleRef) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [T] int64, loss_mask [T] bool) of a sample, without its hidden states."""
        shard, rows = self._locate(ref)
        return self._tokens(shard, rows, ref)

    def _locate(self, ref: SampleRef) -> tuple[_OpenShard, slice]:
        shard = self._shard(ref.shard)
        if shard.sample_ids[ref.index] != ref.sample_id:
            raise ShardCorruptError(ref.shard, None, [ref.sample_id], "the manifest and the shard "
                                    f"disagree: sample {ref.index} is {shard.sample_ids[ref.index]!r}")
        return shard, slice(int(shard.offsets[ref.index]), int(shard.offsets[ref.index + 1]))

    def _tokens(self, shard: _OpenShard, rows: slice, ref: SampleRef
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ids = shard.read(INPUT_IDS, rows, [ref.sample_id]).astype(np.int64)
        mask = shard.read(LOSS_MASK, rows, [ref.sample_id]).astype(bool)
        return torch.from_numpy(ids), torch.from_numpy(mask)

    def _aux(self, shard: _OpenShard, rows: slice, ref: SampleRef, dtype: torch.dtype
             ) -> torch.Tensor:
        if self.mode == "fp8":
            codes = shard.read(AUX, rows, [ref.sample_id])
            return decode_fp8(codes, shard.read(AUX_SCALE, rows, [ref.sample_id]), dtype)
        return self._hidden(shard, AUX, rows, ref).to(dtype)

    def _hidden(self, shard: _OpenShard, name: str, rows: slice, ref: SampleRef) -> torch.Tensor:
        """A bf16 or fp32 hidden-state array's rows as a tensor of that dtype."""
        stored = shard.read(name, rows, [ref.sample_id])
        return torch.from_numpy(stored) if self.mode == "fp32" else decode_bf16(stored)

    def _shard(self, name: str) -> _OpenShard:
        if name in self._open:
            self._open.move_to_end(name)
            return self._open[name]
        shard = _OpenShard(self.path / SHARDS_DIR / name)
        self._open[name] = shard
        if len(self._open) > _OPEN_SHARDS:
            self._open.popitem(last=False)
        return shard

    def verify(self) -> list[Problem]:
        """Read every chunk of every committed shard; what failed, where, and which samples."""
        problems = list(self._index_problems) + _duplicates(self._entries)
        for entry in self._entries:
            problems += _verify_shard(self.path / SHARDS_DIR / entry.name, self.meta, entry)
        return problems


def _duplicates(entries: Sequence[ShardEntry]) -> list[Problem]:
    counts = Counter(s for entry in entries for s in entry.sample_ids)
    problems = []
    for entry in entries:
        twice = tuple(s for s in entry.sample_ids if counts[s] > 1)
        if twice:
            problems.append(Problem(entry.name, None, twice, "samples stored in more than one shard"))
    return problems


def _verify_shard(folder: Path, meta: Mapping[str, Any], entry: ShardEntry | None = None
                  ) -> list[Problem]:
    """Metadata against store.json, shapes against the offsets, and every chunk's checksum."""
    try:
        shard = _OpenShard(folder)
    except ShardCorruptError as error:
        ids = entry.sample_ids if entry else error.sample_ids
        return [Problem(folder.name, error.array, tuple(ids), str(error))]
    problems = _metadata_problems(shard, meta, entry)
    for name in _expected_arrays(meta["storage"]["mode"]):
        problems += _chunk_problems(shard, name)
    return problems


def _expected_arrays(mode: str) -> tuple[str, ...]:
    return (INPUT_IDS, LOSS_MASK, AUX, FINAL, OFFSETS) + ((AUX_SCALE,) if mode == "fp8" else ())


def _metadata_problems(shard: _OpenShard, meta: Mapping[str, Any], entry: ShardEntry | None
                       ) -> list[Problem]:
    every = tuple(shard.sample_ids)
    try:
        messages = [f"differs from store.json: {m}" for m in _mismatches(shard.attributes, meta)]
    except KeyError as missing:
        messages = [f"attribute {missing} is missing"]
    if entry is not None and (entry.sample_ids != shard.sample_ids
                              or entry.num_tokens != np.diff(shard.offsets).tolist()):
        messages.append("the manifest's sample ids or token counts differ from the shard's")
    tokens = int(shard.offsets[-1])
    for name in _expected_arrays(meta["storage"]["mode"]):
        rows = len(shard.offsets) if name == OFFSETS else tokens
        array = shard.arrays.get(name)
        if array is None:
            messages.append(f"array {name} is missing")
        elif array.shape[0] != rows:
            messages.append(f"array {name} has {array.shape[0]} rows, the offsets say {rows}")
    return [Problem(shard.name, None, every, m) for m in messages]


def _chunk_problems(shard: _OpenShard, name: str) -> list[Problem]:
    """Read the array a chunk at a time, so that a failure points at the samples it covers."""
    array = shard.arrays.get(name)
    if array is None:
        return []
    rows, problems = array.chunks[0], []
    for start in range(0, array.shape[0], rows):
        stop = min(start + rows, array.shape[0])
        covered = shard.sample_ids if name == OFFSETS else shard.samples_in(start, stop)
        try:
            shard.read(name, slice(start, stop), covered)
        except ShardCorruptError as error:
            problems.append(Problem(shard.name, name, tuple(covered),
                                    f"chunk of rows {start}:{stop} is unreadable: "
                                    f"{error.__cause__ or error}"))
    return problems


# ---------------------------------------------------------------------------------------------
# inspect


def inspect_store(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """Counts, sizes and (unless verify=False) the result of reading every chunk and checking its
    checksum; `format_inspect` prints it."""
    reader = StoreReader(path)
    entries = reader.shards()
    tokens = sum(sum(e.num_tokens) for e in entries)
    disk = _bytes_by_array(reader)
    logical = _logical_bytes(reader)
    on_disk = sum(disk.values())
    hidden, n_aux = reader.hidden_size, len(reader.aux_layer_ids)
    reference = (n_aux + 1) * hidden * 2  # bf16 aux + final, uncompressed: 4*H*2 for 3 aux layers
    problems = reader.verify() if verify else None
    rejected = {k: v for m in _all_manifests(reader.path) for k, v in m.rejected.items()}
    return {
        "path": str(reader.path),
        "format_version": reader.meta["format_version"],
        "verifier": reader.identity.get("name"),
        "hidden_size": hidden,
        "aux_layer_ids": reader.aux_layer_ids,
        "aux_convention": reader.aux_convention,
        "aux_capture": reader.aux_capture,
        "mode": reader.mode,
        "compressor": reader.meta["storage"]["compressor"],
        "shards": len(entries),
        "samples": len(reader),
        "tokens": tokens,
        "rejected": rejected,
        "unfinished_shards": _hidden_shards(reader.path, TMP_PREFIX),
        "quarantined_shards": _hidden_shards(reader.path, CORRUPT_PREFIX),
        "bytes_on_disk": on_disk,
        "bytes_on_disk_by_array": disk,
        "bytes_per_token": on_disk / tokens if tokens else None,
        "logical_bytes_per_token": logical / tokens if tokens else None,
        "reference_bytes_per_token": reference,
        "compression_ratio": logical / on_disk if on_disk else None,
        "ratio_to_reference": reference * tokens / on_disk if on_disk else None,
        "problems": None if problems is None else [str(p) for p in problems],
    }


def _hidden_shards(path: Path, prefix: str) -> list[str]:
    return sorted(p.name for p in (path / SHARDS_DIR).glob(f"{prefix}*"))


def _bytes_by_array(reader: StoreReader) -> dict[str, int]:
    """Bytes on disk of each array's data files over all committed shards; every zarr.json is
    counted under 'metadata'."""
    sizes: Counter[str] = Counter()
    for entry in reader.shards():
        folder = reader.path / SHARDS_DIR / entry.name
        for file in folder.rglob("*"):
            if file.is_file():
                key = "metadata" if file.name == "zarr.json" else file.relative_to(folder).parts[0]
                sizes[key] += file.stat().st_size
    return dict(sizes)


def _logical_bytes(reader: StoreReader) -> int:
    """Uncompressed bytes of the arrays in their storage dtypes, metadata-only reads."""
    total = 0
    for entry in reader.shards():
        try:
            total += sum(a.nbytes for a in reader._shard(entry.name).arrays.values())
        except ShardCorruptError:
            continue  # counted among the problems
    return total


def format_inspect(report: Mapping[str, Any]) -> str:
    """The report of `inspect_store` as lines for a terminal."""
    def per_token(key: str) -> str:
        value = report[key]
        return "n/a" if value is None else f"{value:,.1f} bytes"

    lines = [
        f"store         {report['path']} (format {report['format_version']})",
        f"verifier      {report['verifier']}: H={report['hidden_size']}, aux layers "
        f"{report['aux_layer_ids']} ({report['aux_convention']} convention, "
        f"{report['aux_capture']} capture)",
        f"storage       {report['mode']}, compressor {report['compressor']}",
        f"contents      {report['shards']:,} shards, {report['samples']:,} samples, "
        f"{report['tokens']:,} tokens, {len(report['rejected']):,} rejected",
        f"on disk       {report['bytes_on_disk']:,} bytes = {per_token('bytes_per_token')}/token",
        f"uncompressed  {per_token('logical_bytes_per_token')}/token in the storage dtypes: "
        f"compression ratio {_ratio(report['compression_ratio'])}",
        f"reference     {report['reference_bytes_per_token']:,} bytes/token ((n_aux+1)*H*2: bf16 aux "
        f"+ final, uncompressed); reference / on disk = {_ratio(report['ratio_to_reference'])}",
    ]
    for array, nbytes in sorted(report["bytes_on_disk_by_array"].items()):
        share = nbytes / report["tokens"] if report["tokens"] else 0
        lines.append(f"  {array:16} {nbytes:>16,} bytes {share:12,.1f} bytes/token")
    for sample_id, reason in list(report["rejected"].items())[:_MAX_NAMED]:
        lines.append(f"rejected      {sample_id!r}: {reason}")
    if report["unfinished_shards"]:
        lines.append(f"unfinished    {len(report['unfinished_shards'])} shards being written or "
                     f"left by a crash (removed when their rank resumes)")
    if report["quarantined_shards"]:
        lines.append(f"quarantined   {', '.join(report['quarantined_shards'])} (failed verification "
                     "when adopted after a crash; their samples were written again)")
    if report["problems"] is None:
        lines.append("checksums     not verified")
    elif report["problems"]:
        lines.append(f"PROBLEMS      {len(report['problems'])}:")
        lines += [f"  {p}" for p in report["problems"]]
    else:
        lines.append("checksums     every chunk and shard index verified: OK")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"

