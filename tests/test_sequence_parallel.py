"""Tests of sequence parallelism (train/sequence_parallel.py, model/ulysses.py, DeepSpeed-Ulysses):
2 ranks (gloo) splitting every row give the loss and gradients of 1 rank on the whole rows (and
DeepSpeed's engine reduces them to that gradient), and a real 2-rank run with
train.sequence_parallel=2 trains, is killed, resumes and matches a 1-rank run step for step.

Tolerances (fp32 on the CPU): the split changes only the order of sums (a weight's gradient adds
two halves of the rows, the loss two ranks' shares), so the loss agrees to rtol 1e-5 and the
gradients to rtol 1e-5 / atol 1e-6 (|grad| reaches 7e-2; measured: 2e-8 at most); counts,
top-1 agreement and chains are exact.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from config import compose_config, compose_draft_conf
from infra import FAILPOINTS_ENV, REPO_ROOT
from model.batch import PAD_SEGMENT, Batch, RowSample, collate_rows, pack_row
from model.draft import DraftConfig, build_draft
from model.verifier_handle import Verifier
from model.verifier_weights import read_verifier_head
from tests.conftest import env_without_rendezvous
from train.metrics import read_jsonl
from train.objective import Eagle3Objective, ObjectiveConfig
from train.sequence_parallel import RowSlice, check_sequence_parallel

SP = 2
STEPS = 3                     # TTT steps: a halo of 4 rows past each slice
# Rows of several samples each: the ranks split at token 32, inside a sample of each row.
SAMPLE_LENGTHS = ((13, 20, 9), (30, 24))
PAD_MULTIPLE = 16             # the rows pad to 64 = SP x 32
# Each variant once on 1 rank and split over 2: the per-chunk targets, and the target cache with
# every TTT step recomputed in the backward (collectives inside torch.utils.checkpoint).
VARIANTS = {"uncached": {}, "cached, recompute": {"target_cache_bytes": 1 << 28, "recompute": True}}
# The DeepSpeed engine's reduction over the group is checked with ZeRO-2 (conf/train.yaml's
# default); the killed and resumed run below trains with ZeRO-3 (whose reduce-scatter needs the
# loss scaled: SequenceParallel.backward_scale).
ENGINE_STAGE = "zero2"


def _rows(cfg: DraftConfig) -> Batch:
    g = torch.Generator().manual_seed(0)
    H, rows = cfg.hidden_size, []
    for lengths in SAMPLE_LENGTHS:
        samples = [RowSample(torch.randint(0, cfg.vocab_size, (T,), generator=g), torch.rand(T, generator=g) < 0.7,
                             torch.randn(T, cfg.num_aux, H, generator=g), torch.randn(T, H, generator=g))
                   for T in lengths]
        rows.append(pack_row(samples, max_len=64))
    return collate_rows(rows, multiple=SP * PAD_MULTIPLE)


def _objective(cfg: DraftConfig, verifier: Path, **settings) -> Eagle3Objective:
    torch.manual_seed(0)
    draft = build_draft(cfg)
    draft.load_verifier_head(Verifier.open(verifier))
    head = read_verifier_head(verifier, torch.float32).lm_head
    return Eagle3Objective(draft, head, ObjectiveConfig(STEPS, 0.8, 1 << 20, **settings))


def _loss_stats_grads(objective: Eagle3Objective, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    out = objective(batch)
    out.loss.backward()
    grads = {n: p.grad for n, p in objective.draft.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.stats.stacked(), grads


def _engine_grad_norm(stage: str, sequence, cfg: DraftConfig, verifier: Path) -> float:
    """One micro-step through the DeepSpeed engine with the sequence-parallel mpu, the loss scaled
    as train/loop.py scales it: the norm of the gradient DeepSpeed reduced."""
    from train.deepspeed_setup import initialize

    train_cfg = compose_config("train", [f"deepspeed={stage}", "train.precision=fp32", "train.grad_accum=1",
                                         f"verifier.path={verifier}"])
    objective = _objective(cfg, verifier)
    objective.split_rows(sequence)
    engine = initialize(objective, train_cfg, 1, sequence.mpu())
    out = engine(sequence.slicer(_rows(cfg)))
    engine.backward(out.loss * sequence.backward_scale(engine))
    engine.step()
    norm = float(engine.get_global_grad_norm())
    engine.destroy()
    return norm


def _split_rank(rank: int, port: int, cfg: DraftConfig, verifier: Path, result: Path) -> None:
    """One of the 2 ranks: each variant on this rank's slice, summed over the group (what DeepSpeed
    does with the gradients under this mpu)."""
    from train.distributed import init_distributed
    from train.sequence_parallel import init_sequence_parallel

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(SP), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed()
    sequence = init_sequence_parallel(SP, cfg.num_attention_heads, STEPS)
    assert (sequence.rank, sequence.data_rank, sequence.data_world) == (rank, 0, 1)
    results = {}
    for name, settings in VARIANTS.items():
        objective = _objective(cfg, verifier, **settings)
        objective.split_rows(sequence)
        cut = sequence.slicer(_rows(cfg))
        loss, stats, grads = _loss_stats_grads(objective, cut)
        for t in (loss, stats, *grads.values()):
            dist.all_reduce(t)
        results[name] = (loss, stats, grads)
    results["engine grad norm"] = _engine_grad_norm(ENGINE_STAGE, sequence, cfg, verifier)
    if rank == 0:
        torch.save(results, result)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_cfg(draft_verifier_dir: Path) -> DraftConfig:
    return DraftConfig.from_conf(compose_draft_conf("kimi_tiny"), Verifier.open(draft_verifier_dir))


def test_a_rank_cut_shifts_as_the_whole_row() -> None:
    """Each rank's cut (its slice, the halo after it, padding past the row's end): the TTT inputs
    of its positions and the target rows they read are those of the whole row."""
    from model.chain import step_inputs

    H = 4
    g = torch.Generator().manual_seed(1)
    samples = [RowSample(torch.arange(T) + 100 * i, torch.rand(T, generator=g) < 0.7, torch.zeros(T, 1, H),
                         torch.arange(T, dtype=torch.float32)[:, None].expand(T, H) + 100 * i)
               for i, T in enumerate((13, 20, 9))]
    batch = collate_rows([pack_row(samples, max_len=64)], multiple=SP * PAD_MULTIPLE)
    T = batch.input_ids.shape[1]
    L = T // SP
    for rank in range(SP):
        slicer = RowSlice(rank, SP, STEPS + 1)
        cut = slicer(batch)
        span, start = slicer.span(cut), rank * L
        assert cut.input_ids.shape[1] == L + STEPS + 1 and span == L
        for k in range(STEPS):
            for mine, whole in zip(step_inputs(cut, k), step_inputs(batch, k)):
                assert torch.equal(mine[:, :span], whole[:, start:start + L]), (rank, k)
            _, _, counted = step_inputs(cut, k)
            b, t = counted[:, :span].nonzero(as_tuple=True)
            assert torch.equal(cut.final[b, t + 1 + k], batch.final[b, start + t + 1 + k])
    last = RowSlice(SP - 1, SP, STEPS + 1)(batch)
    assert (last.segment_ids[:, L:] == PAD_SEGMENT).all() and not last.loss_mask[:, L:].any()
    assert RowSlice(0, 1, 0)(batch) is batch


@pytest.mark.parametrize(("size", "world", "heads", "reason"), [
    (3, 2, 6, "it must divide the 2 rank"), (2, 2, 3, "it must divide the draft's 3 attention heads"),
    (0, 2, 4, "at least 1"),
])
def test_sizes_the_ranks_or_heads_cannot_split_by_are_refused(size: int, world: int, heads: int,
                                                              reason: str) -> None:
    with pytest.raises(ValueError, match=rf"train.sequence_parallel={size}: .*{reason}"):
        check_sequence_parallel(size, world, heads)


def test_a_run_is_refused_before_any_compute_when_the_ranks_do_not_split(tmp_path: Path, draft_verifier_dir: Path,
                                                                          monkeypatch) -> None:
    import train.loop as loop

    def no_compute(*_):
        raise AssertionError("the run went on past a sequence_parallel it cannot split by")

    monkeypatch.setattr(loop, "prepare", no_compute)
    cfg = compose_config("train", [f"store_dir={tmp_path / 'none'}", f"verifier.path={draft_verifier_dir}",
                                   "train.sequence_parallel=2"])
    with pytest.raises(ValueError, match=r"train.sequence_parallel=2: it must divide the 1 rank"):
        loop.fit(cfg, tmp_path / "run")


def test_two_ranks_splitting_the_rows_match_one_rank(tiny_cfg: DraftConfig, draft_verifier_dir: Path,
                                                     tmp_path: Path) -> None:
    batch = _rows(tiny_cfg)
    assert batch.input_ids.shape == (2, 64) and (batch.segment_ids == PAD_SEGMENT).any()
    result = tmp_path / "split.pt"
    mp.start_processes(_split_rank, args=(_free_port(), tiny_cfg, draft_verifier_dir, result), nprocs=SP,
                       start_method="spawn")
    split = torch.load(result)
    for name, settings in VARIANTS.items():
        loss, stats, grads = _loss_stats_grads(_objective(tiny_cfg, draft_verifier_dir, **settings), batch)
        s_loss, s_stats, s_grads = split[name]
        assert stats[2, 0] > 20, name                                     # counted positions at step 0
        assert torch.equal(s_stats[1:], stats[1:]), name                   # correct, count, chain
        torch.testing.assert_close(s_stats[0], stats[0], rtol=1e-5, atol=0)
        torch.testing.assert_close(s_loss, loss, rtol=1e-5, atol=0)
        assert set(s_grads) == set(grads)
        for param, grad in grads.items():
            torch.testing.assert_close(s_grads[param], grad, rtol=1e-5, atol=1e-6, msg=f"{name}: {param}")
        if name == "uncached":                                            # the engine's objective
            norm = torch.stack([g.pow(2).sum() for g in grads.values()]).sum().sqrt().item()
            assert split["engine grad norm"] == pytest.approx(norm, rel=1e-5)


# ---- python -m train with train.sequence_parallel=2 -------------------------------------------------
def _train_overrides(store: Path, verifier: Path, *extra: str) -> list[str]:
    return [f"store_dir={store}", f"verifier.path={verifier}", "train.precision=fp32", "train.max_len=384",
            "train.micro_batch=1", "train.grad_accum=1", "train.steps=4", "train.lr=3e-3", "train.warmup_steps=1",
            "train.num_workers=1", "train.checkpoint_every=2", "eval.heldout_fraction=0.25", "eval.every=0", *extra]


def _train_records(run: Path) -> list[dict]:
    records = read_jsonl(run / "metrics.jsonl", "train")
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return records


def _torchrun(run: Path, overrides: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    return subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", str(SP), "-m", "train", *overrides,
                           f"hydra.run.dir={run}"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_a_split_run_killed_and_resumed_matches_one_rank(train_store: Path, draft_verifier_dir: Path,
                                                         tmp_path: Path) -> None:
    """ZeRO-3, 1 rank vs 2 ranks splitting each row (data-parallel world 1: the same rows per
    step), killed after its step-3 record (the checkpoint of step 2 complete) and resumed: the same
    losses and gradient norms at every step (the gradient reduced over the SP group is their sum:
    the clipping and Adam would hide a scale, the norm does not), the same held-out numbers."""
    from train.loop import fit

    one = tmp_path / "one"
    fit(compose_config("train", _train_overrides(train_store, draft_verifier_dir, "deepspeed=zero3")), one)
    run = tmp_path / "split"
    overrides = _train_overrides(train_store, draft_verifier_dir, "deepspeed=zero3", f"train.sequence_parallel={SP}")
    env = env_without_rendezvous() | {"OMP_NUM_THREADS": "1"}
    killed = _torchrun(run, overrides, env | {FAILPOINTS_ENV: "train.step.done:3:kill"})
    assert killed.returncode != 0 and len(_train_records(run)) == 3, killed.stderr[-3000:]
    resumed = _torchrun(run, [*overrides, "train.resume=auto"], env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert Path(summary["resumed_from"]).name == "step-00000002" and summary["sequence_parallel"] == SP
    split, whole = _train_records(run), _train_records(one)
    assert len(split) == len(whole) == 4
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in split], [r[key] for r in whole], rtol=1e-5, atol=0, msg=key)
    assert [r["tokens"] for r in split] == [r["tokens"] for r in whole]
    a, b = (read_jsonl(r / "metrics.jsonl", "heldout")[-1] for r in (one, run))
    assert a["tokens_counted"] == b["tokens_counted"] > 0
    assert b["accept_length"] == pytest.approx(a["accept_length"], rel=1e-5)
