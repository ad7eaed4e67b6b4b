"""The dump under faults, with real vLLM: killed with SIGKILL at seeded random points (inside a shard
commit, inside a manifest write, between batches, at a random time) and resumed each time; a real
full disk (a small tmpfs) that stops it and frees up again. Both must end with the store an
uninterrupted dump writes. tools/faults.py runs the same kills against a user's own config.
"""
from __future__ import annotations

import errno
import shutil
import subprocess
from pathlib import Path

import pytest

from config import compose_config
from store import StoreReader
from tests.conftest import fault_points
from tests.test_dump import short_multiturn, write_jsonl
from tools.faults import kill_chain, store_differences

pytestmark = [pytest.mark.vllm, pytest.mark.faults]

CONVERSATIONS = 12
# The killed dumps run vLLM's engine core inside the dump process (conftest's in_process_dump_env):
# what a kill must not break is the store's commit and resume (the dump process writes the store
# either way), and each run starts without spawning the engine-core and worker processes. The
# store they end with must still equal, bit for bit, the uninterrupted one of the session's
# multiprocess engine.
# One engine decodes and captures (test_dump tests a second); half the conversations get a sampled copy.
OVERRIDES = ["data=jsonl", "max_len=512", "batch_size=2", "store.shard_bytes=1", "regenerate.max_tokens=16",
             "regenerate.dtype=engine", "regenerate.sampled_share=0.5"]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(short_multiturn(CONVERSATIONS), tmp_path_factory.mktemp("faults") / "data.jsonl")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, data_file: Path, verifier_llm) -> Path:
    """The store of an uninterrupted dump (the engine of `python -m dump`, shared in-process)."""
    from dump.pipeline import run_dump

    out = tmp_path_factory.mktemp("faults") / "uninterrupted"
    summary = run_dump(compose_config("dump", [*OVERRIDES, f"data.path={data_file}", f"output_dir={out}"]),
                       llm=verifier_llm)
    originals = [r for r in StoreReader(out).samples() if not r.sample_id.endswith("~sampled")]
    assert len(originals) == CONVERSATIONS < summary["samples_written"]   # and the sampled copies
    return out


@pytest.mark.slow
def test_dump_killed_at_random_points_resumes_to_the_uninterrupted_store(
        tmp_path: Path, data_file: Path, uninterrupted: Path, in_process_dump_env: dict[str, str]) -> None:
    out = tmp_path / "killed"
    kills = kill_chain(out, [*OVERRIDES, f"data.path={data_file}"], fault_points(), seed=14,
                       extra_env=in_process_dump_env)
    print("kills:", [(k.point, k.hit, k.outcome, k.samples_after) for k in kills])
    assert any(k.outcome == "killed" for k in kills)
    assert store_differences(uninterrupted, out) == []
    assert not StoreReader(out).verify()


def _mount_tmpfs(folder: Path, size: int) -> None:
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here to fill a disk: {done.stderr.strip()}")


def test_dump_on_a_full_disk_stops_clearly_keeps_its_shards_and_resumes(
        tmp_path: Path, data_file: Path, uninterrupted: Path, verifier_llm) -> None:
    from dump.pipeline import run_dump

    need = sum(f.stat().st_size for f in uninterrupted.rglob("*") if f.is_file())
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, 4 * need)
    try:
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (4 * need - need // 2))  # room for about half the store
        cfg = compose_config("dump", [*OVERRIDES, f"data.path={data_file}", f"output_dir={disk / 'store'}"])
        with pytest.raises(OSError) as full:
            run_dump(cfg, llm=verifier_llm)
        assert full.value.errno == errno.ENOSPC
        message = str(full.value)
        assert str(disk / "store") in message and "resume" in message, message
        kept = len(StoreReader(disk / "store"))
        assert 0 < kept < len(StoreReader(uninterrupted)), kept   # what was committed before stays

        filler.unlink()
        summary = run_dump(cfg, llm=verifier_llm)
        assert summary["samples_already_done"] == kept
        assert store_differences(uninterrupted, disk / "store") == []
        assert not StoreReader(disk / "store").verify()
        shutil.rmtree(disk / "store")
    finally:
        subprocess.run(["umount", str(disk)], check=False)
