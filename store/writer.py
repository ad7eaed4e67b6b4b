"""Writing a store: `StoreWriter` commits one rank's samples a shard at a time and resumes after a
crash; `dist_env` and `rank_of` say which rank this is and which samples it owns;
`StoreWriteError` is a disk that refused a write (full, over quota, read-only)."""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from config.choices import AuxCapture
from data.records import Origin
from data.split import copied_from
from data.rejection import Rejection, RejectionKind
from infra import failpoint
from store.durable import (Manifest, ShardEntry, _all_manifests, _committed_shards, _load_manifest, _lock_rank,
                           _manifest_path, _metadata_sha256, _nbytes_on_disk, _write_manifest)
from store.format import (CORRUPT_PREFIX, FORMAT_VERSION, MANIFEST_DIR, OFFSETS, SHARDS_DIR, TMP_PREFIX,
                          _shard_index, _shard_rank, _write_shard, shard_name)
from store.identity import _create_or_check_meta, _store_meta
from store.progress import clear_rank_state, clear_waiting, mark_done, read_retired, set_waiting, shards_bytes
from store.reader import ShardCorruptError, _entry_of, _problem, _store_index, _verify_shard
from store.sealed import fsync_dir, fsync_tree
from store.settings import storage_settings
from store.shard_buffer import Pending, ShardBuffer, checked_head, concatenate, encode_sample

