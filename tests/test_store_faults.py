"""The store (store/) under faults, on real Zarr stores, real processes and real disks: a flipped
byte in every kind of file, a full and a read-only disk, two writers of one rank, readers beside a
writer stopped in the middle of a commit, and writers SIGKILLed at seeded random points, each
resumed, ending with the store an uninterrupted writer makes."""
from __future__ import annotations

import contextlib
import errno
import io
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import infra
from dump.__main__ import inspect_main
from infra import FAILPOINTS_ENV, REPO_ROOT
from store import (
    MANIFEST_DIR,
    SHARDS_DIR,
    STORE_META,
    Sample,
    ShardCorruptError,
    StoreCorruptError,
    StoreReader,
    StoreWriteError,
    inspect_store,
)
from tests.conftest import fault_points
from tests.test_store import make_sample, open_writer, read_all, storage, write_store
from tools.faults import differing_arrays, flip_byte, store_files_by_kind

pytestmark = pytest.mark.faults



def same_store(want: Path, got: Path) -> list[str]:
    """How two stores differ: their shards (names, sample ids, token counts) and, bit for bit,
    every array of every shard."""
    a, b = StoreReader(want), StoreReader(got)
    layout = [[(e.name, e.sample_ids, e.num_tokens) for e in r.shards()] for r in (a, b)]
    if layout[0] != layout[1]:
        return [f"shards differ: {layout[0]} against {layout[1]}"]
    differences = []
    for entry in a.shards():
        arrays = a._shard(entry.name).arrays, b._shard(entry.name).arrays
        differences += [f"{entry.name}/{name}" for name in set(arrays[0]) | set(arrays[1])
                        if name not in arrays[0] or name not in arrays[1]
                        or not np.array_equal(arrays[0][name][...], arrays[1][name][...])]
    return differences


def assert_clean(path: Path) -> None:
    report = inspect_store(path)
    assert report["problems"] == [] and not report["unfinished_shards"], report


