"""Fault injection a user can run against their own store and dump configuration.

    python -m tools.faults corrupt <store> [--trials N] [--seed S]
        Flips one bit at seeded random offsets of every kind of file of the store (each array's
        data, each zarr.json, the manifests, store.json), one trial at a time on a copy made of
        hard links (only the flipped file is copied, so a large store costs little disk), and checks
        that `python -m dump inspect` exits non-zero naming the file, and that no sample of a
        flipped shard file reads back as data. Each trial verifies the whole copy: choose N with
        the store's size in mind. Exit 1 if any flip went unnoticed.

    python -m tools.faults dump [-n N] [--seed S] [--keep DIR] [hydra overrides of `python -m dump`]
        Dumps once uninterrupted, then again into a second folder killed N times with SIGKILL at
        seeded random points - inside a shard commit (after an array, before and after its rename),
        inside a manifest write, between batches, or after a random delay - each kill followed by
        a resume, and compares the two stores sample by sample. Exit 1 on any difference.

The kill points are the failpoints of infra.py (EAGLE3_FAILPOINTS), set in the environment of the
`python -m dump` process; the process group is killed after each death so that vLLM's engine
process goes with it. The test suite (tests/test_faults.py) runs the same functions.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import infra

infra.configure_environment()

from store import Sample, ShardCorruptError, StoreReader  # noqa: E402  (after the environment is set)
from store.format import MANIFEST_DIR, SHARDS_DIR, STORE_META, _SHARD_NAME  # noqa: E402

# (failpoint, largest hit) a kill may land on; "time" kills after a random delay instead.
DUMP_KILL_POINTS: tuple[tuple[str, int], ...] = (
    ("store.shard.array_written", 6),   # inside a shard commit, after one of its arrays
    ("store.shard.before_rename", 2),   # a complete shard not yet committed
    ("store.shard.after_rename", 2),    # committed, its manifest not yet rewritten
    ("store.json.before_rename", 2),    # inside a manifest write
    ("dump.batch.done", 2),             # between batches
    ("time", 0),
)


# ---- corruption ------------------------------------------------------------------------------
@dataclass
class CorruptionTrial:
    kind: str          # e.g. "store.json", "manifest", "final_hidden data", "aux_hidden zarr.json"
    file: str          # relative to the store
    offset: int
    detected: bool     # inspect exited non-zero and named the file
    read_as_data: bool  # a sample of the flipped shard read back without an error


def store_files_by_kind(store: Path) -> dict[str, list[Path]]:
    """The store's files (relative paths) grouped by kind; shards' files by array and role."""
    kinds: dict[str, list[Path]] = {STORE_META: [Path(STORE_META)]}
    kinds["manifest"] = sorted(p.relative_to(store) for p in (store / MANIFEST_DIR).glob("rank-*.json"))
    for shard in sorted((store / SHARDS_DIR).iterdir()):
        if not _SHARD_NAME.match(shard.name):
            continue
        for file in sorted(p for p in shard.rglob("*") if p.is_file()):
            parts = file.relative_to(shard).parts
            kind = "group zarr.json" if len(parts) == 1 else (
                f"{parts[0]} zarr.json" if parts[-1] == "zarr.json" else f"{parts[0]} data")
            kinds.setdefault(kind, []).append(file.relative_to(store))
    return kinds


def flip_byte(file: Path, offset: int, mask: int) -> None:
    """XOR the byte at `offset` with `mask` in place (the same call again undoes it)."""
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def _linked_copy(store: Path, out: Path, flipped: Path) -> None:
    """A copy of the store made of hard links, except `flipped`, a real copy that can be changed."""
    shutil.copytree(store, out, copy_function=os.link)
    target = out / flipped
    target.unlink()
    shutil.copy2(store / flipped, target)


def corruption_trials(store: Path, trials: int, seed: int) -> list[CorruptionTrial]:
    """`trials` flips per file kind (each in a random file of that kind), each checked alone."""
    rng = random.Random(seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="faults-", dir=store.parent) as scratch:
        for kind, files in store_files_by_kind(store).items():
            for trial in range(trials):
                file = rng.choice(files)
                offset = rng.randrange((store / file).stat().st_size)
                copy = Path(scratch) / f"trial-{len(results)}"
                _linked_copy(store, copy, file)
                flip_byte(copy / file, offset, 1 << rng.randrange(8))
                results.append(_check_flip(copy, store, kind, file, offset))
                shutil.rmtree(copy)
    return results


def _check_flip(copy: Path, original: Path, kind: str, file: Path, offset: int) -> CorruptionTrial:
    from dump.__main__ import inspect_main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        exit_code = inspect_main([str(copy), "--json"])
    detected = exit_code != 0 and file.as_posix() in printed.getvalue()
    read_as_data = file.parts[0] == SHARDS_DIR and _misread(copy, original, file.parts[1])
    return CorruptionTrial(kind, str(file), offset, detected, read_as_data)


def _misread(copy: Path, original: Path, shard: str) -> bool:
    """Whether a sample of the shard reads back from the flipped copy without an error but with
    other values than the original store's: corrupted bytes read as data."""
    try:
        reader = StoreReader(copy)
    except Exception:  # the copy refuses to open: nothing reads as data
        return False
    truth = StoreReader(original)
    refs = {r.sample_id: r for r in truth.samples() if r.shard == shard}
    for ref in (r for r in reader.samples() if r.shard == shard):
        try:
            got = reader.read_sample(ref)
        except ShardCorruptError:
            continue
        if ref.sample_id not in refs:
            return True
        if differing_arrays(truth.read_sample(refs[ref.sample_id]), got):
            return True
    return False


