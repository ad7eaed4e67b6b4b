"""The memory plan (train/plan.py): its meta-device step measurement against a real CPU run, the
ZeRO partitioning per stage, one rank of a sequence-parallel group, and `python -m train plan`."""
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

from config import compose_config, compose_draft_conf
from tests.conftest import plain_layer
from model.batch import Batch
from model.draft import DraftConfig
from train.objective import Eagle3Objective, ObjectiveConfig
from train.plan import (PlanRefused, PlanSpec, StepMemory, main, measure_step, memory_plan, meta_batch,
                        meta_objective, spec_from_cfg)
from train.plan_ulysses import install_attention_cores

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


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
def test_meta_activations_and_peak_match_the_cpu_allocator(tiny_cfg: DraftConfig, one_thread: None,
                                                           recompute: bool) -> None:
    """Also with each TTT step under torch.utils.checkpoint (recompute): the plan then counts the
    steps' inputs checkpoint keeps, and the peak of the backward's recomputation."""
    from bench.gpu_train import synthetic_batch, synthetic_objective

    objective_cfg = ObjectiveConfig(STEPS, 0.8, 1 << 27, recompute=recompute)
    fp32 = lambda b: b.map(lambda v: v.float() if v.is_floating_point() else v)  # noqa: E731  (the fp32 trainer's)
    # Both batches in fp32: a bf16 aux would add the step an fp32 copy the real batch has not.
    planned: StepMemory = measure_step(meta_objective(tiny_cfg, objective_cfg, torch.float32),
                                       fp32(meta_batch(tiny_cfg, 1, T_CHECK)), STEPS)
    objective = synthetic_objective(tiny_cfg, objective_cfg, torch.device("cpu"), torch.float32)
    batch = fp32(synthetic_batch(tiny_cfg, T_CHECK, torch.device("cpu")))
    held, peak = _real_step(objective, batch)
    print(f"\nT {T_CHECK}, TTT {STEPS}, recompute {recompute}: activations plan "
          f"{planned.saved_bytes / 2**20:.2f} MiB vs held after forward {held / 2**20:.2f} MiB "
          f"(ratio {planned.saved_bytes / held:.4f}); peak plan "
          f"{planned.peak_bytes / 2**20:.2f} MiB vs {peak / 2**20:.2f} MiB (ratio {planned.peak_bytes / peak:.4f})")
    low, high = PLAN_OVER_MEASURED
    assert low <= planned.saved_bytes / held <= high
    assert low <= planned.peak_bytes / peak <= high