IDS = [f"s{i:03d}" for i in range(24)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_store(tmp_path_factory.mktemp("uninterrupted") / "store", IDS).path


# ---- a flipped byte in every kind of file ----------------------------------------------------
CORRUPT_IDS = [f"c{i:02d}" for i in range(8)]  # two shards; aux_hidden in several chunks
# The kinds of file each preset's store is flipped in (a prefix): all in lossless (final_hidden
# compacted to target rows, final_offsets); in fp8 and fp4, those that differ (aux_hidden as e4m3
# or e2m1 codes, aux_scale).
CORRUPT_KINDS = {"lossless": "", "fp8": "aux_", "fp4": "aux_"}
# Per preset: shards of about half its encoded bytes of CORRUPT_IDS (two shards), chunks small
# enough that aux_hidden has several.
CORRUPT_STORAGE = {"lossless": {"target_chunk_bytes": 4096},
                   "fp8": {"target_chunk_bytes": 4096, "shard_bytes": 8000},
                   "fp4": {"target_chunk_bytes": 1024, "shard_bytes": 5000}}


@pytest.fixture(scope="module", params=["lossless", "fp8", "fp4"])
def pristine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small store: lossless, or fp8 / fp4 with their aux_scale arrays."""
    path = tmp_path_factory.mktemp(request.param) / "store"
    write_store(path, CORRUPT_IDS, storage(request.param, **CORRUPT_STORAGE[request.param]))
    assert len(StoreReader(path).shards()) == 2
    return path


def check_flip(copy: Path, file: Path, reference: dict[str, Sample]) -> str | None:
    """None when `python -m dump inspect` exits 1 naming the damaged file and no read returns
    its bytes as data; else what went wrong."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = inspect_main([str(copy)])
    if code == 0 or file.as_posix() not in printed.getvalue():
        return f"inspect exited {code} without naming the file: {printed.getvalue()[-600:]}"
    try:
        reader = StoreReader(copy)
    except StoreCorruptError as error:
        if file.parts[0] == SHARDS_DIR or file.as_posix() not in str(error):
            return f"opening the store raised, not naming the file: {error}"
        return None
    return _check_reads(reader, file, reference, printed.getvalue())


def _check_reads(reader: StoreReader, file: Path, reference: dict[str, Sample], inspected: str
                 ) -> str | None:
    """Each sample of the damaged file's shard reads back exactly, or raises naming the file
    and was named by inspect; some raise. (Other shards' files are untouched.)"""
    failed = []
    for ref in (r for r in reader.samples() if r.shard == file.parts[1]):
        try:
            sample = reader.read_sample(ref)
        except ShardCorruptError as error:
            if file.as_posix() not in str(error) or repr(ref.sample_id) not in inspected:
                return f"{ref.sample_id} failed naming another file, or inspect missed it: {error}"
            failed.append(ref.sample_id)
            continue
        if differing_arrays(reference[ref.sample_id], sample):
            return f"{ref.sample_id} read back damaged data"
    return None if failed else "every sample of the shard read back"


def test_a_flipped_byte_in_any_file_is_named_and_never_read_as_data(
        pristine: Path, tmp_path: Path) -> None:
    reference = read_all(pristine)
    mode = StoreReader(pristine).mode
    rng = random.Random(f"flip-{mode}")
    injected, missed = 0, []
    kinds = {k: v for k, v in store_files_by_kind(pristine).items() if k.startswith(CORRUPT_KINDS[mode])}
    for kind, files in kinds.items():
        for _ in range(fault_points()):
            file = rng.choice(files)
            offset = rng.randrange((pristine / file).stat().st_size)
            copy = tmp_path / f"trial-{injected}"
            shutil.copytree(pristine, copy)
            flip_byte(copy / file, offset, rng.randrange(1, 256))
            injected += 1
            failure = check_flip(copy, file, reference)
            if failure:
                missed.append(f"{kind} {file} at byte {offset}: {failure}")
            shutil.rmtree(copy)
    print(f"{mode}: {len(kinds)} kinds of file, {injected} flipped bytes injected, "
          f"{injected - len(missed)} detected")
    assert missed == [] and len(kinds) == {"lossless": 15, "fp8": 4, "fp4": 4}[mode]


def test_inspect_command_exits_nonzero_on_a_damaged_store_json(uninterrupted: Path, tmp_path: Path) -> None:
    copy = tmp_path / "store"
    shutil.copytree(uninterrupted, copy)
    flip_byte(copy / STORE_META, 20, 0x01)
    done = subprocess.run([sys.executable, "-m", "dump", "inspect", str(copy)],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{copy / STORE_META} is damaged" in done.stdout


# ---- a full or read-only disk ----------------------------------------------------------------
@pytest.mark.parametrize("point, hit, expected", [
    ("store.shard.array_written", 7, r"shard r00000-000001\.zarr was not committed \(No space left on "
                                     r"device.*\): its \d+ samples are not in the store"),
    ("store.json.before_rename", 3, r"shard r00000-000001\.zarr \(\d+ samples\) is committed, but the "
                                    r"manifest of rank 0 could not be rewritten"),
])
def test_disk_full_in_a_commit_stops_clearly_and_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: Path, point: str, hit: int,
        expected: str) -> None:
    monkeypatch.setenv(FAILPOINTS_ENV, f"{point}:{hit}:enospc")
    infra._failpoint_hits.clear()
    with pytest.raises(StoreWriteError) as full:
        write_store(tmp_path, IDS)
    message = str(full.value)
    assert full.value.errno == errno.ENOSPC and re.search(expected, message), message
    assert f"store {tmp_path}:" in message
    kept = re.search(r"Everything committed before is kept \(1 shard, (\d+) samples\)", message)
    first = StoreReader(tmp_path).shards()[0]                     # the shard committed before
    assert kept and first.name == "r00000-000000.zarr" and int(kept.group(1)) == len(first.sample_ids), message
    assert "free space on its disk" in message and "rerun the same command" in message
    assert_clean(tmp_path)  # the unfinished shard is gone, the committed ones read back

    monkeypatch.delenv(FAILPOINTS_ENV)
    write_store(tmp_path, IDS)
    assert same_store(uninterrupted, tmp_path) == []
    assert_clean(tmp_path)


def test_disk_full_while_opening_names_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAILPOINTS_ENV, "store.json.before_rename:1:enospc")  # the first manifest
    infra._failpoint_hits.clear()
    with pytest.raises(StoreWriteError, match=f"cannot write the store at {tmp_path}: No space left"):
        open_writer(tmp_path)
    assert not list((tmp_path / MANIFEST_DIR).glob(".*.tmp"))


