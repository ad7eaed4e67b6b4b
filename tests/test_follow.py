"""A trainer following a dump that is still writing its store (train.follow): held-out shards, the
bound on disk (store.max_bytes) and its wait, retirement, the windows' schedule, a real dump (vLLM)
with a following trainer at the same time on a store bounded below the data's size (each killed
once and resumed), kills of the trainer at seeded points, and 2 dump ranks with 2 trainer ranks."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from store import StoreReader, StoreWriter, inspect_store
from store.progress import (RETIRED, SampleRetiredError, completion, read_retired, retire_shards, shards_bytes,
                            waiting_ranks)
from store.format import MANIFEST_DIR
from tests.conftest import env_without_rendezvous
from tests.test_dump import short_multiturn, write_jsonl
from tests.test_store import AUX_IDS, IDENTITY, make_sample, storage

REPO_ROOT = Path(__file__).resolve().parent.parent


def _writer(path: Path, **kwargs) -> StoreWriter:
    return StoreWriter(path, IDENTITY, AUX_IDS, storage(shard_bytes=1), {"data": {"format": "messages"}},
                       aux_convention="vllm", aux_capture="residual_stream", rank=0, world_size=1, **kwargs)


def _add(writer: StoreWriter, sample_id: str) -> None:
    sample = make_sample(sample_id)
    writer.add(sample_id, sample["input_ids"], sample["loss_mask"], sample["aux"], sample["final"])


def _held(sample_id: str) -> bool:
    return sample_id.endswith("h")


def test_held_out_samples_get_shards_of_their_own_and_retired_ones_are_history(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with _writer(store, heldout=_held) as writer:
        for i in range(6):
            _add(writer, f"s{i}" + ("h" if i % 3 == 0 else ""))
            writer.commit_if_full()
        writer.close(done=True)
    reader = StoreReader(store)
    kinds = {e.name: e.heldout for e in reader.shards()}
    assert all(all(_held(s) == e.heldout for s in e.sample_ids) for e in reader.shards())
    assert sum(kinds.values()) == 2 and completion(store).complete

    training = [e for e in reader.shards() if not e.heldout]
    refs = {r.sample_id: r for r in reader.samples()}
    new = retire_shards(store, [training[0].name])
    assert [e.name for e in new] == [training[0].name] and not (store / "shards" / training[0].name).exists()
    assert retire_shards(store, [training[0].name]) == []                     # once only
    after = StoreReader(store)
    gone = training[0].sample_ids[0]
    assert gone not in {r.sample_id for r in after.samples()}
    with pytest.raises(SampleRetiredError, match=f"{gone}.*{training[0].name}"):
        after.read_sample(refs[gone])                                          # refused by name
    with pytest.raises(SampleRetiredError):
        reader.read_sample(refs[gone])                                         # a reader opened before, too
    assert not after.verify()
    report = inspect_store(store)
    assert report["retired"]["shards"] == 1 and report["retired"]["samples"] == len(training[0].sample_ids)
    # A resumed dump takes retired samples for done, and lists nothing as lost.
    with _writer(store, heldout=_held) as again:
        assert gone in again.done_sample_ids()
    assert set(read_retired(store)) == {training[0].name}
    assert not completion(store).complete                                      # reopened: not done any more


def test_a_bounded_writer_waits_for_retirement_and_the_disk_stays_within_one_shard(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with _writer(store) as probe:                     # one shard's size on disk
        _add(probe, "probe")
    shard = shards_bytes(store)
    retire_shards(store, [e.name for e in StoreReader(store).shards()])
    bound = 3 * shard
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], shards_bytes(store))
            time.sleep(0.005)

    def retire_slowly() -> None:        # what a following trainer does: retire what is committed
        while not stop.is_set():
            if waiting_ranks(store):
                live = [e.name for e in StoreReader(store).shards()]
                retire_shards(store, live[:1])
            time.sleep(0.05)

    threads = [threading.Thread(target=f, daemon=True) for f in (watch, retire_slowly)]
    for t in threads:
        t.start()
    try:
        with _writer(store, max_bytes=bound, poll_s=0.02) as writer:
            for i in range(10):
                _add(writer, f"w{i}")
                writer.commit_if_full()
            waited = writer.stats.waited_s
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert waited > 0 and not waiting_ranks(store)
    assert peak[0] <= bound + int(1.05 * shard)          # the bound plus one shard (tile sizes vary a little)
    names = set(read_retired(store)) | {e.name for e in StoreReader(store).shards()}
    assert len(names) == 11                              # the probe's and ten: none lost


def test_rank_0_decides_the_windows_and_the_others_read_them(tmp_path: Path) -> None:
    """FollowSchedule without a dump running: windows of whole shards in name order, each shard
    held for train.epochs (2) windows, recorded before use; a second rank reads the same windows
    from the record; a resumed schedule replays them; a shard retires after its last window."""
    from train.follow import FollowSchedule

    store = tmp_path / "store"
    with _writer(store) as writer:
        for i in range(5):
            _add(writer, f"s{i}")
            writer.commit_if_full()
        writer.close(done=True)
    args = dict(window=2, poll_s=0.01, epochs=2, max_len=64, seed=0, rows_per_step=2, heldout=(0.0, 1))
    record = tmp_path / "run" / "follow.json"
    record.parent.mkdir()

    def seen(segments) -> list[tuple[int, int, list[str]]]:     # each segment's steps and the shards its rows read
        return [(s.first_step, s.steps, sorted({r.shard for r in s.refs})) for s in segments]

    lead = seen(FollowSchedule(store, record, rank=0, **args).segments(0))
    names = sorted(e.name for e in StoreReader(store).shards())
    # New shards two at a time; each window reads its own and the previous window's; once the dump
    # is done, a last window without new shards gives the last one its second pass.
    assert [shards for *_, shards in lead] == [names[0:2], names[0:4], names[2:5], names[4:5]]
    assert [first for first, *_ in lead] == [0, *[sum(steps for _, steps, _ in lead[:k]) for k in (1, 2, 3)]]
    reads = [shard for *_, shards in lead for shard in shards]
    assert all(reads.count(name) == 2 for name in names)                # every shard trained train.epochs times
    other = seen(FollowSchedule(store, record, rank=1, **args).segments(0))
    assert other == lead
    resumed = FollowSchedule(store, record, rank=0, **args)
    assert seen(resumed.segments(lead[1][0])) == lead[1:]
    resumed.retire_through(lead[1][0])                                 # after window 0: nothing has had 2 passes
    assert not read_retired(store)
    resumed.retire_through(lead[2][0])                                 # after window 1: window 0's shards
    assert set(read_retired(store)) == set(names[0:2])
    with pytest.raises(ValueError, match="retired after a later checkpoint"):
        list(FollowSchedule(store, record, rank=1, **args).segments(0))
    with pytest.raises(ValueError, match="whole number"):
        FollowSchedule(store, record, rank=0, **{**args, "epochs": 1.5})


# ---- a real dump and a following trainer at once -----------------------------------------------
CONVERSATIONS = 16
# A 1 GiB KV cache per dump engine (the data is 16 short conversations): the test's engines and the
# session's shared one fit a 24 GiB machine.
DUMP = ["data=jsonl", "max_len=384", "batch_size=2", "store.shard_bytes=1", "regenerate.max_tokens=16", "regenerate.dtype=engine",
        "store.poll_s=0.2", "heldout_split.heldout_fraction=0.25", "engine.kv_cache_space_gib=1"]


def _train_overrides(store: Path, verifier: Path) -> list[str]:
    return [f"store_dir={store}", f"verifier.path={verifier}", "train.precision=fp32", "train.max_len=384",
            "train.micro_batch=1", "train.grad_accum=1", "train.lr=3e-3", "train.warmup_steps=1",
            "train.warmup_ratio=null", "train.num_workers=0", "train.checkpoint_every=0", "train.epochs=1",
            "eval.heldout_fraction=0.25", "eval.every=0", "train.follow=true", "train.follow_window=1",
            "train.follow_poll_s=0.2", "train.keep_checkpoints=1"]


# A dump whose engine core runs in the dump process: two processes fewer to start (each imports
# torch and vLLM) for each dump rank.
IN_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _env() -> dict[str, str]:
    return env_without_rendezvous() | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(short_multiturn(CONVERSATIONS), tmp_path_factory.mktemp("follow") / "data.jsonl")


@pytest.fixture(scope="module")
def full_store(tmp_path_factory: pytest.TempPathFactory, data_file: Path, verifier_llm) -> Path:
    """The data dumped without a bound (the shared engine): its size sets the test's bound."""
    from config import compose_config
    from dump.pipeline import run_dump

    out = tmp_path_factory.mktemp("follow") / "full"
    run_dump(compose_config("dump", [*DUMP, f"data.path={data_file}", f"output_dir={out}"]), llm=verifier_llm)
    return out


