"""End-to-end tests of `python -m train` (train/loop.py and the modules it drives) on a small real store.

Single-rank runs go in-process (one gloo process group for the session); the 2-rank run and the
killed run are subprocesses. Everything is fp32 on the CPU, where DeepSpeed's steps are
deterministic: a resumed run repeats an uninterrupted one exactly, and 2 ranks match 1 rank with
twice the accumulation to fp32 rounding of a different reduction order (rtol 1e-5 stated below).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train.loop as loop
from evaluation.paired import HeldoutSums, paired_difference
from infra import REPO_ROOT
from config import compose_config
from model.checkpoint import load_draft
from model.training_facts import TrainingFacts
from model.verifier_handle import Verifier
from store import StoreMismatchError, StoreWriter, verifier_identity
from tests.conftest import TRAIN_STORE_MAX_LEN, env_without_rendezvous, write_verifier_store
from train.batches import SplitSizes, SplitTooSmallError, StoreSplit, check_split_sizes
from train.checkpoints import COMPLETE, complete_checkpoints
from train.deepspeed_setup import precision_of
from train.distributed import NonFiniteLossError
from train.export import consolidated_checkpoint_state, draft_from_state
from train.metrics import read_jsonl
from train.objective import Eagle3Objective, ObjectiveOutput

pytestmark = pytest.mark.slow

STEPS = 6


def _overrides(store: Path, verifier: Path, *extra: str) -> list[str]:
    return [f"store_dir={store}", f"verifier.path={verifier}", "train.precision=fp32",
            "train.max_len=384", "train.micro_batch=1", "train.grad_accum=1", f"train.steps={STEPS}",
            "train.lr=3e-3", "train.warmup_steps=1", "train.num_workers=1", "train.checkpoint_every=3",
            "eval.heldout_fraction=0.25", "eval.every=0", *extra]


def _fit(run_dir: Path, overrides: list[str]) -> dict:
    return loop.fit(compose_config("train", overrides), run_dir)


def _losses(run_dir: Path) -> list[float]:
    records = read_jsonl(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records]


def _scheduled_lrs(checkpoint: Path) -> list[float]:
    """The base lr of each optimizer parameter group, as the checkpointed lr schedule holds them."""
    states = torch.load(next(checkpoint.glob("*model_states.pt")), weights_only=False)
    return states["lr_scheduler"]["base_lrs"]


def _command(run_dir: Path, overrides: list[str]) -> list[str]:
    return [*overrides, f"hydra.run.dir={run_dir}"]


def _env() -> dict[str, str]:
    """This process's environment without the process-group variables of its in-process runs
    (their MASTER_PORT is taken: a child must pick its own)."""
    return env_without_rendezvous() | {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One math thread here and in the children: on 2 cores shared with other jobs, two OpenMP
    threads wait on each other (a step is 5-10x slower), and equal thread counts keep the
    in-process and subprocess runs bit-identical."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- ZeRO stages, export ---------------------------------------------------------------------------
ZERO_STAGES = ("zero1", "zero2", "zero3")
EVAL_STEPS = 3      # eval.ttt_steps in conf/train.yaml: acc_0..acc_2 in every held-out record


def _heldout(run_dir: Path) -> dict:
    """The run's last held-out record, after checking its accept lengths against its own per-step
    numbers: accept_length = 1 + sum_k prod_{i<=k} acc_i, chain_accept_length = 1 + sum_k chain_k."""
    held = read_jsonl(run_dir / "metrics.jsonl", "heldout")[-1]
    assert sorted(k for k in held if k.startswith("acc_")) == [f"acc_{k}" for k in range(EVAL_STEPS)]
    expected, run = 1.0, 1.0
    for k in range(EVAL_STEPS):
        run *= held[f"acc_{k}"]
        expected += run
    assert held["accept_length"] == pytest.approx(expected, rel=1e-12, abs=0)
    chains = [held[f"chain_{k}"] for k in range(EVAL_STEPS)]
    assert chains[0] == held["acc_0"] and chains == sorted(chains, reverse=True)    # chains only end
    assert held["chain_accept_length"] == pytest.approx(1.0 + sum(chains), rel=1e-12, abs=0)
    # The per-sample sums of the same evaluation (evaluation/paired.py reads them) add up to it.
    sums = HeldoutSums.read(run_dir / "heldout_samples.json")
    assert sums.step == held["step"] and sum(sums.positions.values()) == held["tokens_counted"]
    assert sums.chain_accept_length() == pytest.approx(held["chain_accept_length"], rel=1e-12)
    return held


def _untrained_heldout(run_dir: Path, store: Path, verifier: Path, *extra: str) -> dict:
    """train.steps=0: the run evaluates its initial draft (the same seed, hence the same draft the
    trained runs start from) on the same held-out rows, and stops."""
    _fit(run_dir, _overrides(store, verifier, "train.steps=0", "train.export=false", *extra))
    held = _heldout(run_dir)
    assert held["step"] == 0 and not complete_checkpoints(run_dir / "checkpoints")
    return held


@pytest.fixture(scope="module")
def zero_runs(train_store: Path, draft_verifier_dir: Path, tmp_path_factory) -> dict[str, Path]:
    runs = {}
    for stage in ZERO_STAGES:
        run = tmp_path_factory.mktemp(stage)
        _fit(run, _overrides(train_store, draft_verifier_dir, f"deepspeed={stage}"))
        runs[stage] = run
    return runs


@pytest.fixture(scope="module")
def untrained(train_store: Path, draft_verifier_dir: Path, tmp_path_factory) -> dict:
    return _untrained_heldout(tmp_path_factory.mktemp("untrained"), train_store, draft_verifier_dir)


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_each_zero_stage_trains(zero_runs: dict[str, Path], untrained: dict, stage: str) -> None:
    run = zero_runs[stage]
    losses = _losses(run)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    held = _heldout(run)
    assert held["step"] == STEPS and held["tokens_counted"] == untrained["tokens_counted"] > 0
    # On these held-out rows the initial draft accepts ~1.009 and 6 steps take it to ~1.153: the
    # trained draft must keep over a third of that gain (0.05 of 0.144).
    assert held["accept_length"] > untrained["accept_length"] + 0.05, (held, untrained)
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step-00000003", "step-00000006"]
    # The three stages partition differently but compute the same steps: each stage against the
    # next one (zero1 vs zero2, zero2 vs zero3, zero3 vs zero1).
    other = zero_runs[ZERO_STAGES[(ZERO_STAGES.index(stage) + 1) % len(ZERO_STAGES)]]
    assert other != run
    torch.testing.assert_close(losses, _losses(other), rtol=1e-5, atol=0)
    assert held["accept_length"] == pytest.approx(_heldout(other)["accept_length"], rel=1e-5)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_export_loads_back_with_the_trained_weights(zero_runs: dict[str, Path], stage: str,
                                                    draft_verifier_dir: Path) -> None:
    run = zero_runs[stage]
    draft = load_draft(run / "draft", Verifier.open(draft_verifier_dir))
    trained = consolidated_checkpoint_state(run / "checkpoints" / "step-00000006")
    exported = draft.state_dict()
    # kimi-tiny's draft trains its lm_head (draft.train_head): checkpointed and exported like the
    # other weights, and no longer the verifier's (test_bf16_the_gpu_precision_trains checks a frozen one).
    assert draft.config.train_head is False                    # a folder does not say how it was trained
    assert set(exported) == set(trained) and "lm_head.weight" in trained
    assert not torch.equal(exported["lm_head.weight"], Verifier.open(draft_verifier_dir).lm_head(torch.float32))
    for name, value in trained.items():                        # exported in bf16
        assert torch.equal(exported[name], value.to(torch.bfloat16).float()), name
    # ... in a parameter group of its own, which the schedule ran at the recipe's head_lr_scale x the lr.
    draft_lr, head_lr = _scheduled_lrs(run / "checkpoints" / "step-00000006")
    assert draft_lr == pytest.approx(3e-3) and head_lr == pytest.approx(0.3 * draft_lr)
    # On demand: `python -m train export <checkpoint>` writes the same draft.
    from train.__main__ import export_main

    assert export_main([str(run / "checkpoints" / "step-00000006"), str(run / "again")]) == 0
    again = load_draft(run / "again")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in exported.items())
    # The run's facts travel with its draft folder (evaluation and the card read them there); a
    # folder exported outside a run has none.
    facts = TrainingFacts.read(run / "draft")
    assert facts.steps == STEPS and facts.zero_stage == int(stage[-1]) and facts.heldout_accept_length > 1
    assert f"{STEPS} optimizer steps" in (run / "draft" / "README.md").read_text()
    assert TrainingFacts.read(run / "again") is None
    # A draft made from the checkpoint's state alone, with the verifier's head and embedding.
    rebuilt = draft_from_state(draft.config, trained, None, Verifier.open(draft_verifier_dir))
    rebuilt.load_verifier_embedding(Verifier.open(draft_verifier_dir))
    assert not rebuilt.embed_tokens.is_meta
    assert torch.equal(rebuilt.embed_tokens, Verifier.open(draft_verifier_dir).embedding(torch.float32))
    ids = torch.arange(8)[None]
    step = rebuilt.float().step(ids, torch.zeros(1, 8, rebuilt.config.hidden_size), ids)   # it runs
    assert torch.isfinite(step.logits).all()


def test_precision_auto_is_bf16_on_accelerators_and_on_this_cpu_by_its_flags() -> None:
    from infra import cpu_flags

    on_this_cpu = "bf16" if {"avx512_bf16", "amx_bf16"} & cpu_flags() else "fp32"
    assert precision_of("auto", "cpu") == on_this_cpu and precision_of("auto", "cuda") == "bf16"
    assert precision_of("bf16", "cpu") == "bf16" and precision_of("fp32", "cuda") == "fp32"
    with pytest.raises(ValueError, match="fp16"):
        precision_of("fp16", "cpu")


def test_bf16_the_gpu_precision_trains(tmp_path: Path, train_store: Path, draft_verifier_dir: Path) -> None:
    run = tmp_path / "bf16"
    summary = _fit(run, _overrides(train_store, draft_verifier_dir, "train.precision=bf16", "train.steps=3",
                                   "draft.train_head=false"))
    losses = _losses(run)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert summary["precision"] == "bf16" and (run / "draft" / "model.safetensors").exists()
    # A frozen full-vocabulary lm_head is the verifier's: checkpoints leave it out, exports carry it.
    trained = consolidated_checkpoint_state(run / "checkpoints" / "step-00000003")
    exported = load_draft(run / "draft", Verifier.open(draft_verifier_dir)).state_dict()
    assert set(exported) == set(trained) | {"lm_head.weight"}
    assert torch.equal(exported["lm_head.weight"], Verifier.open(draft_verifier_dir).lm_head(torch.float32))
    for name, value in trained.items():
        assert torch.equal(exported[name], value.to(torch.bfloat16).float()), name
    # One parameter group: the scale of a frozen head's lr has nothing to scale.
    assert _scheduled_lrs(run / "checkpoints" / "step-00000003") == [pytest.approx(3e-3)]


def test_pruned_vocabulary_run_exports_its_d2t(tmp_path: Path, train_store: Path, draft_verifier_dir: Path) -> None:
    """draft_vocab_size set: d2t from the training split's loss-masked token counts, in the export."""
    from safetensors.torch import load_file

    run = tmp_path / "pruned"
    _fit(run, _overrides(train_store, draft_verifier_dir, "draft.draft_vocab_size=1024", "train.steps=2"))
    d2t = load_file(str(run / "vocab.safetensors"))["d2t"]
    draft = load_draft(run / "draft", Verifier.open(draft_verifier_dir))
    assert draft.config.draft_vocab_size == 1024 and draft.lm_head.weight.shape[0] == 1024
    assert torch.equal(draft.d2t, d2t)
    assert draft.config.eos_token_id in (torch.arange(1024) + d2t).tolist()      # always kept
    # The same held-out rows with the untrained pruned draft: ~1.001, after 2 steps ~1.100.
    before = _untrained_heldout(tmp_path / "untrained", train_store, draft_verifier_dir,
                                "draft.draft_vocab_size=1024")
    held = _heldout(run)
    assert held["tokens_counted"] == before["tokens_counted"] > 0
    assert held["accept_length"] > before["accept_length"] + 0.03, (held, before)


