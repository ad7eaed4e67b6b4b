"""Reading a store: `StoreReader` (the only door of stage 2 to stage 1), its samples, and the
verification of every shard's metadata and chunk checksums (`Problem`, `ShardCorruptError`)."""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from config.groups import StoreConf
from store.durable import (ShardEntry, StoreCorruptError, _all_manifests, _committed_shards,
                           _nbytes_on_disk, _sha256_file)
from store.encoding import decode_bf16_planes, decode_fp4, decode_fp8, target_rows
from store.format import (AUX, AUX_SCALE, FINAL, FINAL_OFFSETS, INPUT_IDS, LOSS_MASK, OFFSETS, SHARDS_DIR,
                          TARGET_IDS, TARGET_LOGPROBS, _data_file, final_arrays, shard_arrays)
from store.identity import _mismatches, aux_capture_of, read_store_meta, storage_of
from store.progress import SampleRetiredError, read_retired

# Readers keep this many shards' Zarr metadata open (a trainer touches shards at random).
_OPEN_SHARDS = 64
_MAX_NAMED = 10  # sample ids shown in one message


class ShardCorruptError(StoreCorruptError):
    """A shard's data cannot be read back: a checksum mismatch, a truncated file, bad metadata.
    `file` is the damaged file relative to the store, where known."""

    def __init__(self, shard: str, array: str | None, sample_ids: Sequence[str], detail: str,
                 file: str | None = None):
        self.shard, self.array, self.sample_ids, self.detail = shard, array, tuple(sample_ids), detail
        super().__init__(f"{_where(shard, array, file)}: {detail} (samples "
                         f"{_name_some(self.sample_ids)})", file)


@dataclass(frozen=True)
class SampleRef:
    shard: str
    sample_id: str
    index: int       # within the shard
    num_tokens: int


@dataclass(frozen=True)
class Sample:
    """One sample as stored. With final_rows loss only the target rows (`target_rows`) of the
    final side are stored: the other rows of final are 0, of target_ids -1, of target_logprobs
    -inf."""

    sample_id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    aux: torch.Tensor        # [T, n_aux, H], decoded to the requested dtype
    final: torch.Tensor | None  # [T, H], decoded to the requested dtype; None where final is topk
    target_ids: torch.Tensor | None = None       # [T, k] int64 where final is topk, else None
    target_logprobs: torch.Tensor | None = None  # [T, k] float32 where final is topk, else None


@dataclass(frozen=True)
class Problem:
    """Something `verify` found wrong, with where it is and which samples it spoils."""

    shard: str
    array: str | None
    sample_ids: tuple[str, ...]
    message: str
    file: str | None = None  # relative to the store

    def __str__(self) -> str:
        where = _where(self.shard, self.array, self.file)
        return f"{where}: {self.message} (samples {_name_some(self.sample_ids)})"


def _problem(error: ShardCorruptError, sample_ids: Sequence[str] | None = None) -> Problem:
    """The Problem an error of a shard makes; sample_ids where the caller knows them better."""
    ids = error.sample_ids if sample_ids is None else tuple(sample_ids)
    return Problem(error.shard, error.array, ids, error.detail, error.file)


def _where(shard: str, array: str | None, file: str | None) -> str:
    return (f"shard {shard}" + (f", array {array}" if array else "")
            + (f", file {file}" if file else ""))


def _name_some(sample_ids: Sequence[str]) -> str:
    shown = ", ".join(repr(s) for s in sample_ids[:_MAX_NAMED])
    more = len(sample_ids) - _MAX_NAMED
    return shown + (f" and {more} more" if more > 0 else "") if sample_ids else "none known"


def _check_metadata(folder: Path, metadata_sha256: Mapping[str, str], sample_ids: Sequence[str]
                    ) -> None:
    """Each zarr.json of the shard against the sha256 its manifest entry holds, before Zarr parses
    any: a damaged codec parameter would otherwise pass unseen, a damaged shape be believed."""
    for relative, digest in metadata_sha256.items():
        file = folder / relative
        try:
            found = _sha256_file(file)
        except OSError as error:
            found, detail = None, f"cannot be read ({error.strerror})"
        else:
            detail = "differs from the sha256 its manifest entry holds: it was changed or damaged"
        if found != digest:
            array = relative.split("/")[0] if "/" in relative else None
            raise ShardCorruptError(folder.name, array, sample_ids, f"this zarr.json {detail}",
                                    f"{SHARDS_DIR}/{folder.name}/{relative}")