@contextlib.contextmanager
def tmpfs(folder: Path, size: int) -> Iterator[Path]:
    """A real, small file system mounted on folder (needs root), unmounted after."""
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs to fill or lock a disk: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def disk_usage(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def test_a_real_full_disk_stops_clearly_keeps_its_shards_and_resumes(
        tmp_path: Path, uninterrupted: Path) -> None:
    need = disk_usage(uninterrupted)
    with tmpfs(tmp_path / "disk", 4 * need) as disk:
        filler = disk / "filler"
        stat = os.statvfs(disk)
        filler.write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - need // 2))  # half the store fits
        store = disk / "store"
        with pytest.raises(StoreWriteError) as full:
            write_store(store, IDS)
        message = str(full.value)
        assert full.value.errno == errno.ENOSPC and f"store {store}:" in message, message
        assert "Everything committed before is kept" in message and "rerun the same command" in message
        kept = len(StoreReader(store))
        assert 0 < kept < len(IDS)
        assert not list((store / SHARDS_DIR).glob(".tmp-*"))  # its space given back

        filler.unlink()
        write_store(store, IDS)
        assert same_store(uninterrupted, store) == []
        assert_clean(store)


def test_an_unwritable_store_path_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(StoreWriteError) as refused:
        open_writer(blocker / "store")
    assert f"cannot write the store at {blocker / 'store'}: Not a directory" in str(refused.value)
    assert "move the file that stands where a folder of the store path must be" in str(refused.value)
    with tmpfs(tmp_path / "disk", 4 << 20) as disk:
        write_store(disk / "store", IDS[:8])
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        for path in (disk / "store", disk / "new"):  # resuming one, creating one
            with pytest.raises(StoreWriteError) as refused:
                open_writer(path)
            assert refused.value.errno == errno.EROFS, refused.value
            assert f"cannot write the store at {path}: Read-only file system" in str(refused.value)
            assert "make its folder writable" in str(refused.value)
        assert len(StoreReader(disk / "store")) == 8 and StoreReader(disk / "store").verify() == []


# ---- writer processes: a second writer, readers mid-commit, kills ----------------------------
def kill_ids() -> list[str]:
    """Enough samples that no kill of the chain finds the store complete: a kill at a failpoint
    costs at most 2 shards (8 samples), one after a random delay about 15."""
    return [f"k{i:03d}" for i in range(24 + 16 * fault_points())]


def writer_process(path: str, ids: list[str]) -> None:
    """A writer process: the samples, slowly, resuming what is there."""
    with open_writer(Path(path)) as writer:
        for sample_id in ids:
            if sample_id not in writer.done_sample_ids():
                writer.add(sample_id, **make_sample(sample_id))
                writer.commit_if_full()
                time.sleep(0.02)  # slow enough to be killed in the middle of the work


def start_writer(path: Path, ids: list[str], failpoints: str = "") -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != FAILPOINTS_ENV}
    if failpoints:
        env[FAILPOINTS_ENV] = failpoints
    code = f"from tests.test_store_faults import writer_process; writer_process({str(path)!r}, {ids!r})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env)


