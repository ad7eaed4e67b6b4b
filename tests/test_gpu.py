"""GPU readiness: the draft and the chunked loss on CUDA against the CPU (`gpu` tests, skipped
without a CUDA device), vLLM's CPU-only kernel patch kept off other platforms, and the GPU
benchmark's smoke mode (with only the packages `make bench-gpu` says it needs) and FLOP count on
the CPU.

`pytest -m gpu` runs in the project's environment (`make setup GPU=1`): collecting the suite
imports every test module, and this one imports the trainer (train/objective.py, train/plan.py).
`make bench-gpu` alone needs only PyTorch, hydra-core and omegaconf."""
from __future__ import annotations

import dataclasses

import copy
import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from infra import REPO_ROOT
from tests.conftest import plain_layer
from model.batch import Batch, RowSample, collate_rows, pack_row
from config import compose_config, compose_draft_conf
from model.draft import DraftConfig
from train.objective import Eagle3Objective, ObjectiveConfig
from train.soft_ce import soft_cross_entropy
from train.plan import measure_step, meta_batch, meta_objective

# bf16 keeps 8 mantissa bits: through the draft layer and TTT steps the gradients of a bf16 run
# differ from fp32 by about 1% in norm (measured on the CPU); 5% leaves room for CUDA's kernels.
BF16_GRAD_RTOL = 0.05
BF16_LOSS_RTOL = 0.01


@pytest.fixture(scope="module")
def tiny_cfg() -> DraftConfig:
    return plain_layer(DraftConfig.from_conf(compose_draft_conf("kimi_tiny")))


def _objective(cfg: DraftConfig, steps: int = 4, chunk_bytes: int = 1 << 20) -> Eagle3Objective:
    """Random layer and random verifier tensors of kimi-tiny's shapes, fp32 on the CPU."""
    from bench.gpu_train import synthetic_objective

    return synthetic_objective(cfg, ObjectiveConfig(steps, 0.8, chunk_bytes), torch.device("cpu"), torch.float32)


def _packed_batch(cfg: DraftConfig, lengths: tuple[int, ...] = (40, 24), seed: int = 0) -> Batch:
    """One row of packed samples, about 70% of the tokens assistant-written."""
    g = torch.Generator().manual_seed(seed)
    H = cfg.target_hidden_size
    samples = [RowSample(torch.randint(0, cfg.vocab_size, (n,), generator=g), torch.rand(n, generator=g) < 0.7,
                         torch.randn(n, cfg.num_aux, H, generator=g), torch.randn(n, H, generator=g))
               for n in lengths]
    return collate_rows([pack_row(samples, sum(lengths))])


def _loss_and_grads(objective: Eagle3Objective, batch: Batch) -> tuple[float, dict[str, torch.Tensor]]:
    objective.zero_grad(set_to_none=True)
    out = objective(batch)
    out.loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in objective.named_parameters() if p.requires_grad}
    return out.loss.item(), grads


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float().cpu() - want).norm() / want.norm()).item()


# ---- on CUDA ------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_ttt_forward_backward_in_bf16_on_cuda_matches_fp32_on_cpu(tiny_cfg: DraftConfig) -> None:
    cpu = _objective(tiny_cfg)
    batch = _packed_batch(tiny_cfg)
    want_loss, want_grads = _loss_and_grads(cpu, batch)

    cuda = copy.deepcopy(cpu).to("cuda", torch.bfloat16)
    cuda.cast_buffers(torch.bfloat16)
    cuda_batch = batch.map(lambda v: (v.bfloat16() if v.is_floating_point() else v).cuda())
    loss, grads = _loss_and_grads(cuda, cuda_batch)

    assert loss == pytest.approx(want_loss, rel=BF16_LOSS_RTOL)
    errors = {name: _relative_error(grads[name], want) for name, want in want_grads.items()}
    assert max(errors.values()) < BF16_GRAD_RTOL, errors


@pytest.mark.gpu
def test_the_loader_pins_its_batches(tiny_cfg: DraftConfig) -> None:
    """make_loader's DataLoader (collate_rows, pin_memory on CUDA) hands over pinned batches, so
    the trainer's non-blocking copies to the GPU are asynchronous."""
    from torch.utils.data import DataLoader

    H = tiny_cfg.target_hidden_size
    rows = [pack_row([RowSample(torch.arange(n), torch.ones(n, dtype=torch.bool), torch.randn(n, tiny_cfg.num_aux, H),
                                torch.randn(n, H))], n) for n in (12, 7)]
    batch = next(iter(DataLoader(rows, batch_size=2, collate_fn=collate_rows, pin_memory=True)))
    assert isinstance(batch, Batch) and all(t.is_pinned() for t in batch.tensors().values())