class _OpenShard:
    """A committed shard's Zarr group, arrays and offsets, opened for reading; its metadata
    checked against its manifest entry where one lists it."""

    def __init__(self, folder: Path, entry: ShardEntry | None = None):
        self.name = folder.name
        known = entry.sample_ids if entry else ()
        if entry is not None:
            _check_metadata(folder, entry.metadata_sha256, known)
        try:
            group = zarr.open_group(str(folder), mode="r", zarr_format=3)
            self.attributes = dict(group.attrs)
            self.sample_ids: list[str] = list(self.attributes["sample_ids"])
            self.arrays = {name: array for name, array in group.arrays()}
        except Exception as error:  # metadata missing or not JSON: the whole shard is unreadable
            raise ShardCorruptError(self.name, None, known, f"cannot open: {error!r}") from error
        offsets = self.read(OFFSETS, slice(None), self.sample_ids)
        self.offsets: np.ndarray = offsets.astype(np.int64)
        if len(self.offsets) != len(self.sample_ids) + 1:
            raise ShardCorruptError(self.name, OFFSETS, self.sample_ids,
                                    f"{len(self.offsets)} offsets for {len(self.sample_ids)} samples")
        # Where the final side keeps only target rows, its own offsets; else the token offsets.
        self.final_offsets = self.offsets
        if FINAL_OFFSETS in self.arrays:
            self.final_offsets = self.read(FINAL_OFFSETS, slice(None), self.sample_ids).astype(np.int64)
            if len(self.final_offsets) != len(self.offsets):
                raise ShardCorruptError(self.name, FINAL_OFFSETS, self.sample_ids,
                                        f"{len(self.final_offsets)} offsets for "
                                        f"{len(self.sample_ids)} samples")

    def read(self, name: str, rows: slice, sample_ids: Sequence[str]) -> np.ndarray:
        """array[rows]; a failed read (checksum, truncation, decompression) names the samples."""
        if name not in self.arrays:
            raise ShardCorruptError(self.name, name, sample_ids, "array is missing")
        array = self.arrays[name]
        if rows.start is not None and rows.start == rows.stop:  # a sample with no final-side rows
            return np.empty((0, *array.shape[1:]), array.dtype)
        try:
            return array[rows]
        except Exception as error:
            raise ShardCorruptError(self.name, name, sample_ids, f"cannot read: {error}",
                                    f"{SHARDS_DIR}/{self.name}/{_data_file(name, array.ndim)}") from error

    def samples_in(self, start: int, stop: int, offsets: np.ndarray | None = None) -> list[str]:
        """Ids of the samples with rows in [start, stop): tokens, or the rows of `offsets`."""
        bounds = self.offsets if offsets is None else offsets
        hit = (bounds[:-1] < stop) & (bounds[1:] > start)
        return [self.sample_ids[i] for i in np.flatnonzero(hit)]


def _entry_of(folder: Path, metadata_sha256: Mapping[str, str] | None = None) -> ShardEntry:
    """A shard's manifest entry, read from the shard itself, recording the given metadata hashes."""
    shard = _OpenShard(folder)
    return ShardEntry(name=folder.name, sample_ids=shard.sample_ids,
                      num_tokens=np.diff(shard.offsets).tolist(), nbytes=_nbytes_on_disk(folder),
                      metadata_sha256=dict(metadata_sha256 or {}))


def _store_index(path: Path, retired: Mapping[str, ShardEntry] | None = None
                 ) -> tuple[list[ShardEntry], list[Problem]]:
    """Every committed shard not retired (store/progress.py), from the manifests or, for shards
    none lists yet, from the shard."""
    listed = {s.name: s for m in _all_manifests(path) for s in m.shards}
    retired = read_retired(path) if retired is None else retired
    entries, problems = [], []
    for name in _committed_shards(path):
        if name in retired:          # recorded, not yet deleted (an interrupted retirement)
            continue
        if name in listed:
            entries.append(listed[name])
            continue
        try:
            entries.append(_entry_of(path / SHARDS_DIR / name))
        except ShardCorruptError as error:
            problems.append(_problem(error))
    return entries, problems


