"""Shared fixtures: the real configs, the shipped kimi-tiny verifier, one vLLM engine per session."""
from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from omegaconf import DictConfig

import infra
from config import compose_config
from model.verifier import verifier_dir

# Before any test module imports transformers or vLLM (none of the imports above does).
infra.configure_environment()


def _give_this_worker_its_share_of_threads() -> None:
    """Under `make test`'s N pytest workers, each worker, and every engine worker, trainer rank and
    `python -m` process it starts, computes on 1/N of the cores' worth of OpenMP threads, and vLLM
    leaves the threads unbound. Left alone, every such process spins one OpenMP thread per core of
    the machine and vLLM binds its worker's threads to every core: two workers' processes then
    hold more busy threads than there are cores, and OpenMP threads that lose their core wait on
    each other, far longer than the two workers' share of the cores explains. Unbound, the
    processes of a test that runs alone at the end still spread over every core."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if "PYTEST_XDIST_WORKER" not in os.environ or count < 2:
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // count))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


_give_this_worker_its_share_of_threads()    # before torch is imported: it reads OMP_NUM_THREADS once

# `make test` runs several pytest workers, each with its engines, beside the engines the tests' own
# `python -m dump` processes start: 1 GiB of KV cache each (conf/engine/cpu.yaml reads vLLM's
# variable) holds every sequence kimi-tiny's tests decode at once, where the default 4 would
# overcommit this 24 GiB machine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# A pytest process hosts many engines, one test's beside another's: each in vLLM's own processes
# (conf/engine/cpu.yaml's in_process yields to vLLM's variable, dump/engine.py runs_in_process), so
# that one shutting down does not take the process-wide distributed groups of another. Tests that
# want an in-process engine say so (in_process_vllm, in_process_dump_env).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need a CUDA device; without one they are skipped, saying so. Modules with a
    `slow` test run first, each kept whole so that its module fixtures start once: with several
    workers (`make test`) the long tests then run beside the short ones, not alone at the end."""
    import torch

    slow = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow)    # stable: the order within a module stays
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def env_without_rendezvous() -> dict[str, str]:
    """This process's environment for a child that trains: without the rendezvous variables an
    in-process training of this module set (their MASTER_PORT is still held: the child picks its own)."""
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}


@pytest.fixture(scope="module", autouse=True)
def no_process_group_outlives_its_module() -> Iterator[None]:
    """A module that trains in-process (train.distributed.init_distributed) leaves a process group,
    DeepSpeed's cached clones of it and the rendezvous variables in the worker's process; the next
    module in that worker is whichever xdist hands it. An in-process vLLM engine there destroys
    the group under DeepSpeed's clones (the next training fails with "Group ... is not
    registered"), and a training subprocess inherits a MASTER_PORT still held. So each module
    leaves the process as it found it."""
    saved = {name: os.environ.get(name) for name in RENDEZVOUS_VARIABLES}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        import deepspeed.comm

        if deepspeed.comm.is_initialized():
            deepspeed.comm.destroy_process_group()    # also drops DeepSpeed's clones of the group
        else:
            dist.destroy_process_group()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def kimi_tiny_cfg() -> DictConfig:
    return compose_config("build_verifier").verifier


@pytest.fixture(scope="session")
def kimi_tiny_dir(kimi_tiny_cfg: DictConfig) -> Path:
    path = verifier_dir(kimi_tiny_cfg)
    assert (path / "config.json").exists(), f"{path} is missing: run `make verifier`"
    return path


@pytest.fixture(scope="session")
def cpu_engine_cfg() -> DictConfig:
    return compose_config("dump").engine


@pytest.fixture(scope="session")
def verifier_llm(kimi_tiny_dir: Path, cpu_engine_cfg: DictConfig) -> Iterator[object]:
    """One vLLM capture engine on kimi-tiny (fp32, CPU, eager) shared by the tests that decode or
    capture: the engine `make dump` starts (dump.capture.start_capture_engine)."""
    from dump.capture import capture_spec, start_capture_engine
    from dump.engine import shutdown_llm
    from model.verifier_handle import Verifier

    cfg = compose_config("dump")
    spec = capture_spec(Verifier.from_conf(cfg.verifier))
    llm = start_capture_engine(kimi_tiny_dir, cpu_engine_cfg, spec, int(cfg.max_len), trust_remote_code=False)
    yield llm
    shutdown_llm(llm)
    del llm
    gc.collect()