# Each process of the concurrent test is SIGKILLed once, at these points, and started again: the dump
# with a shard written but not committed (its tmp folder on disk), the trainer after its first
# window's checkpoint, before that window's retirement.
CONCURRENT_KILLS = {"dump": "store.shard.before_rename:2:kill", "train": "train.window.checkpointed:1:kill"}


@pytest.mark.vllm
def test_a_trainer_follows_a_bounded_dump_and_trains_on_every_sample(
        tmp_path: Path, data_file: Path, full_store: Path, kimi_tiny_dir: Path,
        in_process_dump_env: dict[str, str]) -> None:
    """A real dump and a following trainer at once, each killed once and started again: the trainer
    trains every training sample exactly once (train.epochs=1), the disk stays within the bound
    plus one shard, retired shards are recorded and only held-out shards stay."""
    from infra import FAILPOINTS_ENV

    full = StoreReader(full_store)
    sizes = [e.nbytes for e in full.shards()]
    bound = sum(sizes) // 3                              # a third of the data's size
    store, run = tmp_path / "store", tmp_path / "run"
    commands = {"dump": [sys.executable, "-m", "dump", f"output_dir={store}", *DUMP, f"data.path={data_file}",
                         f"store.max_bytes={bound}", f"hydra.run.dir={tmp_path / 'dump-hydra'}"],
                # Windows of two shards: the trainer retires nothing until two are in, or until the
                # dump waits on the bound (it then closes the window early), which the held-out
                # shards and two training shards exceed: the dump waits whatever the timing.
                "train": [sys.executable, "-m", "train", *_train_overrides(store, kimi_tiny_dir), "train.resume=auto",
                          "train.follow_window=2", f"hydra.run.dir={run}"]}
    envs = {"dump": _env() | in_process_dump_env, "train": _env()}  # no engine process left by a kill
    logs: dict[str, list[Path]] = {"dump": [], "train": []}
    codes: dict[str, list[int]] = {"dump": [], "train": []}

    def launch(name: str, kill: bool) -> subprocess.Popen:
        log = tmp_path / f"{name}-{len(logs[name])}.log"
        logs[name].append(log)
        env = envs[name] | ({FAILPOINTS_ENV: CONCURRENT_KILLS[name]} if kill else {})
        return subprocess.Popen(commands[name], cwd=REPO_ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)

    procs = {name: launch(name, kill=True) for name in commands}
    peak = 0
    try:
        while procs:
            if store.exists():
                peak = max(peak, shards_bytes(store))
            for name, proc in list(procs.items()):
                if proc.poll() is None:
                    continue
                codes[name].append(proc.returncode)
                del procs[name]
                if proc.returncode == -9:                # killed at its failpoint: started again, resuming
                    procs[name] = launch(name, kill=False)
            time.sleep(0.02)
    finally:
        for proc in procs.values():
            proc.kill()
    dump_log, train_log = ("".join(log.read_text() for log in logs[name]) for name in ("dump", "train"))
    assert codes["dump"] == [-9, 0], dump_log[-3000:]
    assert codes["train"] == [-9, 0], train_log[-3000:]
    assert "waits" in dump_log, (peak, bound, sizes)      # the bound held the dump back

    reader = StoreReader(store)
    retired = read_retired(store)
    summary = json.loads((run / "summary.json").read_text())
    windows = summary["follow"]["windows"]
    trained = [s for w in windows for shard in w["shards"] for s in retired[shard].sample_ids]
    everything = {s for e in [*reader.shards(), *retired.values()] for s in e.sample_ids}
    held = {s for e in reader.shards() if e.heldout for s in e.sample_ids}
    assert everything == {s for e in full.shards() for s in e.sample_ids}      # the same data as unbounded
    assert len(trained) == len(set(trained))                              # each in one window: trained once
    assert set(trained) == everything - held and held                     # every training sample, no held-out one
    assert all(e.heldout for e in reader.shards())                         # only held-out shards stay
    assert set(retired) == {s for w in windows for s in w["shards"]}      # retired shards are recorded
    assert peak <= bound + max(sizes) * 1.05
    assert summary["steps"] == sum(w["steps"] for w in windows) and summary["exported"]
    assert summary["heldout"]                                              # evaluated on the held-out shards
    assert (store / MANIFEST_DIR / RETIRED).exists()