class StoreReader:
    """The committed samples of a store, as torch tensors; the only door of stage 2 to stage 1.

    Opening raises StoreCorruptError naming a damaged store.json or manifest; reading a sample,
    ShardCorruptError naming the damaged shard file. Nothing damaged is returned as data.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = read_store_meta(self.path)
        self._storage = storage_of(self.meta)
        self._refresh_retired()                       # self.retired: name -> entry (history, not data)
        self._entries, self._index_problems = _store_index(self.path, self.retired)
        self._by_name = {entry.name: entry for entry in self._entries}
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
    def storage(self) -> StoreConf:
        """The settings the store was written with."""
        return self._storage

    @property
    def mode(self) -> str:
        """The label of the store's preset (conf/store: lossless, fp8, ...)."""
        return self._storage.mode

    @property
    def aux_encoding(self) -> str:
        return self._storage.aux

    @property
    def final_encoding(self) -> str:
        return self._storage.final

    @property
    def final_rows(self) -> str:
        return self._storage.final_rows

    @property
    def topk(self) -> int | None:
        """k of a store whose final side is the verifier's top-k; None for a hidden-state one."""
        return self._storage.topk if self._storage.final == "topk" else None

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
        aux = self._aux(shard, rows, ref, dtype)
        final_side = self._final_side(shard, ref, loss_mask)
        if self._storage.final == "topk":
            return Sample(ref.sample_id, input_ids, loss_mask, aux, None,
                          self._spread(final_side[TARGET_IDS].astype(np.int64), final_side, -1),
                          self._spread(final_side[TARGET_LOGPROBS].astype(np.float32), final_side,
                                       -np.inf))
        final = self._decode_hidden(final_side[FINAL], self._storage.final, dtype)
        return Sample(ref.sample_id, input_ids, loss_mask, aux, self._spread(final, final_side, 0))

    def read_tokens(self, ref: SampleRef) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [T] int64, loss_mask [T] bool) of a sample, without its hidden states."""
        shard, rows = self._locate(ref)
        return self._tokens(shard, rows, ref)

    def _locate(self, ref: SampleRef) -> tuple[_OpenShard, slice]:
        if ref.shard not in self._open and not (self.path / SHARDS_DIR / ref.shard).exists():
            self._refresh_retired()              # retired since this reader opened the store?
        if ref.shard in self.retired or ref.sample_id in self._retired_samples:
            raise SampleRetiredError(ref.sample_id, self._retired_samples.get(ref.sample_id, ref.shard), self.path)
        shard = self._shard(ref.shard)
        if shard.sample_ids[ref.index] != ref.sample_id:
            raise ShardCorruptError(ref.shard, None, [ref.sample_id], "the manifest and the shard "
                                    f"disagree: sample {ref.index} is {shard.sample_ids[ref.index]!r}")
        return shard, slice(int(shard.offsets[ref.index]), int(shard.offsets[ref.index + 1]))

    def _refresh_retired(self) -> None:
        self.retired = read_retired(self.path)
        self._retired_samples = {sample: e.name for e in self.retired.values() for sample in e.sample_ids}

    def _tokens(self, shard: _OpenShard, rows: slice, ref: SampleRef
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ids = shard.read(INPUT_IDS, rows, [ref.sample_id]).astype(np.int64)
        mask = shard.read(LOSS_MASK, rows, [ref.sample_id]).astype(bool)
        return torch.from_numpy(ids), torch.from_numpy(mask)

    def _aux(self, shard: _OpenShard, rows: slice, ref: SampleRef, dtype: torch.dtype
             ) -> torch.Tensor:
        encoding, codes = self._storage.aux, shard.read(AUX, rows, [ref.sample_id])
        if encoding == "fp8":
            return decode_fp8(codes, shard.read(AUX_SCALE, rows, [ref.sample_id]), dtype)
        if encoding == "fp4":
            return decode_fp4(codes, shard.read(AUX_SCALE, rows, [ref.sample_id]),
                              self._storage.fp4_block, dtype)
        return self._decode_hidden(codes, encoding, dtype)

    @staticmethod
    def _decode_hidden(stored: np.ndarray, encoding: str, dtype: torch.dtype) -> torch.Tensor:
        """A bf16 or fp32 hidden-state array's rows as `dtype` (bf16: byte planes, uint8)."""
        if encoding == "fp32":
            return torch.from_numpy(stored).to(dtype)
        return decode_bf16_planes(stored).to(dtype)

    def _final_side(self, shard: _OpenShard, ref: SampleRef, loss_mask: torch.Tensor
                    ) -> dict[str, Any]:
        """The sample's stored rows of each final-side array, and where they go ("rows": a
        slice of all T rows, or the bool mask of its target rows)."""
        start, stop = int(shard.final_offsets[ref.index]), int(shard.final_offsets[ref.index + 1])
        found: dict[str, Any] = {"rows": slice(None), "length": len(loss_mask)}
        if self._storage.final_rows == "loss":
            found["rows"] = target_rows(loss_mask)
            if int(found["rows"].sum()) != stop - start:
                raise ShardCorruptError(shard.name, FINAL_OFFSETS, [ref.sample_id],
                                        f"{stop - start} final-side rows stored, the loss mask has "
                                        f"{int(found['rows'].sum())} target rows")
        for name in final_arrays(self._storage):
            found[name] = shard.read(name, slice(start, stop), [ref.sample_id])
        return found

    @staticmethod
    def _spread(values: torch.Tensor | np.ndarray, final_side: Mapping[str, Any], fill: float
                ) -> torch.Tensor:
        """A final-side array's rows of a sample in place among its T rows, `fill` elsewhere."""
        values = torch.as_tensor(values)
        if isinstance(final_side["rows"], slice):  # final_rows all: every row is there
            return values
        full = torch.full((final_side["length"], *values.shape[1:]), fill, dtype=values.dtype)
        full[final_side["rows"]] = values
        return full

    def _shard(self, name: str) -> _OpenShard:
        if name in self._open:
            self._open.move_to_end(name)
            return self._open[name]
        shard = _OpenShard(self.path / SHARDS_DIR / name, self._by_name.get(name))
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
        shard = _OpenShard(folder, entry)
    except ShardCorruptError as error:
        return [_problem(error, entry.sample_ids if entry else None)]
    problems = _metadata_problems(shard, meta, entry)
    for name in shard_arrays(storage_of(meta)):
        problems += _chunk_problems(shard, name)
    return problems + _final_offsets_problems(shard, storage_of(meta))