def differing_arrays(want: Sample, got: Sample) -> list[str]:
    """The arrays of two reads of a sample that are not bit for bit equal (as float32); a store of
    top-k targets has no final states (None on both sides)."""
    return [name for name in ("input_ids", "loss_mask", "aux", "final", "target_ids", "target_logprobs")
            if not _same(getattr(want, name), getattr(got, name))]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return np.array_equal(a.float().numpy(), b.float().numpy())


# ---- kills -----------------------------------------------------------------------------------
@dataclass
class Kill:
    point: str          # a failpoint, or "time"
    hit: int            # the failpoint's hit in its process; for "time", the delay in ms
    outcome: str        # "killed", or "finished" when the process never reached the point
    samples_after: int  # committed samples once the process was gone


def kill_plan(n: int, seed: int) -> list[tuple[str, int]]:
    """n (point, hit) pairs drawn from DUMP_KILL_POINTS; "time" pairs carry a delay in ms."""
    rng = random.Random(seed)
    plan = []
    for _ in range(n):
        point, most = rng.choice(DUMP_KILL_POINTS)
        plan.append((point, rng.randint(1, most) if most else rng.randint(0, 3000)))
    return plan


def dump_command(out: Path, overrides: Sequence[str]) -> list[str]:
    hydra_dir = out.parent / f"{out.name}-hydra"
    return [sys.executable, "-m", "dump", f"output_dir={out}", *overrides, f"hydra.run.dir={hydra_dir}"]