# ---- refusal, NaN ---------------------------------------------------------------------------------
def test_mismatched_store_is_refused_before_any_compute(tmp_path: Path, draft_verifier_dir: Path,
                                                        monkeypatch) -> None:
    cfg = compose_config("dump")
    H = cfg.verifier.architecture.hidden_size
    store = tmp_path / "store"
    with StoreWriter(store, verifier_identity(draft_verifier_dir, "kimi-tiny"), [1, 4, 5], cfg.store, {},
                     aux_convention="vllm", rank=0, world_size=1) as writer:
        writer.add("s0", torch.arange(8), torch.ones(8, dtype=torch.bool), torch.zeros(8, 3, H), torch.zeros(8, H))

    def no_compute(*_):
        raise AssertionError("the model was built for a mismatched store")

    monkeypatch.setattr(loop, "build_objective", no_compute)
    with pytest.raises(StoreMismatchError, match=r"aux layer ids .*store has \[1, 4, 5\].*the draft has \[2, 4, 5\]"):
        _fit(tmp_path / "run", _overrides(store, draft_verifier_dir))


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path: Path, train_store: Path,
                                                           draft_verifier_dir: Path, monkeypatch) -> None:
    real = Eagle3Objective.forward
    calls = []

    def nan_at_third_step(self, batch, steps=None):
        out = real(self, batch, steps)
        calls.append(1)
        return ObjectiveOutput(out.loss * float("nan"), out.stats) if len(calls) == 3 else out

    monkeypatch.setattr(Eagle3Objective, "forward", nan_at_third_step)
    run = tmp_path / "run"
    with pytest.raises(NonFiniteLossError, match=r"at step 3: stopped .* last good checkpoint is .*step-00000002"):
        _fit(run, _overrides(train_store, draft_verifier_dir, "train.checkpoint_every=2"))
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step-00000002"]
    assert len(_losses(run)) == 2
    assert not (run / "draft").exists()