# ---- kills --------------------------------------------------------------------------------------
# Cycled in this order; FAULTS_N=3 (make test) tries the first three. After its window's checkpoint,
# before the retirement; after a step inside a window; after a checkpoint's marker.
FOLLOW_KILLS = ("train.window.checkpointed", "train.step.done", "train.checkpoint.after_marker",
                "train.checkpoint.before_marker")


def _copy_store(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.lock"))
    return dst


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "draft" / "model.safetensors"))


@pytest.mark.vllm
@pytest.mark.faults
def test_a_following_trainer_killed_and_resumed_ends_as_an_uninterrupted_one(
        tmp_path: Path, full_store: Path, kimi_tiny_dir: Path) -> None:
    """On the finished store (its windows then depend on nothing but the store): killed at seeded
    points and resumed each time, the run trains the same windows, retires every training shard
    once, never reads a retired one, and exports the weights of the uninterrupted run."""
    import random

    import torch
    from infra import FAILPOINTS_ENV
    from tests.conftest import fault_points

    overrides = [*_train_overrides(Path("STORE"), kimi_tiny_dir), "train.checkpoint_every=2"]

    def command(store: Path, run: Path) -> list[str]:
        return [sys.executable, "-m", "train", *[o.replace("STORE", str(store)) for o in overrides],
                "train.resume=auto", f"hydra.run.dir={run}"]

    reference = tmp_path / "reference"
    store_a = _copy_store(full_store, tmp_path / "store-a")
    done = subprocess.run(command(store_a, reference), cwd=REPO_ROOT, env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    store_b, run = _copy_store(full_store, tmp_path / "store-b"), tmp_path / "killed"
    rng, outcomes = random.Random(23), []
    for i in range(fault_points()):
        point = FOLLOW_KILLS[i % len(FOLLOW_KILLS)]
        hit = rng.randint(1, 3)
        proc = subprocess.run(command(store_b, run), cwd=REPO_ROOT, env={**_env(), FAILPOINTS_ENV: f"{point}:{hit}:kill"},
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode in (0, -9), proc.stdout[-3000:] + proc.stderr[-3000:]
        outcomes.append((point, hit, "killed" if proc.returncode == -9 else "finished"))
    final = subprocess.run(command(store_b, run), cwd=REPO_ROOT, env=_env(), capture_output=True, text=True)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    print("kills:", outcomes)
    assert any(o == "killed" for *_, o in outcomes)

    want, got = (json.loads((r / "summary.json").read_text()) for r in (reference, run))
    assert got["follow"]["windows"] == want["follow"]["windows"]           # the same windows, steps, samples
    assert set(read_retired(store_b)) == set(read_retired(store_a))        # every training shard retired once
    a, b = _weights(reference), _weights(run)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=0, msg=name)


@pytest.mark.vllm
@pytest.mark.slow
def test_two_dump_ranks_and_two_trainer_ranks_share_one_bounded_store(
        tmp_path: Path, data_file: Path, full_store: Path, kimi_tiny_dir: Path) -> None:
    """Dump ranks 0 and 1 (one engine each) and a 2-rank trainer (torchrun, gloo) on one store, as
    nodes sharing a filesystem would: rank 0 decides the windows for both trainer ranks, the dump
    ends on both ranks' done markers, and the disk stays within the bound plus a shard per writer."""
    full = StoreReader(full_store)
    sizes = [e.nbytes for e in full.shards()]
    bound = sum(sizes) // 3
    store, run = tmp_path / "store", tmp_path / "run"
    dumps = [subprocess.Popen([sys.executable, "-m", "dump", f"output_dir={store}", *DUMP, f"data.path={data_file}",
                               f"store.max_bytes={bound}", f"rank={r}", "world_size=2",
                               f"hydra.run.dir={tmp_path / f'dump-hydra-{r}'}"],
                              cwd=REPO_ROOT, env=_env() | IN_PROCESS_ENGINE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    torchrun = Path(sys.executable).parent / "torchrun"
    train = subprocess.Popen([str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "train",
                              *_train_overrides(store, kimi_tiny_dir), f"hydra.run.dir={run}"],
                             cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs, peak = [*dumps, train], 0
    try:
        while any(p.poll() is None for p in procs):
            if store.exists():
                peak = max(peak, shards_bytes(store))
            time.sleep(0.02)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    logs = [p.stdout.read() for p in procs]
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-3000:]

    reader, retired = StoreReader(store), read_retired(store)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and completion(store).complete and completion(store).world_size == 2
    windows = summary["follow"]["windows"]
    trained = {s for w in windows for shard in w["shards"] for s in retired[shard].sample_ids}
    held = {s for e in reader.shards() if e.heldout for s in e.sample_ids}
    everything = {s for e in full.shards() for s in e.sample_ids}
    assert trained == everything - held                                   # both dump ranks' training samples
    assert {shard[:6] for w in windows for shard in w["shards"]} == {"r00000", "r00001"}
    assert peak <= bound + 2 * max(sizes) * 1.05
