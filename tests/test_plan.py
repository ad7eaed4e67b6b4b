"""The memory plan (train/plan.py): its meta-device step measurement against a real CPU run, the
ZeRO partitioning per stage, and `python -m train plan`."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from config import compose_config
from tests.conftest import plain_layer
from model.batch import Batch
from model.draft import DraftConfig, compose_draft_conf
from train.objective import Eagle3Objective, ObjectiveConfig
from train.plan import (PlanSpec, StepMemory, main, measure_step, memory_plan, meta_batch, meta_objective,
                        spec_from_cfg)

T_CHECK = 256
STEPS = 4
# The meta run counts every position in the loss; the real row cannot count its last 2 + k
# positions at step k (nothing left to predict), about 2% of a 256-token row here. The plan may
# exceed the measurement by that and must never fall below it.
PLAN_OVER_MEASURED = (1.0, 1.05)


@pytest.fixture
def one_thread() -> Iterator[None]:
    # 2 cores shared with other jobs: two OpenMP threads wait on each other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_cfg() -> DraftConfig:
    return plain_layer(DraftConfig.from_conf(compose_draft_conf("kimi_tiny")))


@pytest.fixture(scope="module")
def k2_cfg() -> DraftConfig:
    return DraftConfig.from_conf(compose_config("train", ["verifier=kimi_k2", "draft=kimi_k2"]).draft)


# ---- the step measurement against the CPU allocator ----------------------------------------------
def _allocations(fn: Callable[[], Any]) -> tuple[Any, list[int]]:
    """fn()'s result and the CPU allocator's allocations (+) and frees (-) during it, in order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    return result, [int(e["args"]["Bytes"]) for e in memory]


def _real_step(objective: Eagle3Objective, batch: Batch) -> tuple[int, int]:
    """(bytes held after the forward, peak bytes over forward + backward) of one step on the CPU,
    from the allocator; gradients dropped when accumulated, as measure_step does."""
    hooks = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
             for p in objective.parameters() if p.requires_grad]
    out, forward = _allocations(lambda: objective(batch, STEPS))
    _, backward = _allocations(lambda: out.loss.backward())
    for hook in hooks:
        hook.remove()
    return sum(forward), max(itertools.accumulate(forward + backward))


def test_meta_activations_and_peak_match_the_cpu_allocator(tiny_cfg: DraftConfig, one_thread: None) -> None:
    from bench.gpu_train import synthetic_batch, synthetic_objective

    objective_cfg = ObjectiveConfig(STEPS, 0.8, 1 << 27)
    planned: StepMemory = measure_step(meta_objective(tiny_cfg, objective_cfg, torch.float32),
                                       meta_batch(tiny_cfg, 1, T_CHECK), STEPS)
    objective = synthetic_objective(tiny_cfg, objective_cfg, torch.device("cpu"), torch.float32)
    batch = synthetic_batch(tiny_cfg, T_CHECK, torch.device("cpu"))
    batch = batch.map(lambda v: v.float() if v.is_floating_point() else v)  # as the fp32 trainer
    held, peak = _real_step(objective, batch)
    print(f"\nT {T_CHECK}, TTT {STEPS}: activations plan {planned.saved_bytes / 2**20:.2f} MiB vs held after "
          f"forward {held / 2**20:.2f} MiB (ratio {planned.saved_bytes / held:.4f}); peak plan "
          f"{planned.peak_bytes / 2**20:.2f} MiB vs {peak / 2**20:.2f} MiB (ratio {planned.peak_bytes / peak:.4f})")
    low, high = PLAN_OVER_MEASURED
    assert low <= planned.saved_bytes / held <= high
    assert low <= planned.peak_bytes / peak <= high


def test_saved_activations_grow_linearly_with_the_row(tiny_cfg: DraftConfig) -> None:
    """The block-wise causal attention (model/mla.py) saves q, k, v, out and lse, no [heads, T, T]
    scores: doubling T doubles the saved activations, and nothing saved is T x T."""
    cfg = ObjectiveConfig(STEPS, 0.8, 1 << 27)
    short, long = (measure_step(meta_objective(tiny_cfg, cfg, torch.bfloat16), meta_batch(tiny_cfg, 1, T), STEPS)
                   for T in (2048, 4096))
    assert long.saved_bytes / short.saved_bytes == pytest.approx(2.0, rel=0.02)
    assert all(r["shape"].count(2048) <= 1 for r in short.largest_saved)


