"""Fault injection on the trainer (train/loop.py, train/checkpoints.py): one run folder killed again
and again (during a checkpoint save, between its files, before and after its marker, after a
step, at a random moment with its loader workers) and resumed each time must end exactly where an
uninterrupted run ends; flipped bytes in any file of a checkpoint must be refused by name, with
train.resume=auto falling back to the newest checkpoint that verifies.

fp32 on the CPU with one math thread, as in tests/test_train.py: a resumed trajectory repeats the
uninterrupted one bit for bit (compared at rtol 1e-6, the bound tests/test_train.py states).
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from infra import FAILPOINTS_ENV, REPO_ROOT
from tests.conftest import fault_points
from tests.test_train import _command, _env, _fit, _losses, _overrides, one_thread  # noqa: F401
from tools.faults import flip_byte
from train import checkpoints as C
from train.checkpoints import COMPLETE, CheckpointError, checkpoint_problem
from train.export import consolidated_checkpoint_state

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SEED = 20240611
EVERY = 2                        # train.checkpoint_every
KEEP = 2                         # train.keep_checkpoints: the corruption test falls back one
# A kill costs at most 4 steps of checkpointed progress (the hits below are chosen so), so
# 4 * kills + 4 steps always leave the next kill steps to land in.
STEPS = 4 * fault_points() + 4
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
# Cycled through in this order: FAULTS_N=3 tries the first three, 6 all of them.
KILLS = ("train.checkpoint.before_marker", "train.checkpoint.after_marker", "random-time",
         "train.step.done", "train.checkpoint.file_saved", "train.checkpoint.marker_unrenamed")
PROCESS_TIMEOUT_S = 300


def _fault_overrides(store: Path, verifier: Path, *extra: str) -> list[str]:
    return _overrides(store, verifier, f"train.steps={STEPS}", f"train.checkpoint_every={EVERY}",
                      f"train.keep_checkpoints={KEEP}", "train.export=false", *extra)


@pytest.fixture(scope="module")
def reference(train_store: Path, draft_verifier_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (in-process, like tests/test_train.py's references)."""
    run = tmp_path_factory.mktemp("reference")
    _fit(run, _fault_overrides(train_store, draft_verifier_dir))
    return run


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return consolidated_checkpoint_state(run / "checkpoints" / C.tag_of(STEPS))


def _assert_same_run(run: Path, reference: Path) -> int:
    """Same per-step losses and final weights as the reference; how many losses are bit-equal."""
    losses, expected = _losses(run), _losses(reference)
    assert len(losses) == STEPS
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=0)
    got, want = _weights(run), _weights(reference)
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    return sum(a == b for a, b in zip(losses, expected))


# ---- kills ----------------------------------------------------------------------------------
def _expected_resume(root: Path) -> tuple[Path | None, list[Path]]:
    """What train.resume=auto must pick in root (the newest checkpoint with a marker), and the
    folders a killed save left without one. A kill must never leave a marker that fails."""
    folders = sorted(root.glob("step-*")) if root.is_dir() else []
    marked = [p for p in folders if (p / COMPLETE).is_file()]
    for folder in marked:
        assert checkpoint_problem(folder) is None, (folder, checkpoint_problem(folder))
    return (marked[-1] if marked else None), [p for p in folders if p not in marked]


def _max_train_step(metrics: Path) -> int:
    """The last train step in a metrics.jsonl another process is writing (a torn line is skipped)."""
    step = 0
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("split") == "train":
            step = max(step, int(record["step"]))
    return step


def _hit(kind: str, rng: random.Random, start: int) -> int:
    """Which hit of the failpoint kills: within the next 2 saves (4 files) or 4 steps."""
    saves = min(2, (STEPS - start) // EVERY)
    if kind == "train.step.done":
        return rng.randint(1, min(4, STEPS - start))
    if kind == "train.checkpoint.file_saved":              # model states, then optimizer states
        return rng.randint(1, 2 * saves)
    return rng.randint(1, saves)


def _wait_then_kill_group(proc: subprocess.Popen, metrics: Path, start: int, launched_ns: int,
                          delay_s: float) -> None:
    """SIGKILL the trainer and its loader workers `delay_s` after it logged its first new step.
    The resumed process first rewrites metrics.jsonl without the steps after its checkpoint, so a
    step past `start` in a file changed after the launch is this process's own."""
    deadline = time.time() + PROCESS_TIMEOUT_S
    while not (metrics.exists() and metrics.stat().st_mtime_ns > launched_ns and _max_train_step(metrics) > start):
        assert proc.poll() is None, "the run ended before its first step"
        assert time.time() < deadline, "no training step within the time limit"
        time.sleep(0.05)
    time.sleep(delay_s)
    os.killpg(proc.pid, signal.SIGKILL)


def _launch(run: Path, overrides: list[str], log: Path, failpoint: str | None) -> subprocess.Popen:
    env = {k: v for k, v in _env().items() if k != FAILPOINTS_ENV}
    if failpoint:
        env[FAILPOINTS_ENV] = failpoint
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "train", *_command(run, overrides)], cwd=REPO_ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _resumed_from(log: Path) -> tuple[Path, int] | None:
    found = RESUMED.findall(log.read_text(errors="replace"))
    assert len(found) <= 1, found
    return (Path(found[0][0]), int(found[0][1])) if found else None


