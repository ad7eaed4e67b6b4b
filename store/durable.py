"""Files that survive a crash at any moment: fsync'd JSON written by rename, the per-rank
manifests of committed shards, the listing of committed shards, and the per-rank write lock."""
from __future__ import annotations

import fcntl
import json
import os
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from infra import failpoint
from store.format import FORMAT_VERSION, MANIFEST_DIR, SHARDS_DIR, _SHARD_NAME


def _write_json_durably(path: Path, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())


def _replace_json_durably(path: Path, value: Any) -> None:
    """Write tmp, fsync, rename over, fsync the folder: a reader sees the old or the new file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    _write_json_durably(tmp, value)
    failpoint("store.json.before_rename")
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


def _committed_shards(path: Path) -> list[str]:
    """Names of committed shards; in-progress (.tmp-) and quarantined (.corrupt-) ones are hidden."""
    folder = path / SHARDS_DIR
    if not folder.is_dir():
        return []
    return sorted(e.name for e in os.scandir(folder) if _SHARD_NAME.match(e.name))


def _nbytes_on_disk(folder: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


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