def _torch_threads(worker) -> int:
    import torch

    return torch.get_num_threads()


@pytest.fixture(scope="session")
def in_process_dump_env(verifier_llm) -> dict[str, str]:
    """The environment of a `python -m dump` whose engine core runs in the dump process (a SIGKILL
    then leaves no engine process behind), on as many torch threads as the shared engine's worker:
    vLLM gives its worker one thread per physical core it binds (1 on a 2-vCPU machine with SMT,
    2 on 2 cores without), an in-process engine core 1 unless OMP_NUM_THREADS says otherwise, and
    fp32 matmuls on 1 and 2 threads may differ in their last bits (they do with AMX). A store
    dumped this way then equals, bit for bit, one of the shared engine on any of these CPUs."""
    threads = set(verifier_llm.collective_rpc(_torch_threads))
    assert len(threads) == 1, threads
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(threads.pop())}


@contextmanager
def in_process_vllm() -> Iterator[None]:
    """Engines started inside run their engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0):
    no engine-core and worker processes to spawn (each re-imports torch and vLLM: a multiprocess
    engine takes several times as long to start on 2 cores), and forward hooks share this process's
    memory. Undoes what such an engine leaves behind afterwards."""
    import torch
    import vllm.envs as envs

    saved_env = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    envs.disable_envs_cache()   # an in-process engine caches vLLM's env vars for the whole process
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        envs.disable_envs_cache()
        if saved_env is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved_env
        # vLLM's CPU worker lowers the torch threads and replaces torch.set_num_threads by a no-op.
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def draft_verifier_dir(kimi_tiny_dir: Path) -> Path:
    """The verifier folder the draft tests build against: the shipped kimi-tiny."""
    return kimi_tiny_dir


# ---- stage 2 (train/) -----------------------------------------------------------------------
TRAIN_STORE_SAMPLES = 24      # ShareGPT conversations in the test store
TRAIN_STORE_MAX_LEN = 256     # tokens per sample


def write_verifier_store(path: Path, samples: int, max_len: int) -> Path:
    """A real store without vLLM (bench/reference_store.py): `samples` ShareGPT train conversations
    through kimi-tiny with transformers."""
    from bench.reference_store import write_reference_store

    write_reference_store(path, samples, max_len)
    return path


@pytest.fixture(scope="session")
def train_store(draft_verifier_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real store for the trainer tests (24 conversations of at most 256 tokens)."""
    path = tmp_path_factory.mktemp("train_store") / "store"
    return write_verifier_store(path, TRAIN_STORE_SAMPLES, TRAIN_STORE_MAX_LEN)


# ---- the fault-injection suite --------------------------------------------------------------
def fault_points() -> int:
    """How many kill points each fault test tries: FAULTS_N (`make faults N=...`), else a number
    that keeps `make test` within its time."""
    import os

    return int(os.environ.get("FAULTS_N", "3"))


def plain_layer(cfg):
    """A DraftConfig with vLLM's optional switches, the trainable final norm and the trainable
    lm_head off: the plain EAGLE-3 layer, for tests of contracts that predate the switches
    (tests/test_draft_flags.py covers them; conf/draft/kimi_tiny.yaml turns them on)."""
    import dataclasses

    return dataclasses.replace(cfg, fc_norm=False, norm_before_residual=False, norm_output=False, train_norm=False,
                               train_head=False)


def assert_same_objective_runs(results, loss_tol: float, grad_rtol: float, grad_atol: float) -> None:
    """Two (ObjectiveOutput, {name: grad}) of the same batch and draft that must train alike: same
    counted positions (and enough of them), loss within loss_tol, same top-1 agreement and chains,
    gradients within grad_rtol / grad_atol."""
    import torch

    (a, ga), (b, gb) = results
    assert a.stats.count[0] > 10 and a.stats.count.tolist() == b.stats.count.tolist()
    torch.testing.assert_close(b.loss, a.loss, rtol=loss_tol, atol=loss_tol)
    assert a.stats.correct.tolist() == b.stats.correct.tolist() and a.stats.chain.tolist() == b.stats.chain.tolist()
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=grad_rtol, atol=grad_atol)