# ---- 2 ranks, resume after SIGKILL ----------------------------------------------------------------
def test_two_ranks_match_one_rank_with_the_same_global_batch(tmp_path: Path, train_store: Path,
                                                             draft_verifier_dir: Path) -> None:
    """1 rank x grad_accum 2 vs 2 ranks (torchrun, gloo) x grad_accum 1: the same rows per step."""
    one = tmp_path / "one"
    _fit(one, _overrides(train_store, draft_verifier_dir, "train.grad_accum=2", "train.steps=4"))
    two = tmp_path / "two"
    torchrun = Path(sys.executable).with_name("torchrun")
    subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "train",
                    *_command(two, _overrides(train_store, draft_verifier_dir, "train.steps=4"))],
                   cwd=REPO_ROOT, env=_env(), check=True, timeout=600, capture_output=True)
    # fp32; the sum over ranks is reduced in another order than the sum over micro-steps.
    torch.testing.assert_close(_losses(two), _losses(one), rtol=1e-5, atol=0)
    a, b = (read_jsonl(r / "metrics.jsonl", "heldout")[-1] for r in (one, two))
    assert a["tokens_counted"] == b["tokens_counted"]
    assert a["accept_length"] == pytest.approx(b["accept_length"], rel=1e-5)
    # Each held-out sample's sums, gathered from the rank that evaluated it.
    sa, sb = (HeldoutSums.read(r / "heldout_samples.json") for r in (one, two))
    assert sa.positions == sb.positions and len(sa.positions) > 1
    assert paired_difference(sa, sb).diff == pytest.approx(0.0, abs=1e-5)