# ---- ZeRO stages ---------------------------------------------------------------------------------
def _spec(stage: int, world: int, max_len: int = 256) -> PlanSpec:
    return PlanSpec(world_size=world, zero_stage=stage, max_len=max_len, micro_batch=1, precision="bf16",
                    ttt_steps=STEPS, ttt_decay=0.8, chunk_bytes=1 << 27, reduce_bucket_size=50_000_000)


def _rows(plan) -> dict[str, int]:
    return {r.name: r.bytes for r in plan.rows}


def _k2_trainable(c: DraftConfig) -> int:
    """Kimi-K2 draft's trainable weights, written out: fc, MLA, SwiGLU MLP, three layer norms."""
    H, h = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    mla = (2 * H * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * qk + 2 * H * (c.kv_lora_rank + c.qk_rope_head_dim)
           + c.kv_lora_rank + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim) + h * c.v_head_dim * H)
    return 3 * H * H + mla + 3 * H * c.intermediate_size + 3 * H


def test_zero_stages_partition_what_deepspeed_partitions(k2_cfg: DraftConfig) -> None:
    psi = _k2_trainable(k2_cfg)
    V, H, N = k2_cfg.vocab_size, k2_cfg.hidden_size, 8
    plans = {stage: memory_plan(k2_cfg, _spec(stage, N)) for stage in (1, 2, 3)}
    rows = {stage: _rows(p) for stage, p in plans.items()}
    shard = -(-psi // N)
    for stage, plan in plans.items():
        assert plan.trainable_params == psi
        assert rows[stage]["optimizer states"] == 12 * shard                # fp32 master + 2 moments
        # embedding, verifier lm_head, draft lm_head [V, H] and the draft's final norm, bf16, whole
        assert rows[stage]["frozen verifier tensors"] == 2 * (3 * V * H + H)
    assert rows[1]["parameters"] == rows[2]["parameters"] == 2 * psi
    assert rows[1]["gradients"] == 2 * psi
    assert rows[2]["gradients"] == 2 * (shard + 50_000_000)
    assert rows[3]["parameters"] < 2 * psi / N * 1.01
    assert plans[3].total_bytes < plans[2].total_bytes < plans[1].total_bytes
    # The step itself does not depend on the stage or the world size.
    assert len({p.step.peak_bytes for p in plans.values()}) == 1
    assert memory_plan(k2_cfg, _spec(2, 64)).step == plans[2].step


def test_stage_0_in_fp32_has_no_master_copy(tiny_cfg: DraftConfig) -> None:
    spec = _spec(0, 1)
    fp32 = memory_plan(tiny_cfg, dataclasses.replace(spec, precision="fp32"))
    bf16 = memory_plan(tiny_cfg, spec)
    assert _rows(fp32)["optimizer states"] == 8 * fp32.trainable_params
    assert _rows(bf16)["optimizer states"] == 12 * bf16.trainable_params


# ---- the command ---------------------------------------------------------------------------------
def test_plan_command_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    printed: list[str] = []
    out = tmp_path / "plan.json"
    assert main(["verifier=kimi_k2", "draft=kimi_k2", "deepspeed=zero3", "train.max_len=512",
                 "plan.world_size=16", "--json", str(out)], printed.append) == 0
    table = "\n".join(printed)
    assert "16 ranks, ZeRO-3, bf16, T 512" in table and "total (peak)" in table
    plan = json.loads(out.read_text())
    assert plan["spec"]["world_size"] == 16 and plan["spec"]["zero_stage"] == 3
    assert plan["draft"] == "kimi-k2-eagle3" and plan["overrides"][-1] == "train.max_len=512"
    names = [r["name"] for r in plan["rows"]]
    for name in ("parameters", "gradients", "optimizer states", "frozen verifier tensors", "activations (saved)",
                 "loss chunk", "forward/backward peak", "ZeRO-3 gathers"):
        assert name in names
    rows = {r["name"]: r for r in plan["rows"]}
    assert rows["optimizer step (fp32 grads)"]["bytes"] < rows["forward/backward peak"]["bytes"]
    assert plan["total_bytes"] == sum(r["bytes"] for r in plan["rows"] if r["in_total"])


def test_the_spec_follows_the_deepspeed_group() -> None:
    cfg = compose_config("train", ["verifier=kimi_k2", "draft=kimi_k2", "deepspeed=zero3"])
    spec = spec_from_cfg(cfg, 8)
    assert (spec.zero_stage, spec.max_len, spec.ttt_steps) == (3, 8192, 4)
    assert spec.prefetch_bucket_size == int(cfg.deepspeed.zero_optimization.stage3_prefetch_bucket_size)


def test_unknown_plan_options_are_refused() -> None:
    with pytest.raises(SystemExit, match="plan.world_size"):
        main(["plan.ranks=8"], lambda _: None)