def test_chained_kills_then_resume_repeat_the_uninterrupted_run(reference: Path, tmp_path: Path, train_store: Path,
                                                                draft_verifier_dir: Path) -> None:
    rng = random.Random(SEED)
    run, root = tmp_path / "killed", tmp_path / "killed" / "checkpoints"
    overrides = _fault_overrides(train_store, draft_verifier_dir, "train.resume=auto")
    kinds = [KILLS[i % len(KILLS)] for i in range(fault_points())]
    partial_seen, resumes = set(), []
    began = time.time()
    for i, kind in enumerate([*kinds, None]):                 # None: the final, uninterrupted run
        expected, partial = _expected_resume(root)
        partial_seen.update(partial)
        start = int(expected.name.removeprefix("step-")) if expected else 0
        log = tmp_path / f"process-{i}.log"
        failpoint = f"{kind}:{_hit(kind, rng, start)}:kill" if kind not in (None, "random-time") else None
        delay_s = rng.uniform(0.0, 2.0)
        launched_ns = time.time_ns()
        proc = _launch(run, overrides, log, failpoint)
        try:
            if kind == "random-time":
                _wait_then_kill_group(proc, run / "metrics.jsonl", start, launched_ns, delay_s)
                failpoint = f"{delay_s:.2f} s after its first step"
            rc = proc.wait(timeout=PROCESS_TIMEOUT_S)
        finally:
            try:                                              # loader workers a self-kill orphaned
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        tail = log.read_text(errors="replace")[-3000:]
        assert rc == (0 if kind is None else -signal.SIGKILL), f"process {i} ({kind}, {failpoint}): rc {rc}\n{tail}"
        # Never a folder without its marker: exactly the newest marked one, or a fresh start.
        resumed = _resumed_from(log)
        assert (resumed[0] if resumed else None) == expected, (i, kind, resumed, expected, tail)
        assert resumed is None or (resumed[0] not in partial and resumed[1] == start)
        resumes.append((kind, failpoint, start))
    equal = _assert_same_run(run, reference)
    final_start = resumes[-1][2]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == (str(root / C.tag_of(final_start)) if final_start else None)
    assert not _expected_resume(root)[1], "unfinished saves were left behind"
    assert [p.name for p in C.complete_checkpoints(root)] == [C.tag_of(s) for s in (STEPS - EVERY, STEPS)]
    print(f"\nkills: {len(kinds)} ({', '.join(f'{k} from step {s} [{f}]' for k, f, s in resumes[:-1])}); "
          f"final run resumed from step {resumes[-1][2]}; partial checkpoints seen and skipped: "
          f"{len(partial_seen)}; losses bit-equal {equal}/{STEPS}; {time.time() - began:.0f} s")