def test_sigkill_then_resume_repeats_the_uninterrupted_run(tmp_path: Path, train_store: Path,
                                                          draft_verifier_dir: Path) -> None:
    overrides = _overrides(train_store, draft_verifier_dir, "train.steps=10", "train.checkpoint_every=2")
    reference = tmp_path / "reference"
    _fit(reference, overrides)
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "train", *_command(run, overrides)], cwd=REPO_ROOT,
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step-00000002" / COMPLETE).exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)                       # the trainer and its loader workers
    assert proc.wait(timeout=60) == -signal.SIGKILL
    killed_at = len(_losses(run))
    assert killed_at < 10
    subprocess.run([sys.executable, "-m", "train", *_command(run, [*overrides, "train.resume=auto"])],
                   cwd=REPO_ROOT, env=_env(), check=True, timeout=600, capture_output=True)
    torch.testing.assert_close(_losses(run), _losses(reference), rtol=1e-6, atol=0)
    a, b = (read_jsonl(r / "metrics.jsonl", "heldout")[-1] for r in (reference, run))
    assert a["accept_length"] == pytest.approx(b["accept_length"], rel=1e-6)


# ---- small stores: refused before the first step, or trained and exported -----------------------
SMALL_STORE_SAMPLES = 5          # a new user's first store


