"""Shared fixtures: the real configs, the shipped kimi-tiny verifier, one vLLM engine per session."""
from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import DictConfig

import infra
from infra import compose_config
from model.verifier import verifier_dir

# Before any test module imports transformers or vLLM (none of the imports above does).
infra.configure_environment()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need a CUDA device; without one they are skipped, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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

    cfg = compose_config("dump")
    llm = start_capture_engine(kimi_tiny_dir, cpu_engine_cfg, capture_spec(cfg.verifier), int(cfg.max_len))
    yield llm
    shutdown_llm(llm)
    del llm
    gc.collect()


@pytest.fixture(scope="session")
def draft_verifier_dir(kimi_tiny_dir: Path) -> Path:
    """The verifier folder the draft tests build against: the shipped kimi-tiny."""
    return kimi_tiny_dir


# ---- stage 2 (train/) -----------------------------------------------------------------------
TRAIN_STORE_SAMPLES = 24      # ShareGPT conversations in the test store
TRAIN_STORE_MAX_LEN = 256     # tokens per sample


def write_verifier_store(path: Path, verifier_path: Path, samples: int, max_len: int) -> Path:
    """A real store without vLLM: `samples` ShareGPT train conversations through the verifier with
    transformers (fp32), hidden_states[k] for the aux ids (vLLM convention: the state entering
    layer k) and hidden_states[-1] (DeepseekV3's post-norm final state), written by StoreWriter."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    from data.conversations import load_conversations
    from data.template import SampleRejected, tokenize_conversation
    from store import StoreWriter, verifier_identity

    cfg = compose_config("dump")
    tokenizer = AutoTokenizer.from_pretrained(verifier_path)
    verifier = DeepseekV3ForCausalLM.from_pretrained(verifier_path, dtype=torch.float32).eval()
    aux_ids = list(cfg.verifier.aux_layer_ids)
    data = {**cfg.data, "max_samples": None}
    writer = StoreWriter(path, verifier_identity(verifier_path, cfg.verifier.name), aux_ids, cfg.store,
                         {"data": {"format": cfg.data.format}}, aux_convention=cfg.verifier.aux_convention,
                         rank=0, world_size=1)
    written = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 cores shared with other jobs: two OpenMP threads wait on each other
    with writer, torch.no_grad():
        for conv in load_conversations(data, "train"):
            try:
                sample = tokenize_conversation(tokenizer, conv, max_len, "truncate")
            except SampleRejected:
                continue
            ids = torch.from_numpy(sample.input_ids).long()
            states = verifier(ids[None], output_hidden_states=True).hidden_states
            aux = torch.stack([states[k][0] for k in aux_ids], dim=1)         # [T, n_aux, H]
            writer.add(sample.id, ids, torch.from_numpy(sample.loss_mask), aux, states[-1][0])
            written += 1
            if written == samples:
                break
    torch.set_num_threads(threads)
    return path


@pytest.fixture(scope="session")
def train_store(draft_verifier_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real store for the trainer tests (24 conversations of at most 256 tokens)."""
    path = tmp_path_factory.mktemp("train_store") / "store"
    return write_verifier_store(path, draft_verifier_dir, TRAIN_STORE_SAMPLES, TRAIN_STORE_MAX_LEN)
