"""The store's crash-safe files: reading its sealed JSON files (store/sealed.py writes them), the
per-rank manifests of committed shards (with the sha256 of each shard's zarr.json files), the
listing of committed shards, and the per-rank write lock."""
from __future__ import annotations

import fcntl
import hashlib
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from data.rejection import Rejection
from store.format import FORMAT_VERSION, MANIFEST_DIR, SHARDS_DIR, _SHARD_NAME
from store.sealed import NotSealedError, SealMismatchError, replace_sealed_json, unseal_json


class StoreCorruptError(RuntimeError):
    """A file of the store is damaged: it fails its checksum or cannot be parsed. `file` names it
    (None where unknown); ShardCorruptError is the kind raised for a shard's files."""

    def __init__(self, message: str, file: str | Path | None = None):
        super().__init__(message)
        self.file = None if file is None else str(file)


def _read_checked_json(file: Path, advice: str) -> Any:
    """A sealed JSON file (store/sealed.py), its sha256 checked; StoreCorruptError names a damaged
    one (a file without its sha256 line among them)."""
    try:
        return unseal_json(file.read_bytes())
    except NotSealedError:
        raise StoreCorruptError(f"{file} is damaged: it does not end with its sha256 line; {advice}",
                                file) from None
    except SealMismatchError:
        raise StoreCorruptError(f"{file} is damaged: its contents do not match the sha256 on its "
                                f"last line; {advice}", file) from None


@dataclass
class ShardEntry:
    """One committed shard as a manifest lists it."""

    name: str
    sample_ids: list[str]
    num_tokens: list[int]  # per sample
    nbytes: int            # on disk
    # sha256 of each zarr.json, by path in the shard ("zarr.json", "aux_hidden/zarr.json", ...);
    # empty for a shard no manifest lists yet
    metadata_sha256: dict[str, str] = field(default_factory=dict)
    # The shard holds only held-out samples (the dump's heldout_split and the conversations it read
    # on for the held-out set): the trainer holds them out, a following trainer never retires it.
    # False in manifests written before the split was routed.
    heldout: bool = False


@dataclass
class Manifest:
    rank: int
    shards: list[ShardEntry] = field(default_factory=list)
    rejected: dict[str, Rejection] = field(default_factory=dict)  # sample id -> its record


def _manifest_path(path: Path, rank: int) -> Path:
    return path / MANIFEST_DIR / f"rank-{rank:05d}.json"


# What to do about a damaged manifest: its shards hold everything it says but the rejections.
_MANIFEST_ADVICE = ("the shards it lists are not affected: move it away and rerun this rank's "
                    "dump, which verifies them and lists them again (the rejected samples it "
                    "listed are tried again)")


def _read_manifest(file: Path) -> Manifest:
    raw = _read_checked_json(file, _MANIFEST_ADVICE)
    try:
        # Rejections are {kind, file, line, reason} records (Rejection.from_json refuses others).
        rejected = {sample: Rejection.from_json(sample, value) for sample, value in raw["rejected"].items()}
        return Manifest(rank=raw["rank"], shards=[ShardEntry(**s) for s in raw["shards"]],
                        rejected=rejected)
    # A file whose seal holds gets here by a shape this code does not write: a rejection that is
    # no record (a sentence of an older version), a kind unknown here.
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise StoreCorruptError(f"{file} is damaged: {error!r}; {_MANIFEST_ADVICE}", file) from error


def _load_manifest(path: Path, rank: int) -> Manifest:
    file = _manifest_path(path, rank)
    return _read_manifest(file) if file.exists() else Manifest(rank=rank)


def _write_manifest(path: Path, manifest: Manifest) -> None:
    raw = {"format_version": FORMAT_VERSION, "rank": manifest.rank,
           "shards": [asdict(s) for s in manifest.shards],
           "rejected": {sample: r.to_json() for sample, r in manifest.rejected.items()}}
    replace_sealed_json(_manifest_path(path, manifest.rank), raw)


def _all_manifests(path: Path) -> list[Manifest]:
    folder = path / MANIFEST_DIR
    files = sorted(folder.glob("rank-*.json")) if folder.is_dir() else []
    return [_read_manifest(f) for f in files]


def _committed_shards(path: Path) -> list[str]:
    """Names of committed shards; in-progress (.tmp-) and quarantined (.corrupt-) ones are hidden."""
    folder = path / SHARDS_DIR
    if not folder.is_dir():
        return []
    return sorted(e.name for e in os.scandir(folder) if _SHARD_NAME.match(e.name))


def _sha256_file(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def _metadata_sha256(folder: Path) -> dict[str, str]:
    """sha256 of each zarr.json of a shard folder (the group's and each array's), by path in it."""
    return {p.relative_to(folder).as_posix(): _sha256_file(p)
            for p in sorted(folder.rglob("zarr.json"))}


def _nbytes_on_disk(folder: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def _lock_rank(path: Path, rank: int) -> IO[bytes]:
    """An exclusive lock on this rank of the store, so that two processes that both think they
    are rank r (a launcher whose environment was not read, say) cannot delete each other's
    unfinished shards; the kernel releases it when the process dies, even by SIGKILL. The lock
    file names its holder, for the message the second process gets."""
    lock = open(path / MANIFEST_DIR / f"rank-{rank:05d}.lock", "a+b")  # append: keep the holder's name
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().decode(errors="replace").strip() or "holder unknown"
        lock.close()
        raise RuntimeError(
            f"rank {rank} of store {path} is being written by another process ({holder}); two "
            "writers of one rank would delete each other's unfinished shards. Wait for that process "
            "to finish or stop it; if it is meant to be another rank, check dump.rank / "
            "dump.world_size or RANK / SLURM_PROCID") from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    lock.flush()
    return lock