@pytest.fixture(scope="module")
def small_store(draft_verifier_dir: Path, tmp_path_factory) -> Path:
    return write_verifier_store(tmp_path_factory.mktemp("small") / "store", SMALL_STORE_SAMPLES, TRAIN_STORE_MAX_LEN)


def _split(store: Path, *overrides: str) -> StoreSplit:
    """The split `python -m train` makes of the store with these overrides."""
    cfg = compose_config("train", list(overrides))
    split = StoreSplit.open(store, float(cfg.eval.heldout_fraction), int(cfg.eval.heldout_seed))
    return split.with_train_fraction(float(cfg.train.train_fraction))


def _train_command(run_dir: Path, *overrides: str, ranks: int = 1) -> subprocess.CompletedProcess:
    launch = ([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", str(ranks)]
              if ranks > 1 else [sys.executable])
    return subprocess.run([*launch, "-m", "train", *_command(run_dir, list(overrides))], cwd=REPO_ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)


def _assert_exported_without_heldout(run: Path, steps: int, verifier: Path) -> None:
    assert len(_losses(run)) == steps and not read_jsonl(run / "metrics.jsonl", "heldout")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["heldout"] == {} and summary["exported"] == str(run / "draft")
    assert load_draft(run / "draft", Verifier.open(verifier)).config.vocab_size > 0


def test_a_store_with_no_heldout_sample_trains_and_exports(small_store: Path, draft_verifier_dir: Path,
                                                           tmp_path: Path) -> None:
    """The new user's `make train ARGS="store_dir=<5 conversations> train.steps=2 eval.every=0"`: at
    the default held-out fraction none of them is held out. The run says so before the first step,
    trains, skips the held-out evaluation (it used to die there, after training, before the export)
    and exports."""
    split = _split(small_store)
    assert len(split.train) == SMALL_STORE_SAMPLES and not split.heldout          # the case
    run = tmp_path / "run"
    done = _train_command(run, f"store_dir={small_store}", f"verifier.path={draft_verifier_dir}", "train.steps=2",
                          "eval.every=0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "train done: 2 steps, no held-out evaluation (no held-out samples)" in done.stdout
    log = (run / "__main__.log").read_text()
    assert f"store {small_store}: none of its {SMALL_STORE_SAMPLES} samples is held out at eval.heldout_fraction=" in log
    # 5 samples of at most 256 tokens are one row of 2048: fewer than a step's 2 (grad_accum 2).
    assert f"its {SMALL_STORE_SAMPLES} training samples pack into 1 row(s)" in log
    _assert_exported_without_heldout(run, 2, draft_verifier_dir)


def test_a_store_with_no_training_sample_is_refused_before_the_first_step(small_store: Path, draft_verifier_dir: Path,
                                                                          tmp_path: Path) -> None:
    split = _split(small_store, "eval.heldout_fraction=1.0")
    assert not split.train and len(split.heldout) == SMALL_STORE_SAMPLES           # the case
    run = tmp_path / "run"
    done = _train_command(run, f"store_dir={small_store}", f"verifier.path={draft_verifier_dir}", "train.steps=2",
                          "eval.heldout_fraction=1.0")
    assert done.returncode == 2, done.stderr[-3000:]
    assert (f"train refused: store {small_store} has no training samples (all {SMALL_STORE_SAMPLES} of its samples "
            f"are held out at eval.heldout_fraction=1.0: lower it") in done.stderr
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    assert not (run / "draft").exists()


def test_fewer_training_samples_than_ranks_train_and_export(small_store: Path, draft_verifier_dir: Path,
                                                            tmp_path: Path) -> None:
    """2 ranks, ZeRO-3, one training sample: both ranks train on it (the stream repeats epochs), the
    held-out rows do not divide between the ranks (one repeats a row it does not count)."""
    overrides = [f"store_dir={small_store}", f"verifier.path={draft_verifier_dir}", "deepspeed=zero3",
                 "train.steps=1", "train.grad_accum=1", "train.max_len=256", "train.num_workers=0",
                 "train.train_fraction=0.5", "eval.heldout_fraction=0.3"]
    split = _split(small_store, *overrides)
    assert len(split.train) == 1 and len(split.heldout) % 2 == 1                    # the case
    run = tmp_path / "run"
    done = _train_command(run, *overrides, ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "its 1 training samples pack into 1 row(s)" in (run / "__main__.log").read_text()
    assert len(_losses(run)) == 1 and (run / "draft" / "model.safetensors").exists()
    held = _heldout(run)
    assert held["step"] == 1 and held["tokens_counted"] > 0


@pytest.mark.parametrize(("train", "heldout", "epoch_rows", "rows_per_step", "expected"), [
    (40, 4, 10, 2, []),
    (5, 0, 1, 1, ["none of its 5 samples is held out at eval.heldout_fraction=0.05"]),
    (1, 3, 1, 2, ["its 1 training samples pack into 1 row(s) of train.max_len=2048 tokens, fewer than the 2 rows "
                  "one optimizer step takes (train.micro_batch x train.grad_accum x 2 rank(s))"]),
    (5, 0, 1, 2, ["none of its 5 samples is held out", "its 5 training samples pack into 1 row(s)"]),
])
def test_split_size_warnings(train: int, heldout: int, epoch_rows: int, rows_per_step: int,
                             expected: list[str]) -> None:
    warnings = check_split_sizes(SplitSizes(Path("/s"), train, heldout, epoch_rows, rows_per_step, 2), 0.05, 2048)
    assert len(warnings) == len(expected), warnings
    for part, warning in zip(expected, warnings):
        assert warning.startswith("store /s: ") and part in warning, warning


@pytest.mark.parametrize(("heldout", "reason"), [(3, "all 3 of its samples are held out at eval.heldout_fraction=0.05"),
                                                 (0, "it holds no samples")])
def test_split_without_training_samples_is_refused(heldout: int, reason: str) -> None:
    with pytest.raises(SplitTooSmallError, match=rf"store /s has no training samples \({reason}"):
        check_split_sizes(SplitSizes(Path("/s"), 0, heldout, 0, 2, 1), 0.05, 2048)