def run_killed(command: list[str], store: Path, point: str, hit: int, timeout: float,
               extra_env: Mapping[str, str] | None = None) -> str:
    """Run the dump with one kill armed; "killed" or "finished". Its process group goes with it."""
    env = {**os.environ, **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
    if point != "time":
        env[infra.FAILPOINTS_ENV] = f"{point}:{hit}:kill"
    proc = subprocess.Popen(command, cwd=infra.REPO_ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if point == "time":
            _kill_after_first_commit(proc, store, hit / 1000, timeout)
        code = proc.wait(timeout=timeout)
    finally:
        _kill_group(proc.pid)
    if code not in (0, -signal.SIGKILL):
        raise RuntimeError(f"{' '.join(command)} failed with exit code {code} (kill point {point}:{hit})")
    return "killed" if code == -signal.SIGKILL else "finished"


def _kill_after_first_commit(proc: subprocess.Popen, store: Path, delay: float, timeout: float) -> None:
    """SIGKILL the group `delay` seconds after the store has a committed shard (or the run ends)."""
    deadline = time.time() + timeout
    while proc.poll() is None and not _committed(store):
        if time.time() > deadline:
            raise TimeoutError(f"no shard committed in {timeout} s")
        time.sleep(0.1)
    time.sleep(delay)
    if proc.poll() is None:
        _kill_group(proc.pid)


def _committed(store: Path) -> bool:
    folder = store / SHARDS_DIR
    return folder.is_dir() and any(_SHARD_NAME.match(p.name) for p in folder.iterdir())


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _samples(store: Path) -> int:
    return len(StoreReader(store)) if (store / STORE_META).exists() else 0


def kill_chain(out: Path, overrides: Sequence[str], n: int, seed: int, timeout: float = 900,
               extra_env: Mapping[str, str] | None = None) -> list[Kill]:
    """n kills of a dump into `out`, each run resuming the one before, then a run to the end.
    extra_env: added to the environment of every dump process."""
    command = dump_command(out, overrides)
    kills = []
    for point, hit in kill_plan(n, seed):
        outcome = run_killed(command, out, point, hit, timeout, extra_env)
        kills.append(Kill(point, hit, outcome, _samples(out)))
    subprocess.run(command, cwd=infra.REPO_ROOT, check=True, timeout=timeout, env={**os.environ, **(extra_env or {})},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return kills


def store_differences(want: Path, got: Path) -> list[str]:
    """What differs between two stores' samples: ids, token arrays, hidden states (bit for bit)."""
    a, b = StoreReader(want), StoreReader(got)
    refs_a = {r.sample_id: r for r in a.samples()}
    refs_b = {r.sample_id: r for r in b.samples()}
    if sorted(refs_a) != sorted(refs_b):
        return [f"sample ids differ: only in {want}: {sorted(set(refs_a) - set(refs_b))}, "
                f"only in {got}: {sorted(set(refs_b) - set(refs_a))}"]
    return [f"sample {sample_id!r}: {name} differs" for sample_id, ref in refs_a.items()
            for name in differing_arrays(a.read_sample(ref), b.read_sample(refs_b[sample_id]))]


# ---- command line ----------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.faults", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    corrupt = commands.add_parser("corrupt", help="flip bits in every kind of file of a store")
    corrupt.add_argument("store", type=Path)
    corrupt.add_argument("--trials", type=int, default=3, help="flips per kind of file")
    corrupt.add_argument("--seed", type=int, default=0)
    dump = commands.add_parser("dump", help="kill a dump at random points, resume, compare")
    dump.add_argument("-n", type=int, default=5, help="kills")
    dump.add_argument("--seed", type=int, default=0)
    dump.add_argument("--keep", type=Path, help="a folder for the two stores (default: a temporary one)")
    dump.add_argument("overrides", nargs="*", help="hydra overrides of `python -m dump`")
    args = parser.parse_args(argv)
    if args.command == "corrupt":
        return _corrupt(args.store.resolve(), args.trials, args.seed)
    return _dump(args.n, args.seed, args.keep, args.overrides)


def _corrupt(store: Path, trials: int, seed: int) -> int:
    results = corruption_trials(store, trials, seed)
    bad = [r for r in results if not r.detected or r.read_as_data]
    by_kind: dict[str, list[CorruptionTrial]] = {}
    for r in results:
        by_kind.setdefault(r.kind, []).append(r)
    for kind, rs in by_kind.items():
        print(f"{kind:28} injected {len(rs)}, detected {sum(r.detected for r in rs)}, "
              f"read as data {sum(r.read_as_data for r in rs)}")
    for r in bad:
        print(f"UNNOTICED: {json.dumps(asdict(r))}")
    print(f"corruptions injected {len(results)}, detected {sum(r.detected for r in results)}")
    return 1 if bad else 0


def _dump(n: int, seed: int, keep: Path | None, overrides: list[str]) -> int:
    folder = Path(keep or tempfile.mkdtemp(prefix="faults-dump-")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    reference, killed = folder / "uninterrupted", folder / "killed"
    subprocess.run(dump_command(reference, overrides), cwd=infra.REPO_ROOT, check=True)
    kills = kill_chain(killed, overrides, n, seed)
    for k in kills:
        print(f"kill at {k.point}:{k.hit}: {k.outcome}, {k.samples_after} samples committed after it")
    differences = store_differences(reference, killed)
    print("\n".join(differences) or f"{len(kills)} kills, resumed store equals the uninterrupted one "
          f"({_samples(reference)} samples); stores in {folder}")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
