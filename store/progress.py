"""A store while it is written and consumed: what a trainer that follows a dump (train.follow) and
the dump's writers tell each other through the store's folder, which every node shares.

    manifest/rank-00000.done       sealed JSON: the rank has written its whole share of the data
                                   {"rank", "world_size", "shards", "samples"}; removed when a
                                   writer of that rank opens the store again
    manifest/rank-00000.waiting    sealed JSON: the rank's writer waits for room under
                                   store.max_bytes {"rank", "bytes", "max_bytes"}; removed when it
                                   goes on (a stale one, of a killed writer, goes with its reopening)
    manifest/retired.json          sealed JSON: the shards a trainer has retired, each with the
                                   manifest entry it had (sample ids, token counts, bytes, zarr.json
                                   sha256): what the store held, after its bytes are gone
    shards/.retired-<name>         a shard being deleted after its retirement was recorded

Retiring is: record the shard in retired.json (durable), then rename it out of the committed names
and delete it. A crash between the two leaves a recorded shard on disk, which every reader already
treats as retired and the next retirement (or `retire_shards(path, [])`) deletes.

One process retires (a following trainer's rank 0): retired.json has a single writer. The dump's
writers read it (a retired sample is done: a resumed dump does not write it again); a StoreReader
refuses to read a retired sample, naming it and its shard.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from store.durable import ShardEntry, StoreCorruptError, _all_manifests, _read_checked_json
from store.format import FORMAT_VERSION, MANIFEST_DIR, SHARDS_DIR
from store.sealed import fsync_dir, replace_sealed_json

RETIRED = "retired.json"
RETIRING_PREFIX = ".retired-"

_PROGRESS_ADVICE = ("it is written by the dump (done, waiting) or by a following trainer (retired); "
                    "rerunning that stage rewrites it")


class SampleRetiredError(KeyError):
    """A read of a sample whose shard a following trainer has retired (deleted from disk)."""

    def __init__(self, sample_id: str, shard: str, store: Path):
        super().__init__(f"sample {sample_id!r} of store {store} was retired with shard {shard} "
                         f"({store / MANIFEST_DIR / RETIRED}): its states are no longer on disk")
        self.sample_id, self.shard = sample_id, shard


def _rank_file(path: Path, rank: int, suffix: str) -> Path:
    return path / MANIFEST_DIR / f"rank-{rank:05d}.{suffix}"


# ---- done ---------------------------------------------------------------------------------------
def mark_done(path: Path, rank: int, world_size: int, shards: int, samples: int) -> None:
    """This rank of the dump has written (or rejected) every sample of its share."""
    replace_sealed_json(_rank_file(path, rank, "done"), {"format_version": FORMAT_VERSION, "rank": rank,
                                                        "world_size": world_size, "shards": shards,
                                                        "samples": samples})


def clear_rank_state(path: Path, rank: int) -> None:
    """A writer of this rank opens the store: it is neither done nor waiting any more."""
    for suffix in ("done", "waiting"):
        _rank_file(path, rank, suffix).unlink(missing_ok=True)


@dataclass(frozen=True)
class Completion:
    """Which dump ranks have marked their share done, of how many."""

    done: frozenset[int]
    world_size: int | None        # from the markers; None before the first

    @property
    def complete(self) -> bool:
        return self.world_size is not None and self.done == frozenset(range(self.world_size))


def completion(path: Path) -> Completion:
    """The done markers of the store's dump ranks; StoreCorruptError when they disagree on the
    number of ranks (two dumps of different world sizes into one store)."""
    done, worlds = set(), set()
    for file in sorted((path / MANIFEST_DIR).glob("rank-*.done")):
        marker = _read_checked_json(file, _PROGRESS_ADVICE)
        done.add(int(marker["rank"]))
        worlds.add(int(marker["world_size"]))
    if len(worlds) > 1:
        raise StoreCorruptError(f"store {path}: its dump ranks marked done disagree on the number of ranks "
                                f"({sorted(worlds)}): one store takes one dump.world_size")
    return Completion(frozenset(done), worlds.pop() if worlds else None)


# ---- waiting for room ----------------------------------------------------------------------------
def set_waiting(path: Path, rank: int, nbytes: int, max_bytes: int) -> None:
    replace_sealed_json(_rank_file(path, rank, "waiting"), {"format_version": FORMAT_VERSION, "rank": rank,
                                                           "bytes": nbytes, "max_bytes": max_bytes})


def clear_waiting(path: Path, rank: int) -> None:
    _rank_file(path, rank, "waiting").unlink(missing_ok=True)


def waiting_ranks(path: Path) -> frozenset[int]:
    """The dump ranks whose writers wait for a trainer to retire shards."""
    return frozenset(int(f.name[len("rank-"):-len(".waiting")]) for f in (path / MANIFEST_DIR).glob("rank-*.waiting"))


def blocked_writers(path: Path) -> frozenset[int]:
    """The waiting dump ranks whose bound the store still fills: a writer that a retirement has
    just freed may not have removed its marker yet, and is not blocked."""
    bounds = {}
    for rank in waiting_ranks(path):
        try:
            bounds[rank] = int(_read_checked_json(_rank_file(path, rank, "waiting"), _PROGRESS_ADVICE)["max_bytes"])
        except FileNotFoundError:           # the writer went on meanwhile
            pass
    held = shards_bytes(path) if bounds else 0
    return frozenset(rank for rank, bound in bounds.items() if held >= bound)


def shards_bytes(path: Path) -> int:
    """Bytes on disk under shards/: committed shards, the ones being written and those being
    deleted (what the disk holds, which store.max_bytes bounds)."""
    total = 0
    for folder, _, files in os.walk(path / SHARDS_DIR):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except FileNotFoundError:       # deleted by a retirement while we walked
                pass
    return total


# ---- retired shards ------------------------------------------------------------------------------
def read_retired(path: Path) -> dict[str, ShardEntry]:
    """The retired shards by name, each with the manifest entry it had."""
    file = path / MANIFEST_DIR / RETIRED
    if not file.exists():
        return {}
    raw = _read_checked_json(file, _PROGRESS_ADVICE)
    try:
        return {s["name"]: ShardEntry(**s) for s in raw["shards"]}
    except (KeyError, TypeError) as error:
        raise StoreCorruptError(f"{file} is damaged: {error!r}; {_PROGRESS_ADVICE}", file) from error


def retire_shards(path: Path, names: list[str]) -> list[ShardEntry]:
    """Retire the named committed shards: recorded in retired.json first (durably), then deleted.
    Also deletes what an interrupted retirement left. Returns the entries newly recorded."""
    retired = read_retired(path)
    listed = {s.name: s for m in _all_manifests(path) for s in m.shards}
    unknown = [n for n in names if n not in listed and n not in retired]
    if unknown:
        raise ValueError(f"store {path}: cannot retire {unknown}: no manifest lists them")
    new = [listed[n] for n in names if n not in retired]
    if new:
        retired.update((e.name, e) for e in new)
        replace_sealed_json(path / MANIFEST_DIR / RETIRED, {"format_version": FORMAT_VERSION,
                                                           "shards": [asdict(e) for e in retired.values()]})
    _delete_retired(path, retired)
    return new


def _delete_retired(path: Path, retired: dict[str, ShardEntry]) -> None:
    shards = path / SHARDS_DIR
    for name in retired:
        folder = shards / name
        if folder.exists():
            # Out of the committed names at once (a rename), then deleted at leisure.
            os.rename(folder, shards / f"{RETIRING_PREFIX}{name}")
    fsync_dir(shards)
    for leftover in shards.glob(f"{RETIRING_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