def _final_offsets_problems(shard: _OpenShard, storage: StoreConf) -> list[Problem]:
    """Each sample's count of stored final-side rows against the target rows of its loss mask
    (a checksum cannot see a writer that put them wrong)."""
    if storage.final_rows != "loss" or FINAL_OFFSETS not in shard.arrays:
        return []
    try:
        mask = torch.from_numpy(shard.read(LOSS_MASK, slice(None), shard.sample_ids).astype(bool))
    except ShardCorruptError:
        return []  # an unreadable chunk, named by _chunk_problems
    wrong = [sample_id for i, sample_id in enumerate(shard.sample_ids)
             if int(target_rows(mask[shard.offsets[i]:shard.offsets[i + 1]]).sum())
             != shard.final_offsets[i + 1] - shard.final_offsets[i]]
    return [Problem(shard.name, FINAL_OFFSETS, tuple(wrong), "the final-side rows it gives do "
                    "not match the target rows of the loss mask")] if wrong else []


def _metadata_problems(shard: _OpenShard, meta: Mapping[str, Any], entry: ShardEntry | None
                       ) -> list[Problem]:
    every = tuple(shard.sample_ids)
    try:
        messages = [f"differs from store.json: {m}" for m in _mismatches(shard.attributes, meta)]
    except KeyError as missing:
        messages = [f"attribute {missing} is missing"]
    except (ValueError, TypeError) as error:
        messages = [f"its storage attributes cannot be read: {error}"]
    if entry is not None and (entry.sample_ids != shard.sample_ids
                              or entry.num_tokens != np.diff(shard.offsets).tolist()):
        messages.append("the manifest's sample ids or token counts differ from the shard's")
    storage = storage_of(meta)
    for name in shard_arrays(storage):
        array = shard.arrays.get(name)
        rows = _expected_rows(shard, storage, name)
        if array is None:
            messages.append(f"array {name} is missing")
        elif array.shape[0] != rows:
            messages.append(f"array {name} has {array.shape[0]} rows, the offsets say {rows}")
    return [Problem(shard.name, None, every, m) for m in messages]


def _expected_rows(shard: _OpenShard, storage: StoreConf, name: str) -> int:
    if name in (OFFSETS, FINAL_OFFSETS):
        return len(shard.offsets)
    if name in final_arrays(storage):
        return int(shard.final_offsets[-1])
    return int(shard.offsets[-1])


def _chunk_problems(shard: _OpenShard, name: str) -> list[Problem]:
    """Read the array a chunk at a time, so that a failure points at the samples it covers."""
    array = shard.arrays.get(name)
    if array is None:
        return []
    rows, problems = array.chunks[0], []
    # The final side's rows are located by final_offsets where it holds target rows only.
    offsets = shard.final_offsets if name in (FINAL, TARGET_IDS, TARGET_LOGPROBS) else shard.offsets
    for start in range(0, array.shape[0], rows):
        stop = min(start + rows, array.shape[0])
        covered = (shard.sample_ids if name in (OFFSETS, FINAL_OFFSETS)
                   else shard.samples_in(start, stop, offsets))
        try:
            shard.read(name, slice(start, stop), covered)
        except ShardCorruptError as error:
            problems.append(Problem(shard.name, name, tuple(covered),
                                    f"chunk of rows {start}:{stop} is unreadable: "
                                    f"{error.__cause__ or error}", error.file))
    return problems
