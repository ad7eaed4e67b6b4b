"""`python -m dump transcode`: a store re-encoded in other storage settings holds the same samples
within the destination's bound, resumes, and refuses to claim more than its source holds."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dump.transcode import TranscodeError, transcode
from config import compose_config
from model.verifier import verifier_dir
from model.verifier_weights import read_verifier_head
from store import StoreReader, StoreWriter, verifier_identity

CFG = compose_config("dump", [])
VDIR = verifier_dir(CFG.verifier)
H = 256
N_SAMPLES, T = 6, 48


def _samples() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = {}
    for i in range(N_SAMPLES):
        mask = torch.zeros(T, dtype=torch.bool)
        mask[T // 3:] = True   # a prompt, then an answer to the end
        out[f"s{i}"] = {"input_ids": torch.randint(0, 8192, (T,), generator=g), "loss_mask": mask,
                        "aux": torch.randn(T, 3, H, generator=g) * 4, "final": torch.randn(T, H, generator=g)}
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An fp32 store of kimi-tiny's identity (random states: the conversion does not care)."""
    path = tmp_path_factory.mktemp("transcode") / "fp32"
    storage = compose_config("dump", ["store=fp32"]).store
    with StoreWriter(path, verifier_identity(VDIR, CFG.verifier.name), list(CFG.verifier.aux_layer_ids),
                     storage, {"data": {"name": "test"}}, aux_convention="vllm",
                     aux_capture=str(CFG.verifier.aux_capture), rank=0, world_size=1) as writer:
        for sample_id, sample in _samples().items():
            assert writer.add(sample_id, **sample)
    return path


def test_lossless_and_compact_hold_the_same_samples(source: Path, tmp_path: Path) -> None:
    want = _samples()
    summary = transcode(source, tmp_path / "lossless", ["store=lossless"], progress=False)
    assert (summary["samples"], summary["tokens"]) == (N_SAMPLES, N_SAMPLES * T)
    lossless = StoreReader(tmp_path / "lossless")
    assert lossless.mode == "lossless" and lossless.meta["dump"]["transcoded_from"] == str(source)
    for ref in lossless.samples():
        got, x = lossless.read_sample(ref), want[ref.sample_id]
        assert torch.equal(got.input_ids, x["input_ids"]) and torch.equal(got.loss_mask, x["loss_mask"])
        assert torch.equal(got.aux, x["aux"].bfloat16())
        rows = torch.zeros(T, dtype=torch.bool)
        rows[:-1] = x["loss_mask"][1:]
        assert torch.equal(got.final[rows], x["final"][rows].bfloat16())

    transcode(source, tmp_path / "compact", ["store=compact"], progress=False)
    compact = StoreReader(tmp_path / "compact")
    head = read_verifier_head(VDIR, torch.float32).lm_head
    for ref in compact.samples():
        got, x = compact.read_sample(ref, torch.float32), want[ref.sample_id]
        assert got.final is None and got.target_ids.shape == (T, compact.topk)
        rows = got.target_ids[:, 0] >= 0
        top = torch.log_softmax(x["final"][rows] @ head.T, -1).topk(compact.topk, -1)
        assert torch.equal(got.target_ids[rows], top.indices)
        amax = x["aux"].reshape(T, 3, -1, 32).abs().amax(-1, keepdim=True) * (1 + 2**-7) / 6
        scale = amax.expand(-1, -1, -1, 32).reshape(T, 3, H)
        assert ((got.aux - x["aux"]).abs() <= torch.maximum(scale, x["aux"].abs()) / 4 * (1 + 1e-6)).all()


def test_resumes_without_writing_twice(source: Path, tmp_path: Path) -> None:
    transcode(source, tmp_path / "fp8", ["store=fp8"], progress=False)
    again = transcode(source, tmp_path / "fp8", ["store=fp8"], progress=False)
    assert (again["samples"], again["samples_done_earlier"]) == (0, N_SAMPLES)
    assert len(StoreReader(tmp_path / "fp8")) == N_SAMPLES


def test_refuses_what_the_source_does_not_hold(source: Path, tmp_path: Path) -> None:
    transcode(source, tmp_path / "compact", ["store=compact"], progress=False)
    with pytest.raises(TranscodeError, match="top-32 targets only: it cannot give final bf16"):
        transcode(tmp_path / "compact", tmp_path / "back", ["store=fp4"], progress=False)
    with pytest.raises(TranscodeError, match="aux states as fp4: it cannot give fp8"):
        transcode(tmp_path / "compact", tmp_path / "back", ["store=compact", "store.aux=fp8"], progress=False)
    transcode(source, tmp_path / "lossless", ["store=lossless"], progress=False)
    with pytest.raises(TranscodeError, match="target rows only: it cannot give final_rows all"):
        transcode(tmp_path / "lossless", tmp_path / "all", ["store=lossless", "store.final_rows=all"],
                  progress=False)
    assert not (tmp_path / "back").exists() and not (tmp_path / "all").exists()   # refused before writing


def test_the_command_prints_its_summary(source: Path, tmp_path: Path) -> None:
    """`python -m dump transcode SRC DST store=lossless` itself: it exits 0 and prints its summary
    as JSON, bytes per token a number."""
    import json
    import subprocess
    import sys

    from infra import REPO_ROOT

    done = subprocess.run([sys.executable, "-m", "dump", "transcode", str(source), str(tmp_path / "lossless"),
                           "store=lossless"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["samples"] == N_SAMPLES and summary["bytes_per_token"] > 0