def wait_stopped(process: subprocess.Popen, timeout: float = 120) -> None:
    """Until the process has stopped itself (SIGSTOP at its failpoint)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status = os.waitpid(process.pid, os.WNOHANG | os.WUNTRACED)
        if pid:
            assert os.WIFSTOPPED(status), f"the writer ended (status {status}) instead of stopping"
            return
        time.sleep(0.02)
    raise AssertionError("the writer did not reach its failpoint")


@pytest.fixture(scope="module")
def kill_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_store(tmp_path_factory.mktemp("kill-reference") / "store", kill_ids()).path


def listed(path: Path) -> list[str]:
    reader = StoreReader(path)
    return [s.name for s in reader.shards()]


def test_second_writer_is_refused_and_readers_see_only_committed_shards(
        tmp_path: Path, uninterrupted: Path) -> None:
    process = start_writer(tmp_path, IDS, "store.shard.before_rename:2:stop,store.shard.after_rename:2:stop")
    try:
        wait_stopped(process)  # shard 1 complete under its tmp name, not committed
        with pytest.raises(RuntimeError, match=rf"rank 0 of store {re.escape(str(tmp_path))} is being "
                           rf"written by another process \(pid {process.pid} on .*check dump\.rank"):
            open_writer(tmp_path)
        first = StoreReader(uninterrupted).shards()[0]
        reader = StoreReader(tmp_path)
        assert [s.sample_ids for s in reader.shards()] == [first.sample_ids]
        assert reader.verify() == [] and len(reader) == len(first.sample_ids)
        assert inspect_store(tmp_path)["unfinished_shards"] == [".tmp-r00000-000001.zarr"]

        os.kill(process.pid, signal.SIGCONT)
        wait_stopped(process)  # shard 1 committed, its manifest not yet rewritten
        assert listed(tmp_path) == ["r00000-000000.zarr", "r00000-000001.zarr"]
        assert StoreReader(tmp_path).verify() == []
        os.kill(process.pid, signal.SIGCONT)
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert same_store(uninterrupted, tmp_path) == []
    assert_clean(tmp_path)


# (failpoint, largest hit a kill may land on); "time" kills after a random delay instead.
KILL_POINTS = (("store.shard.array_written", 10), ("store.shard.before_rename", 2),
               ("store.shard.after_rename", 2), ("store.json.before_rename", 3),
               ("store.json.after_rename", 3), ("time", 0))


def run_killed(path: Path, point: str, hit: int, delay: float) -> int:
    """A writer process killed at the failpoint's hit, or `delay` seconds after it has locked its
    rank; its exit status."""
    process = start_writer(path, kill_ids(), "" if point == "time" else f"{point}:{hit}:kill")
    try:
        if point == "time":
            _wait_for_lock(path, process)
            time.sleep(delay)
            process.kill()
        return process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _wait_for_lock(path: Path, process: subprocess.Popen) -> None:
    lock = path / MANIFEST_DIR / "rank-00000.lock"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if lock.exists() and f"pid {process.pid} " in lock.read_text():
            return
        time.sleep(0.005)


def test_writers_killed_at_random_points_resume_to_the_uninterrupted_store(
        tmp_path: Path, kill_reference: Path) -> None:
    rng = random.Random(0)  # its first three: inside a manifest write, after a delay, inside a shard
    order = rng.sample(KILL_POINTS, len(KILL_POINTS))  # each kind of kill before any twice
    kills = []
    for i in range(fault_points()):
        point, top = order[i % len(order)]
        hit, delay = rng.randint(1, max(top, 1)), rng.uniform(0, 0.3)
        status = run_killed(tmp_path, point, hit, delay)
        kills.append((point, hit if point != "time" else round(delay, 3)))
        assert status == -signal.SIGKILL, f"{kills[-1]}: the writer ended with {status} before its kill"
        reader = StoreReader(tmp_path)  # what a reader sees right after a crash: complete shards
        ids = [ref.sample_id for ref in reader.samples()]
        assert len(ids) == len(set(ids)) and set(ids) <= set(kill_ids()) and reader.verify() == []
    print("kills:", kills)
    write_store(tmp_path, kill_ids())  # the run that completes
    assert same_store(kill_reference, tmp_path) == []
    assert_clean(tmp_path)
