"""The one place a vLLM engine is built from config (verifier folder + conf/engine/*)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


def engine_kwargs(engine: DictConfig) -> dict[str, Any]:
    """LLM(...) keyword arguments from an engine config; None values are left to vLLM."""
    kwargs: dict[str, Any] = {
        "dtype": engine.dtype,
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


def make_llm(model_dir: Path, engine: DictConfig, **extra: Any):
    """A vLLM engine on model_dir; `extra` adds or overrides keyword arguments
    (speculative_config, max_model_len, ...)."""
    if engine.kv_cache_space_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(engine.kv_cache_space_gib)
    # dump/capture.py ships its hook functions to the workers through collective_rpc, which
    # vLLM serialises with cloudpickle only with this consent.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM  # imported late: it is heavy, and only stage 1 and evaluation need it

    return LLM(model=str(model_dir), tokenizer=str(model_dir), **{**engine_kwargs(engine), **extra})


def shutdown_llm(llm) -> None:
    """Stop the engine's worker process now; a teardown left to interpreter exit can abort it."""
    llm.llm_engine.engine_core.shutdown()