logger = logging.getLogger(__name__)


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
    order of the data nor on which samples an earlier run already wrote; a sampled copy
    (data/split.py) goes with the sample it copies, whose rank answers both."""
    digest = hashlib.blake2b(copied_from(sample_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % world_size


class StoreWriteError(OSError):
    """The store's disk refused a write: full (ENOSPC), over quota (EDQUOT), read-only (EROFS), not
    permitted (EACCES, EPERM), or the store's path cannot be a folder. What was committed before
    is kept; once the cause is fixed, rerunning the same command resumes the store."""

    def __init__(self, code: int, message: str, store: Path):
        super().__init__(code, message)
        self.store = store


def _cause(error: OSError) -> str:
    return (error.strerror or str(error)) + (f": {error.filename}" if error.filename else "")


def _remedy(code: int | None) -> str:
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "free space on its disk (or raise the quota)"
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "make its folder writable"
    if code in (errno.ENOTDIR, errno.EEXIST):
        return "move the file that stands where a folder of the store path must be"
    return "fix the cause named above"


def _shards(n: int) -> str:
    return f"{n} shard" + ("" if n == 1 else "s")


@dataclass
class WriterStats:
    samples: int = 0    # written (committed) by this writer
    tokens: int = 0
    bytes: int = 0      # on disk
    shards: int = 0
    rejected: dict[str, Rejection] = field(default_factory=dict)  # sample id -> record, this run
    removed_tmp: list[str] = field(default_factory=list)    # unfinished shards of a crashed run
    adopted: list[str] = field(default_factory=list)        # committed shards missing from the manifest
    quarantined: list[str] = field(default_factory=list)    # such shards that failed verification
    waited_s: float = 0.0   # time spent waiting for room under max_bytes


class StoreWriter:
    """Writes one rank's share of a store: `add` buffers samples, and commits the buffered ones as
    a shard first where the new sample would take them past storage.shard_bytes (so a shard holds
    at most shard_bytes of buffered arrays, or one sample that alone is larger); `commit_if_full`
    commits a buffer that has reached shard_bytes, `close` what is left.

    Reopening a store after a crash resumes it: this rank's unfinished shards are removed, its
    committed shards missing from its manifest adopted, and `done_sample_ids()` says what to skip.

    target_head: the verifier's lm_head [V, H], needed where the storage settings say final: topk
    (the writer stores the top-k of log_softmax(final @ target_head.T), computed on its device);
    unused otherwise.

    heldout: which sample ids are held out; those go into shards of their own (manifest entry
    `heldout`), which the trainer holds out and a following trainer never retires. None: one kind
    of shard.
    max_bytes: before writing a shard, wait (polling every poll_s seconds, saying why, marked in
    the store for a following trainer: store/progress.py) while the store's shards hold at least
    this many bytes on disk; so the disk holds at most max_bytes plus one shard per writing rank.
    `close(done=True)` marks the rank's share of the data complete.
    """

    def __init__(self, path: str | Path, identity: Mapping[str, Any], aux_layer_ids: Sequence[int],
                 storage_cfg: Mapping[str, Any], dump_cfg: Any = None, *, aux_convention: str,
                 aux_capture: str = AuxCapture.residual_stream.value, rank: int | None = None,
                 world_size: int | None = None, target_head: torch.Tensor | None = None,
                 heldout: Callable[[str], bool] | None = None, max_bytes: int | None = None,
                 poll_s: float = 1.0):
        self.path = Path(path)
        self._heldout, self.max_bytes, self.poll_s = heldout, max_bytes, poll_s
        self.rank, self.world_size = dist_env(rank, world_size)
        self.storage = storage_settings(storage_cfg)
        wanted = _store_meta(identity, aux_layer_ids, aux_convention, aux_capture, self.storage,
                             dump_cfg)
        # This run's settings go into its shards (the same as store.json where it matters).
        self._shard_attributes = {k: v for k, v in wanted.items() if k != "format_version"}
        self.hidden_size = int(wanted["verifier"]["hidden_size"])
        self.vocab_size = int(wanted["verifier"]["vocab_size"])
        self.num_aux = len(wanted["aux_layer_ids"])
        self._target_head = checked_head(self.storage, target_head, self.hidden_size, self.vocab_size)
        self.stats = WriterStats()
        self._lock: IO[bytes] | None = None
        try:
            self._open(wanted)
        except BaseException as error:
            if self._lock is not None:
                self._lock.close()
            if isinstance(error, OSError) and not isinstance(error, StoreWriteError):
                raise StoreWriteError(error.errno or errno.EIO, self._open_failure(error),
                                      self.path) from error
            raise
        self._next_index = 1 + max((_shard_index(s.name) for s in self._manifest.shards), default=-1)
        self._buffers = {False: ShardBuffer(False), True: ShardBuffer(True)}
        self._closed = False

    # -- opening and resuming ------------------------------------------------------------------

    def _open(self, wanted: dict[str, Any]) -> None:
        """The store's folders, its store.json (created or checked), this rank's lock, and its
        manifest, made to agree with its shards on disk."""
        for folder in (self.path, self.path / SHARDS_DIR, self.path / MANIFEST_DIR):
            folder.mkdir(parents=True, exist_ok=True)
        self.meta = _create_or_check_meta(self.path, wanted)
        self._lock = _lock_rank(self.path, self.rank)
        clear_rank_state(self.path, self.rank)         # being written: not done, not waiting
        self._manifest = self._recover()
        self._done = _done_ids(self.path)

    def _open_failure(self, error: OSError) -> str:
        return (f"cannot write the store at {self.path}: {_cause(error)}. To write it there, "
                f"{_remedy(error.errno)}, or give another store path; then rerun the same command")

    def _recover(self) -> Manifest:
        """This rank's manifest, made to agree with its committed shards on disk."""
        self._remove_unfinished()
        manifest = _load_manifest(self.path, self.rank)
        on_disk = {n for n in _committed_shards(self.path) if _shard_rank(n) == self.rank}
        listed = {s.name for s in manifest.shards}
        lost = listed - on_disk - set(read_retired(self.path))   # retired shards are done, not lost
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
            # Hashed first, then verified against that hash: what is verified is what is listed.
            entry = _entry_of(folder, _metadata_sha256(folder))
            problems = _verify_shard(folder, self.meta, entry)
        except ShardCorruptError as error:
            problems = [_problem(error)]
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
            final: torch.Tensor | np.ndarray, origin: Origin | None = None) -> bool:
        """Buffer a sample (input_ids [T], loss_mask [T], aux [T, n_aux, H], final [T, H]: every
        row; the storage settings choose what is kept of final); False when it is rejected for
        non-finite hidden states or no tokens, its record (naming `origin`, the record it came
        from) then in `stats.rejected`. Where the sample would take its buffer past
        storage.shard_bytes, the buffer is committed first (`_commit_buffer`): at Kimi's width one
        capture call holds many shards' worth of states."""
        if self._closed:
            raise RuntimeError(f"store writer for {self.path} is closed")
        self._check_new(sample_id)
        ids, mask, aux_t, final_t = (torch.as_tensor(v) for v in (input_ids, loss_mask, aux, final))
        self._check_shapes(sample_id, ids, mask, aux_t, final_t)
        rejection = _rejection(sample_id, origin, ids, aux_t, final_t)
        if rejection is not None:
            self._record_rejection(rejection)
            return False
        heldout = self._heldout is not None and self._heldout(sample_id)
        pending = Pending(sample_id, encode_sample(self.storage, self._target_head, ids, mask, aux_t, final_t))
        buffer = self._buffers[heldout]
        if buffer.samples and buffer.nbytes + pending.nbytes > self.storage.shard_bytes:
            self._commit_buffer(buffer)
        buffer.add(pending)
        return True

    def commit_if_full(self) -> bool:
        """Commit the buffered samples as a shard once they reach storage.shard_bytes (a sample
        that alone is larger). A caller calls it where its work allows a shard to end; `add` also
        commits before a sample that would overflow the buffer, and a resumed dump redoes only the
        calls with a sample not yet committed (dump/pipeline.py)."""
        committed = False
        for buffer in self._buffers.values():
            # Read at its turn: a training shard's commit takes the held-out buffer with it.
            if buffer.samples and buffer.nbytes >= self.storage.shard_bytes:
                self._commit_buffer(buffer)
                committed = True
        return committed

    def _commit_buffer(self, buffer: ShardBuffer) -> None:
        """Commit one buffer; with a training shard, the held-out samples buffered so far (a small
        shard of their own), so that a resumed dump redoes no more calls than one shard's worth."""
        held = self._buffers[True]
        self._commit(buffer)
        if buffer is not held and held.samples:
            self._commit(held)

    def bytes_per_token(self) -> float:
        """Bytes on disk per token of the shards this writer committed (0 before the first)."""
        return self.stats.bytes / self.stats.tokens if self.stats.tokens else 0.0

    def _check_new(self, sample_id: str) -> None:
        if not isinstance(sample_id, str):
            raise TypeError(f"sample ids are strings, got {sample_id!r}")
        if not self.owns(sample_id):
            raise ValueError(f"sample {sample_id!r} belongs to rank "
                             f"{rank_of(sample_id, self.world_size)}, not {self.rank}")
        if sample_id in self._done or any(sample_id in b.ids for b in self._buffers.values()):
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

    def reject(self, rejection: Rejection) -> None:
        """Record a sample the caller could not use (a chat template failure, say): kept in the
        manifest with the next commit, and skipped by a resumed run like a written one."""
        self._check_new(rejection.sample)
        self._record_rejection(rejection)

    def _record_rejection(self, rejection: Rejection) -> None:
        logger.warning("store %s: rejected %s", self.path, rejection)
        self.stats.rejected[rejection.sample] = rejection
        self._manifest.rejected[rejection.sample] = rejection  # recorded with the next manifest write
        self._done.add(rejection.sample)

    def _commit(self, buffer: ShardBuffer) -> None:
        """Write a buffer's samples as one shard: tmp folder, fsync, rename (the commit point),
        then the manifest. A write the disk refuses stops the writer with StoreWriteError."""
        self._wait_for_room()
        name = shard_name(self.rank, self._next_index)
        final_folder = self.path / SHARDS_DIR / name
        tmp_folder = final_folder.with_name(TMP_PREFIX + name)
        arrays = concatenate(buffer.samples, self.storage)
        try:
            metadata = self._write_tmp_shard(tmp_folder, arrays, buffer)
            failpoint("store.shard.before_rename")
            os.rename(tmp_folder, final_folder)  # the commit point
        except OSError as error:
            shutil.rmtree(tmp_folder, ignore_errors=True)  # gives back the space it took
            raise self._stop(error, name, committed=False) from error
        entry = ShardEntry(name, [p.sample_id for p in buffer.samples],
                           np.diff(arrays[OFFSETS]).tolist(), 0, metadata, buffer.heldout)
        try:
            fsync_dir(final_folder.parent)
            failpoint("store.shard.after_rename")
            entry.nbytes = _nbytes_on_disk(final_folder)
            self._manifest.shards.append(entry)
            _write_manifest(self.path, self._manifest)
        except OSError as error:
            raise self._stop(error, name, committed=True) from error
        self._after_commit(entry, buffer)

    def _wait_for_room(self) -> None:
        """Under max_bytes: wait while the store's shards fill it (a following trainer retires
        them), marked in the store and said once per wait."""
        if self.max_bytes is None:
            return
        began, said = time.monotonic(), False
        while (held := shards_bytes(self.path)) >= self.max_bytes:
            if not said:
                set_waiting(self.path, self.rank, held, self.max_bytes)
                logger.warning("store %s: rank %d waits: its shards hold %d bytes, store.max_bytes is %d; "
                               "a following trainer (train.follow) retires the shards it has trained on",
                               self.path, self.rank, held, self.max_bytes)
                said = True
            time.sleep(self.poll_s)
        if said:
            clear_waiting(self.path, self.rank)
            self.stats.waited_s += time.monotonic() - began

    def _write_tmp_shard(self, folder: Path, arrays: Mapping[str, np.ndarray], buffer: ShardBuffer) -> dict[str, str]:
        """The shard written and flushed under its tmp name; the sha256 of its zarr.json files."""
        name = folder.name.removeprefix(TMP_PREFIX)
        attributes = {"format_version": FORMAT_VERSION, "shard": name, "rank": self.rank,
                      "sample_ids": [p.sample_id for p in buffer.samples], "heldout": buffer.heldout,
                      **self._shard_attributes}
        _write_shard(folder, arrays, attributes, self.storage)
        fsync_tree(folder)
        return _metadata_sha256(folder)

    def _stop(self, error: OSError, shard: str | None, committed: bool) -> StoreWriteError:
        """The writer closed after a failed write, and the error that says what is kept."""
        self._closed = True
        if self._lock is not None:
            self._lock.close()
        return StoreWriteError(error.errno or errno.EIO, self._write_failure(error, shard, committed),
                               self.path)

    def _write_failure(self, error: OSError, shard: str | None, committed: bool) -> str:
        cause, n = _cause(error), self._buffered()
        if not committed:
            what = (f"shard {shard} was not committed ({cause}): its {n} samples are not in the "
                    "store and are written again on resume")
        elif shard is not None:
            what = (f"shard {shard} ({n} samples) is committed, but the manifest of rank "
                    f"{self.rank} could not be rewritten ({cause}); the shard is verified and "
                    "listed on resume")
        else:
            what = (f"the manifest of rank {self.rank} could not be rewritten ({cause}); the "
                    "samples rejected since its last write are tried again on resume")
        kept = [s for s in self._manifest.shards if s.name != shard]
        return (f"store {self.path}: {what}. Everything committed before is kept ("
                f"{_shards(len(kept))}, {sum(len(s.sample_ids) for s in kept)} samples). To resume, "
                f"{_remedy(error.errno)} and rerun the same command: it continues after the last "
                "committed shard")

    def _buffered(self) -> int:
        return sum(len(b.samples) for b in self._buffers.values())

    def _after_commit(self, entry: ShardEntry, buffer: ShardBuffer) -> None:
        self.stats.samples += len(entry.sample_ids)
        self.stats.tokens += sum(entry.num_tokens)
        self.stats.bytes += entry.nbytes
        self.stats.shards += 1
        self._done.update(entry.sample_ids)
        self._next_index += 1
        buffer.clear()

    def close(self, done: bool = False) -> WriterStats:
        """Commit the last, partial shards and record rejections; the writer cannot add after.
        done: the caller has given this rank every sample of its share (store/progress.py)."""
        if self._closed:
            return self.stats
        try:
            pending = [b for b in self._buffers.values() if b.samples]
            for buffer in pending:
                self._commit(buffer)
            if not pending and self.stats.rejected:
                try:
                    _write_manifest(self.path, self._manifest)
                except OSError as error:
                    raise self._stop(error, None, committed=True) from error
            if done:
                mark_done(self.path, self.rank, self.world_size, len(self._manifest.shards),
                          sum(len(s.sample_ids) for s in self._manifest.shards))
        finally:  # a failed last commit leaves the store as a crash would, and frees the rank
            self._closed = True
            if self._lock is not None:
                self._lock.close()  # releases the rank's lock
        return self.stats

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, error_type: type[BaseException] | None, *_: object) -> None:
        if error_type is None:
            self.close()
            return
        if self._closed:  # stopped by its own StoreWriteError, which says it all
            return
        # The caller failed between two of the points where it lets a shard end: leave the store
        # as a crash would, so that a resumed run redoes exactly the uncommitted samples.
        logger.warning("store %s: %d buffered samples not committed after %s", self.path,
                       self._buffered(), error_type.__name__)
        self._closed = True
        if self._lock is not None:
            self._lock.close()


def _rejection(sample_id: str, origin: Origin | None, ids: torch.Tensor, aux: torch.Tensor,
               final: torch.Tensor) -> Rejection | None:
    """Why a sample cannot be stored, or None."""
    if len(ids) == 0:
        return Rejection(RejectionKind.NO_TOKENS, sample_id, "no tokens", origin)
    reasons = []
    for name, values in (("aux", aux), ("final", final)):
        bad = int((~torch.isfinite(values)).sum())
        if bad:
            reasons.append(f"{name} hidden states have {bad} non-finite values (NaN/Inf)")
    return Rejection(RejectionKind.NON_FINITE, sample_id, "; ".join(reasons), origin) if reasons else None


def _done_ids(path: Path) -> set[str]:
    """Committed (retired ones too: trained on, not lost) and rejected sample ids."""
    retired = read_retired(path)
    entries, _ = _store_index(path, retired)
    done = {sample_id for entry in [*entries, *retired.values()] for sample_id in entry.sample_ids}
    for manifest in _all_manifests(path):
        done.update(manifest.rejected)
    return done