def test_saved_activations_grow_linearly_with_the_row(tiny_cfg: DraftConfig) -> None:
    """The block-wise causal attention (model/ttt_attention.py) saves q, k, v, out and lse, no [heads, T, T]
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
        # embedding and lm_head [V, H] (the draft's is the verifier's: one tensor) and the draft's
        # final norm, bf16, whole
        assert rows[stage]["frozen verifier tensors"] == 2 * (2 * V * H + H)
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


# ---- sequence parallelism ------------------------------------------------------------------------
def test_a_sequence_parallel_rank_holds_its_tokens_and_its_heads(tiny_cfg: DraftConfig) -> None:
    """SP 2 on 2 ranks at T 512: the rank's per-token parts are those of 256 tokens; the attention
    core runs over all 512 positions for half the heads; ZeRO partitions over both ranks, as the
    trainer's DeepSpeed does (train/sequence_parallel.py)."""
    T, sp, c = 512, 2, tiny_cfg
    spec = dataclasses.replace(_spec(2, 2, T), sequence_parallel=sp)
    split, whole = memory_plan(c, spec), _rows(memory_plan(c, _spec(2, 2, T)))
    rows, half_row = _rows(split), memory_plan(c, _spec(2, 2, T // sp))
    h, dqk, dv, bf16 = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim, 2
    assert rows["micro-batch"] == whole["micro-batch"] // sp
    # Per token as on 256-token rows, but for o_proj's input: under SP the exchanged copy of the
    # core's output, a tensor apart from the output the core keeps.
    o_proj_inputs = STEPS * (T // sp) * h * dv * bf16
    assert rows["  per-token parts"] == _rows(half_row)["  per-token parts"] + o_proj_inputs
    # What attention_ttt saves (model/ttt_attention.py), per step over the whole row for h / SP heads: q, k,
    # v and the output in bf16, one fp32 log-sum-exp per query and head.
    assert rows["  attention core"] == STEPS * T * (h // sp) * ((2 * dqk + 2 * dv) * bf16 + 4)
    # One all-to-all carries q, k, v of the rank's 256 tokens: its send and receive buffers.
    assert rows["all-to-all buffers"] == 2 * (T // sp) * h * (2 * dqk + dv) * bf16
    assert abs(split.step.peak_bytes - half_row.step.peak_bytes) <= rows["all-to-all buffers"]
    for name in ("parameters", "gradients", "optimizer states"):
        assert rows[name] == whole[name]
    with_halo = _rows(memory_plan(c, dataclasses.replace(spec, halo=5)))
    assert with_halo["micro-batch"] == whole["micro-batch"] * (T // sp + 5) // T


# Each once: every TTT step's activations kept, and every step recomputed in the backward.
SP_VARIANTS = {"saved": False, "recompute": True}


def _sequence_parallel_rank(rank: int, port: int, cfg: DraftConfig, result: Path) -> None:
    """One of 2 gloo ranks running the synthetic row split over them (train/sequence_parallel.py,
    model/ulysses.py: DeepSpeed's all-to-all); rank 0 writes its step's measure_step figures."""
    import torch.distributed as dist

    from bench.gpu_train import synthetic_batch, synthetic_objective
    from train.distributed import init_distributed
    from train.sequence_parallel import init_sequence_parallel

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed()
    sequence = init_sequence_parallel(2, cfg.num_attention_heads, STEPS)
    batch = synthetic_batch(cfg, T_CHECK, torch.device("cpu"))
    batch = batch.map(lambda v: v.float() if v.is_floating_point() else v)
    measured = {}
    for name, recompute in SP_VARIANTS.items():
        objective = synthetic_objective(cfg, ObjectiveConfig(STEPS, 0.8, 1 << 27, recompute=recompute),
                                        torch.device("cpu"), torch.float32)
        objective.split_rows(sequence)
        measured[name] = dataclasses.asdict(measure_step(objective, sequence.slicer(batch), STEPS))
    if rank == 0:
        result.write_text(json.dumps(measured))
    dist.destroy_process_group()


def test_the_sequence_parallel_plan_matches_a_real_rank(tiny_cfg: DraftConfig, tmp_path: Path) -> None:
    """The plan of one rank of SP 2 (the exchanges modelled on meta, train/plan_ulysses.py) against
    rank 0 of a real 2-rank split on the CPU, measured alike (measure_step, which the test above
    checks against the allocator on one rank). Compared here through measure_step, not the
    allocator: on the CPU the collective backend allocates at times of its own, up to an exchange's
    size. The real rank's ids of each step are views of its cut (its positions + the 5 rows read
    ahead), the plan's of its positions: with recompute, checkpoint keeps them (5 more ids each)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = tmp_path / "rank0.json"
    mp.start_processes(_sequence_parallel_rank, args=(port, tiny_cfg, result), nprocs=2, start_method="spawn")
    measured = json.loads(result.read_text())
    for name, recompute in SP_VARIANTS.items():
        objective_cfg = ObjectiveConfig(STEPS, 0.8, 1 << 27, recompute=recompute)
        objective = meta_objective(tiny_cfg, objective_cfg, torch.float32)
        cores = install_attention_cores(objective, 2)
        batch = meta_batch(tiny_cfg, 1, T_CHECK // 2).map(lambda v: v.float() if v.is_floating_point() else v)
        planned = measure_step(objective, batch, STEPS, cores)
        real = measured[name]
        print(f"\nSP 2, T {T_CHECK}, {name}, rank 0: saved plan {planned.saved_bytes} vs {real['saved_bytes']} B, "
              f"peak plan {planned.peak_bytes} vs {real['peak_bytes']} B")
        assert real["saved_bytes"] > 0
        for figure in ("saved_bytes", "live_after_forward", "peak_bytes"):
            assert getattr(planned, figure) == pytest.approx(real[figure], rel=1e-3), (name, figure)


def test_the_attention_core_of_a_sequence_parallel_rank_sees_the_whole_row(tiny_cfg: DraftConfig) -> None:
    """What the core receives at SP 2: q, every key and value of the cache, all T positions of h / 2
    heads, and the row's segment ids."""
    T, sp = 512, 2
    objective = meta_objective(tiny_cfg, ObjectiveConfig(STEPS, 0.8, 1 << 27), torch.bfloat16)
    (core,) = install_attention_cores(objective, sp)
    seen: list[tuple[tuple[int, ...], ...]] = []
    inner = core.inner

    def observed(q, cache, scale, segment_ids):
        seen.append(tuple(tuple(t.shape[:3]) for t in (q, cache.k0, cache.v0, *cache.diag_k, *cache.diag_v)))
        assert tuple(segment_ids.shape) == (1, T)
        return inner(q, cache, scale, segment_ids)

    core.inner = observed
    step = measure_step(objective, meta_batch(tiny_cfg, 1, T // sp), STEPS, [core])
    heads = (1, T, tiny_cfg.num_attention_heads // sp)
    assert [len(shapes) for shapes in seen] == [3, 5, 7, 9]         # q, K0, V0 and each step's k, v
    assert all(shape == heads for shapes in seen for shape in shapes)
    assert 0 < step.attention_saved_bytes < step.saved_bytes


def test_sequence_parallel_groups_that_do_not_divide_are_refused(tiny_cfg: DraftConfig) -> None:
    """The trainer's refusals (train/sequence_parallel.py), naming the values."""
    with pytest.raises(PlanRefused, match=r"plan.world_size=6: .*train.sequence_parallel=4: .*the 6 rank"):
        memory_plan(tiny_cfg, dataclasses.replace(_spec(2, 6), sequence_parallel=4))
    heads = tiny_cfg.num_attention_heads
    with pytest.raises(PlanRefused, match=rf"train.sequence_parallel=8: .*the draft's {heads} attention heads"):
        memory_plan(tiny_cfg, dataclasses.replace(_spec(2, 8), sequence_parallel=8))
    with pytest.raises(SystemExit, match=r"python -m train plan: plan.world_size=8: .*train.sequence_parallel=3"):
        main(["plan.world_size=8", "train.sequence_parallel=3"], lambda _: None)


def test_the_sequence_parallel_plan_names_its_groups_and_zero_ranks(tmp_path: Path) -> None:
    printed: list[str] = []
    out = tmp_path / "plan.json"
    assert main(["train.max_len=512", "plan.world_size=8", "train.sequence_parallel=2", "--json", str(out)],
                printed.append) == 0
    assert "8 ranks = sequence parallel 2 x 4 data-parallel" in printed[0]
    assert "over all 8 ranks, 256 positions of each row per rank" in printed[0]
    spec = json.loads(out.read_text())["spec"]
    assert (spec["sequence_parallel"], spec["zero_ranks"], spec["data_parallel"]) == (2, 8, 4)
    # The cut carries the longest TTT chain (training's 4 steps, held-out 3) + 1 rows read ahead.
    assert (spec["tokens_per_rank"], spec["halo"]) == (256, 5)