@pytest.mark.gpu
def test_chunked_loss_on_cuda_matches_the_cpu() -> None:
    """Several chunks (37 rows each) over 200 rows, against the CPU in fp32: fp32 on CUDA to
    rounding, bf16 on CUDA within bf16's tolerance."""
    g = torch.Generator().manual_seed(0)
    N, H, V, chunk = 200, 64, 1000, 37
    normed = torch.randn(N, H, generator=g)
    head = torch.randn(V, H, generator=g) / H**0.5
    target_hidden = torch.randn(N, H, generator=g)
    target_head = torch.randn(V, H, generator=g) / H**0.5

    def run(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = normed.to(device, dtype, copy=True).requires_grad_()
        loss, agree = soft_cross_entropy(x, head.to(device, dtype), target_hidden.to(device, dtype),
                                         target_head.to(device, dtype), None, chunk)
        loss.backward()
        return loss.cpu(), agree.cpu(), x.grad.float().cpu()

    want_loss, want_agree, want_grad = run("cpu", torch.float32)
    loss, agree, grad = run("cuda", torch.float32)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    assert torch.equal(agree, want_agree)
    assert _relative_error(grad, want_grad) < 1e-4
    loss, agree, grad = run("cuda", torch.bfloat16)
    assert loss.item() == pytest.approx(want_loss.item(), rel=BF16_LOSS_RTOL)
    assert (agree == want_agree).float().mean() > 0.9      # bf16 may flip near-tied argmaxes
    assert _relative_error(grad, want_grad) < BF16_GRAD_RTOL


@pytest.mark.gpu
def test_plan_of_a_step_against_cuda_memory(tiny_cfg: DraftConfig) -> None:
    """The meta-device plan of one micro-step (forward/backward peak) against what CUDA's
    allocator saw for the same step in bf16."""
    T = 1024
    objective_cfg = ObjectiveConfig(4, 0.8, 1 << 27)
    plan = measure_step(meta_objective(tiny_cfg, objective_cfg, torch.bfloat16), meta_batch(tiny_cfg, 1, T), 4)

    cuda = _objective(tiny_cfg, chunk_bytes=objective_cfg.chunk_bytes).to("cuda", torch.bfloat16)
    cuda.cast_buffers(torch.bfloat16)
    batch = meta_batch(tiny_cfg, 1, T, device="cpu").to("cuda")
    measure_step(cuda, batch, 4)                       # warm-up: cuBLAS workspaces, kernels
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    measure_step(cuda, batch, 4)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    print(f"\nplan {plan.peak_bytes / 2**20:.1f} MiB, CUDA {measured / 2**20:.1f} MiB, "
          f"ratio {plan.peak_bytes / measured:.3f}")
    assert 0.9 <= plan.peak_bytes / measured <= 1.25


@pytest.mark.gpu
def test_expand_patch_stays_off_on_this_gpu_platform() -> None:
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from evaluation.speculative import _patch_expand

    assert not current_platform.is_cpu()
    assert _patch_expand(None) is False


# ---- on the CPU ----------------------------------------------------------------------------------
def test_expand_patch_is_a_no_op_off_vllms_cpu_platform() -> None:
    """Off vLLM's CPU platform the worker function returns False without probing or registering
    anything. In this (non-worker) process the probe itself cannot run (vLLM's launcher raises),
    so returning False without an error also shows the probe was not called."""
    pytest.importorskip("vllm")
    from vllm.platforms.interface import UnspecifiedPlatform
    from vllm.triton_utils import dispatcher

    from evaluation.speculative import patch_expand_kernel

    platform = UnspecifiedPlatform()
    assert not platform.is_cpu()
    registered = dict(dispatcher._registry)
    assert patch_expand_kernel(platform) is False
    assert dispatcher._registry == registered


# What `make bench-gpu` needs (the Makefile and bench/gpu_train.py say so): PyTorch, hydra-core and
# omegaconf, each with its own requirements; nothing else of the project's environment.
BENCH_GPU_NEEDS = ("torch", "hydra-core", "omegaconf")
# Run as if only those were installed: every other distribution's modules unimportable (None in
# sys.modules: `import` raises ImportError, importlib.util.find_spec answers None, as for a module
# that is not there). Then the benchmark as `python -m bench.gpu_train` runs it, and what its GPU
# run does before the first CUDA call: the Kimi-K2 config, draft config and memory plan.
_BARE_RUN = """
import json, runpy, sys
sys.modules.update(dict.fromkeys(json.loads(sys.argv.pop(1))))
runpy.run_module("bench.gpu_train", run_name="__main__", alter_sys=True)
import bench.gpu_train as bench
from config import compose_config
from model.draft import DraftConfig
cfg = compose_config("train", bench.KIMI_K2)
draft = DraftConfig.from_conf(cfg.draft)
plan = bench.plan_for(cfg, draft, int(cfg.train.max_len), 0)
print(f"Kimi-K2 plan: {plan.total_bytes} bytes, bf16 lm_head {2 * draft.vocab_size * draft.hidden_size} bytes")
"""


def _distribution_key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_closure(names: tuple[str, ...]) -> set[str]:
    """The installed distributions `names` need, theirs included (extras and other platforms' not)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if _distribution_key(name) in seen:
            continue
        seen.add(_distribution_key(name))
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _modules_bench_gpu_may_not_use() -> list[str]:
    """Top-level modules of every installed distribution outside BENCH_GPU_NEEDS' closure and the
    project itself."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["name"]
    allowed = _requirement_closure(BENCH_GPU_NEEDS) | {_distribution_key(project)}
    return sorted(module for module, dists in metadata.packages_distributions().items()
                  if module.isidentifier() and not any(_distribution_key(d) in allowed for d in dists))


def test_gpu_benchmark_smoke_mode_runs_on_the_cpu_with_only_torch_hydra_and_omegaconf(tmp_path: Path) -> None:
    blocked = _modules_bench_gpu_may_not_use()
    # The store's stack among them (train.objective once pulled it in through store.encoding).
    assert {"zarr", "numcodecs", "crc32c", "deepspeed", "vllm", "transformers", "safetensors"} <= set(blocked)
    assert not {"torch", "hydra", "omegaconf"} & set(blocked)
    out = tmp_path / "gpu_train.json"
    run = subprocess.run([sys.executable, "-c", _BARE_RUN, json.dumps(blocked), "--smoke", "--out", str(out)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "total (peak)" in run.stdout and "tokens/s" in run.stdout
    total, head = map(int, re.search(r"Kimi-K2 plan: (\d+) bytes, bf16 lm_head (\d+) bytes", run.stdout).groups())
    assert total > head > 0                        # the plan holds at least the verifier's lm_head
    report = json.loads(out.read_text())
    assert report["torch"] == torch.__version__ and "bench.gpu_train --smoke" in report["command"]
    [attempt] = report["attempts"]
    assert attempt["outcome"] == "ok" and attempt["max_len"] == 128
    assert attempt["tokens_per_step"] == 128 and attempt["tokens_per_s"] > 0
    assert all(torch.isfinite(torch.tensor(attempt["losses"])))
    assert attempt["losses"][-1] < attempt["losses"][0]            # the optimizer step moved the draft
    assert attempt["plan"]["total_bytes"] > attempt["plan"]["step"]["peak_bytes"] > 0


def test_executed_flops_match_torchs_flop_counter(tiny_cfg: DraftConfig) -> None:
    """The benchmark's FLOP formula, in its executed variant, against torch's own count of the
    matmuls of one forward + backward (packed row, several loss chunks, TTT 4)."""
    from bench.gpu_train import model_flops

    cfg = dataclasses.replace(tiny_cfg, attention="ttt_blocked")      # the kernel a GPU runs
    objective = _objective(cfg)
    batch = _packed_batch(cfg)
    # The attention backward accumulates dk, dv with in-place baddbmm_, which FlopCounterMode's
    # table leaves out (it has the out-of-place baddbmm): counted as the batched matmul it runs.
    counter = FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten.baddbmm_: lambda _, a, b, *rest, out_shape=None, **kw: flop_counter.bmm_flop(a, b)})
    with counter:
        objective(batch).loss.backward()
    assert model_flops(objective.draft, batch, 4, executed=True) == counter.get_total_flops()
    assert model_flops(objective.draft, batch, 4) < counter.get_total_flops()