# ---- corruption -----------------------------------------------------------------------------
def test_flipped_bytes_are_refused_by_name_and_auto_falls_back(reference: Path, tmp_path: Path, train_store: Path,
                                                               draft_verifier_dir: Path, caplog, capsys) -> None:
    rng = random.Random(SEED + 1)
    run = tmp_path / "corrupt"
    shutil.copytree(reference, run)
    root = run / "checkpoints"
    newest, previous = root / C.tag_of(STEPS), root / C.tag_of(STEPS - EVERY)
    refusal = f"the previous complete checkpoint is {previous}; resume from it with train.resume={previous}"
    files = sorted(p.relative_to(newest).as_posix() for p in newest.rglob("*") if p.is_file())
    assert COMPLETE in files and len(files) >= 3               # the marker, model and optimizer states
    injected = detected = 0
    for rel in files:
        path = newest / rel
        size = path.stat().st_size
        offsets = [0, size - 1, *(rng.randrange(size) for _ in range(fault_points()))]
        for n, offset in enumerate(offsets):
            mask = rng.randrange(1, 256)
            flip_byte(path, offset, mask)
            injected += 1
            problem = checkpoint_problem(newest)
            detected += problem is not None and problem.startswith(f"file {rel} ")
            assert problem and problem.startswith(f"file {rel} "), (rel, offset, problem)
            if n == 0:
                # The run refuses the named checkpoint before DeepSpeed is started ...
                with pytest.raises(CheckpointError) as refused:
                    _fit(run, _fault_overrides(train_store, draft_verifier_dir, f"train.resume={newest}"))
                assert str(refused.value).startswith(f"checkpoint {newest}: file {rel} ")
                assert str(refused.value).endswith(refusal)
                # ... and auto takes the previous one, naming the corrupt one in an error.
                caplog.clear()
                with caplog.at_level(logging.ERROR, logger="train.checkpoints"):
                    assert C.newest_verified(root) == previous
                assert any(str(newest) in r.getMessage() and f"file {rel} " in r.getMessage()
                           for r in caplog.records), caplog.text
            flip_byte(path, offset, mask)
        assert checkpoint_problem(newest) is None
    assert detected == injected
    _verify_command_names_the_file(newest, files[-1], capsys)
    _missing_resized_or_unmarked(run, newest, previous, train_store, draft_verifier_dir)

    # Everything of both checkpoints corrupt: auto refuses to start over.
    flip_byte(newest / files[-1], 0, 0xFF)
    flip_byte(previous / files[-1], 0, 0xFF)
    with pytest.raises(CheckpointError, match=r"train.resume=auto: none of the 2 complete checkpoints .* verifies"):
        _fit(run, _fault_overrides(train_store, draft_verifier_dir))
    flip_byte(previous / files[-1], 0, 0xFF)

    # The whole way: auto resumes from the previous checkpoint, saves the newest again, and ends
    # where the uninterrupted run ended.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="train.checkpoints"):
        summary = _fit(run, _fault_overrides(train_store, draft_verifier_dir))
    assert summary["resumed_from"] == str(previous)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"checkpoint {newest}: file {files[-1]} ") for m in messages), messages
    assert any(m.startswith(f"removing checkpoint {newest}: ") for m in messages), messages
    assert checkpoint_problem(newest) is None
    equal = _assert_same_run(run, reference)
    print(f"\ncorruption: {injected} flipped bytes in {len(files)} files, {detected} detected by name; "
          f"a missing file, a truncated file and a missing marker refused too; resumed losses bit-equal {equal}/{STEPS}")


def _verify_command_names_the_file(checkpoint: Path, rel: str, capsys) -> None:
    """`python -m train verify-checkpoint` exits 0 on a good checkpoint, 1 naming a changed file."""
    from train.__main__ import verify_main

    assert verify_main([str(checkpoint)]) == 0
    flip_byte(checkpoint / rel, 0, 0x01)
    capsys.readouterr()
    assert verify_main([str(checkpoint)]) == 1
    assert f"file {rel} " in capsys.readouterr().err
    flip_byte(checkpoint / rel, 0, 0x01)


def _missing_resized_or_unmarked(run: Path, newest: Path, previous: Path, store: Path, verifier: Path) -> None:
    """A deleted file, a truncated file and a removed marker, each refused with its reason."""
    files = sorted(p for p in newest.iterdir() if p.suffix == ".pt")
    saved = files[0].read_bytes()
    files[0].unlink()
    assert checkpoint_problem(newest) == f"file {files[0].name} is missing ({COMPLETE} lists it with {len(saved)} bytes)"
    files[0].write_bytes(saved[:-1])
    assert checkpoint_problem(newest) == f"file {files[0].name} has {len(saved) - 1} bytes, {COMPLETE} recorded {len(saved)}"
    files[0].write_bytes(saved)
    marker = (newest / COMPLETE).read_bytes()
    (newest / COMPLETE).unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {newest}: file {COMPLETE} is missing: the save "
                                                        f"did not finish (a partial checkpoint); the previous")):
        _fit(run, _fault_overrides(store, verifier, f"train.resume={newest}"))
    assert C.newest_verified(newest.parent) == previous
    (newest / COMPLETE).write_bytes(marker)
    assert checkpoint_problem(newest) is None
