"""Bad input through the real dump: a JSONL file holding every kind of bad record we know of, mixed
with good ones, read by `run_dump` on the shared vLLM engine into a real store. Under
data.on_error=skip the good records are stored and every bad one is named by file:line; under
data.on_error=raise the first bad record stops the dump before an engine starts."""
from __future__ import annotations

import collections
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from data.conversations import Conversation, Message, RecordError
from data.records import Origin
from data.rejection import Rejection, RejectionKind
from data.template import SampleRejected, tokenize_conversation
from dump.capture import CapturedSample, HiddenStateCapture
from config import compose_config
from store import StoreReader, inspect_store

MAX_LEN = 256
NAN_MARK = "poison-nan"  # the capture of a prompt holding it gets a NaN aux state
INF_MARK = "poison-inf"  # and of one holding this an inf final state
Q, A = ("user", "What is two plus two?"), ("assistant", "Four.")
ANSWER = {"role": "assistant", "content": "Four."}


def chat(*turns: tuple[Any, Any], **fields: Any) -> dict[str, Any]:
    return {**fields, "messages": [{"role": role, "content": content} for role, content in turns]}


@dataclass(frozen=True)
class Line:
    """One line of the input file and what the dump must make of it."""

    kind: str
    record: Any                  # a JSON value, or bytes written as they are
    sample: str | None = None    # the id it is stored (or rejected) under
    skipped: str | None = None   # the reason the reader skips it for
    rejected: str | None = None  # the kind of rejection the store records for it


LINES = [
    Line("good", chat(Q, A, id="good-1"), sample="good-1"),
    Line("good, no id: the fallback id is <file stem>:<line>", chat(Q, A), sample="mixed:2"),
    Line("good, integer id", chat(Q, A, id=42), sample="42"),
    Line("good, system turn first", chat(("system", "Be brief."), Q, A, id="good-sys"), sample="good-sys"),
    Line("good, non-ASCII UTF-8", chat(("user", "Café ☕ ou thé ?"), ("assistant", "Thé."), id="good-utf8"),
         sample="good-utf8"),
    Line("good, first of an id given twice", chat(("user", "first of dup-2"), A, id="dup-2"), sample="dup-2"),
    Line("good, first of an id given three times", chat(("user", "first of dup-3"), A, id="dup-3"),
         sample="dup-3"),
    Line("blank line (not a record)", b"   "),
    Line("bad json", b'{"id": "bad-json", "messages": [{"role": "user", "content": "Hi"}', skipped="bad json"),
    Line("two records on one line", (json.dumps(chat(Q, A, id="two-a")) + " "
                                     + json.dumps(chat(Q, A, id="two-b"))).encode(), skipped="bad json"),
    Line("bytes that are not UTF-8", b'{"id": "latin-1", "messages": [{"role": "user", "content": "caf\xe9?"}, '
                                     b'{"role": "assistant", "content": "Oui."}]}', skipped="bad json"),
    Line("record is a list", [Q, A], skipped="wrong nesting"),
    Line("record is a string", "What is two plus two?", skipped="wrong nesting"),
    Line("record is a number", 4, skipped="wrong nesting"),
    Line("record is null", None, skipped="wrong nesting"),
    Line("id is a boolean", chat(Q, A, id=True), skipped="bad id"),
    Line("id is a float", chat(Q, A, id=1.5), skipped="bad id"),
    Line("id is a list", chat(Q, A, id=["id", 1]), skipped="bad id"),
    Line("id is an object", chat(Q, A, id={"n": 1}), skipped="bad id"),
    Line("id is empty", chat(Q, A, id=""), skipped="bad id"),
    Line("messages missing", {"id": "no-messages", "conversation": chat(Q, A)["messages"]},
         sample="no-messages", skipped="wrong nesting"),
    Line("messages is a string", {"id": "messages-str", "messages": "Hi"}, sample="messages-str",
         skipped="wrong nesting"),
    Line("messages is an object", {"id": "messages-obj", "messages": {"role": "user", "content": "Hi"}},
         sample="messages-obj", skipped="wrong nesting"),
    Line("turn is not an object", {"id": "turn-str", "messages": ["Hi", ANSWER]}, sample="turn-str",
         skipped="wrong nesting"),
    Line("turn without a role", {"id": "no-role", "messages": [{"content": "Hi"}, ANSWER]}, sample="no-role",
         skipped="wrong nesting"),
    Line("turn without content", {"id": "no-content", "messages": [{"role": "user"}, ANSWER]},
         sample="no-content", skipped="wrong nesting"),
    Line("unknown role", chat(Q, ("tool", '{"sum": 4}'), A, id="role-tool"), sample="role-tool",
         skipped="unknown role"),
    Line("role is not a string", chat((1, "Hi"), A, id="role-number"), sample="role-number",
         skipped="unknown role"),
    Line("content is a number", chat(("user", 4), A, id="content-number"), sample="content-number",
         skipped="content not a string"),
    Line("content is null", chat(Q, ("assistant", None), id="content-null"), sample="content-null",
         skipped="content not a string"),
    Line("content is a list of parts", chat(("user", [{"type": "text", "text": "Hi"}]), A, id="content-parts"),
         sample="content-parts", skipped="content not a string"),
    Line("content is empty", chat(("user", ""), A, id="content-empty"), sample="content-empty",
         skipped="empty content"),
    Line("content is whitespace", chat(Q, ("assistant", " \n\t "), id="content-blank"), sample="content-blank",
         skipped="empty content"),
    Line("no turns", {"id": "no-turns", "messages": []}, sample="no-turns", skipped="no assistant turn"),
    Line("first turn is the assistant's", chat(A, Q, A, id="assistant-first"), sample="assistant-first",
         skipped="first turn not user"),
    Line("turns do not alternate", chat(Q, Q, A, id="user-twice"), sample="user-twice",
         skipped="turns do not alternate"),
    Line("system turn in the middle", chat(Q, A, ("system", "Be rude."), Q, A, id="system-middle"),
         sample="system-middle", skipped="turns do not alternate"),
    Line("no assistant turn", chat(Q, id="no-answer"), sample="no-answer", skipped="no assistant turn"),
    Line("id given twice", chat(("user", "second of dup-2"), A, id="dup-2"), sample="dup-2", skipped="duplicate id"),
    Line("id given three times: second", chat(("user", "second of dup-3"), A, id="dup-3"), sample="dup-3",
         skipped="duplicate id"),
    Line("id given three times: third", chat(("user", "third of dup-3"), A, id="dup-3"), sample="dup-3",
         skipped="duplicate id"),
    Line("id that another record has as its fallback id", chat(Q, A, id="mixed:2"), sample="mixed:2",
         skipped="duplicate id"),
    Line("over-long under over_long=drop", chat(("user", "count the words " * 120), A, id="over-long"),
         sample="over-long", rejected="over-long"),
    Line("NaN in the captured aux states", chat(("user", f"Say {NAN_MARK}."), A, id="nan-aux"), sample="nan-aux",
         rejected="non-finite hidden states"),
    Line("inf in the captured final states", chat(("user", f"Say {INF_MARK}."), A, id="inf-final"),
         sample="inf-final", rejected="non-finite hidden states"),
    Line("good, after every bad one", chat(Q, A, id="good-last"), sample="good-last"),
]
FIRST_OF = {"dup-2": 6, "dup-3": 7, "mixed:2": 2}  # line that keeps each duplicated id


def numbered(lines: Sequence[Line], wanted: Callable[[Line], bool]) -> list[tuple[int, Line]]:
    return [(number, line) for number, line in enumerate(lines, start=1) if wanted(line)]


def kept(line: Line) -> bool:
    return line.sample is not None and line.skipped is None and line.rejected is None


def write_lines(path: Path, lines: Sequence[Line]) -> Path:
    with path.open("wb") as f:
        for line in lines:
            raw = line.record if isinstance(line.record, bytes) else json.dumps(line.record).encode()
            f.write(raw + b"\n")
    return path


def dump_config(data: Path, out: Path, on_error: str) -> DictConfig:
    return compose_config("dump", [
        "data=jsonl", f"data.path={data}", f"data.on_error={on_error}", f"output_dir={out}",
        "split=all", f"max_len={MAX_LEN}", "over_long=drop", "batch_size=8", "regenerate.enabled=false"])


def poisoning(real: Callable, tokenizer: PreTrainedTokenizerBase) -> Callable:
    """HiddenStateCapture.capture that runs the real one, then spoils the states of marked prompts."""

    def capture(self: HiddenStateCapture, prompts: Sequence[Sequence[int]]) -> list[CapturedSample]:
        samples = real(self, prompts)
        for prompt, states in zip(prompts, samples):
            text = tokenizer.decode([int(t) for t in prompt])
            if NAN_MARK in text:
                states.aux[0, 0, 0] = float("nan")
            if INF_MARK in text:
                states.final[-1, -1] = float("inf")
        return samples

    return capture


@dataclass(frozen=True)
class SkipRun:
    summary: dict[str, Any]
    store: Path


@pytest.fixture(scope="module")
def skip_run(tmp_path_factory: pytest.TempPathFactory, verifier_llm: object, kimi_tiny_dir: Path) -> SkipRun:
    from dump.pipeline import run_dump

    folder = tmp_path_factory.mktemp("bad_input")
    data = write_lines(folder / "mixed.jsonl", LINES)
    cfg = dump_config(data, folder / "store", "skip")
    tokenizer = AutoTokenizer.from_pretrained(kimi_tiny_dir)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HiddenStateCapture, "capture", poisoning(HiddenStateCapture.capture, tokenizer))
        summary = run_dump(cfg, llm=verifier_llm)
    return SkipRun(summary, folder / "store")


def test_the_mix_covers_at_least_twenty_kinds_of_bad_record() -> None:
    bad = [line.kind for line in LINES if line.skipped or line.rejected]
    assert len(set(bad)) == len(bad) >= 20
    assert all(LINES[n - 1].sample == sample and kept(LINES[n - 1]) for sample, n in FIRST_OF.items())


@pytest.mark.vllm
def test_good_records_are_stored_and_bad_ones_are_not(skip_run: SkipRun) -> None:
    stored = {ref.sample_id for ref in StoreReader(skip_run.store).samples()}
    assert stored == {line.sample for _, line in numbered(LINES, kept)}
    assert skip_run.summary["samples_written"] == len(stored)
    assert skip_run.summary["records_read"] == len(numbered(LINES, lambda line: kept(line) or line.rejected))


@pytest.mark.vllm
def test_each_skipped_record_is_named_by_file_line_and_reason(skip_run: SkipRun) -> None:
    skipped = numbered(LINES, lambda line: line.skipped is not None)
    named = [(e["file"], e["line"], e["reason"]) for e in skip_run.summary["skipped_records"]]
    assert named == [("mixed.jsonl", number, line.skipped) for number, line in skipped]
    assert skip_run.summary["records_skipped"] == len(skipped)
    assert skip_run.summary["skipped_by_reason"] == collections.Counter(line.skipped for _, line in skipped)
    # An id the record declares is named too, whenever it is a usable one.
    assert [e["sample"] for e in skip_run.summary["skipped_records"]] == [line.sample for _, line in skipped]


@pytest.mark.vllm
def test_a_duplicated_id_keeps_its_first_record(skip_run: SkipRun, kimi_tiny_dir: Path) -> None:
    duplicates = [e for e in skip_run.summary["skipped_records"] if e["reason"] == "duplicate id"]
    assert len(duplicates) == 4
    for error in duplicates:
        assert f"first at mixed.jsonl:{FIRST_OF[error['sample']]}, which is kept" in error["detail"]
    reader = StoreReader(skip_run.store)
    tokenizer = AutoTokenizer.from_pretrained(kimi_tiny_dir)
    texts = {ref.sample_id: tokenizer.decode(reader.read_tokens(ref)[0].tolist()) for ref in reader.samples()}
    assert "first of dup-2" in texts["dup-2"] and "first of dup-3" in texts["dup-3"]
    assert "second of" not in texts["dup-3"] and "third of" not in texts["dup-3"]


@pytest.mark.vllm
def test_store_rejections_name_the_record_and_are_counted_by_kind(skip_run: SkipRun) -> None:
    rejected = numbered(LINES, lambda line: line.rejected is not None)
    summary = skip_run.summary
    records = {sample: Rejection.from_json(sample, value) for sample, value in summary["rejected"].items()}
    assert {sample: (r.kind, r.where) for sample, r in records.items()} == \
        {line.sample: (line.rejected, f"mixed.jsonl:{number}") for number, line in rejected}
    for number, line in rejected:
        assert str(records[line.sample]).startswith(f"mixed.jsonl:{number} (sample {line.sample}): ")
    assert "aux hidden states have 1 non-finite" in records["nan-aux"].reason
    assert "final hidden states have 1 non-finite" in records["inf-final"].reason
    assert summary["rejected_by_kind"] == {"non-finite hidden states": 2, "over-long": 1}
    assert summary["samples_rejected"] == 3
    in_store = inspect_store(skip_run.store)
    assert in_store["rejected"] == summary["rejected"]  # the store keeps the same records, file:line too
    assert in_store["rejected_by_kind"] == summary["rejected_by_kind"]
    on_disk = json.loads((skip_run.store / "summaries" / "rank-00000.json").read_text())
    assert on_disk["rejected"] == summary["rejected"]
    assert on_disk["rejected_by_kind"] == summary["rejected_by_kind"]
    assert on_disk["skipped_records"] == summary["skipped_records"]


@pytest.mark.vllm
def test_the_one_line_report_counts_rejections_and_skips(skip_run: SkipRun) -> None:
    from dump.__main__ import summary_line

    skipped = collections.Counter(line.skipped for _, line in numbered(LINES, lambda line: line.skipped))
    by_reason = ", ".join(f"{reason}: {n}" for reason, n in skipped.most_common())
    report = summary_line(skip_run.summary)
    assert "3 rejected (non-finite hidden states: 2, over-long: 1)" in report
    assert f"{skipped.total()} input records skipped ({by_reason});" in report
    assert by_reason.startswith("wrong nesting: 10, bad id: 5, duplicate id: 4, ")


# ---------------------------------------------------------------- a JSON array


def sharegpt(sample_id: str, *speakers: str) -> dict[str, Any]:
    return {"id": sample_id, "conversations": [{"from": s, "value": f"{s} speaks"} for s in speakers]}


ARRAY = [  # (record, the reason the reader skips it for; None: stored)
    (sharegpt("a-1", "human", "gpt"), None),
    (sharegpt("a-2", "gpt", "human", "gpt"), None),  # a later part of a split conversation: trimmed
    (sharegpt("a-role", "narrator", "gpt"), "unknown role"),
    (sharegpt("a-1", "human", "gpt", "human", "gpt"), "duplicate id"),
    (sharegpt("a-answer-only", "gpt"), "no assistant turn"),  # nothing is left once it is trimmed
    (sharegpt("a-3", "system", "human", "gpt"), None),
]
CUT = '{\n  "id": "a-cut",\n  "conversations": [\n    {"from": "human", "value": "unfini'


def write_array(path: Path) -> list[int]:
    """ARRAY pretty-printed, then a record cut short where the file ends; the line each starts on."""
    text, starts = "[\n", []
    for record, _ in ARRAY:
        starts.append(text.count("\n") + 1)
        text += json.dumps(record, indent=2) + ",\n"
    starts.append(text.count("\n") + 1)
    path.write_text(text + CUT, encoding="utf-8")
    return starts


@pytest.mark.vllm
def test_a_json_array_of_bad_records_is_dumped_too(tmp_path: Path, verifier_llm: object) -> None:
    from dump.pipeline import run_dump

    starts = write_array(tmp_path / "parts.json")
    summary = run_dump(dump_config(tmp_path / "parts.json", tmp_path / "store", "skip"), llm=verifier_llm)
    stored = {ref.sample_id for ref in StoreReader(tmp_path / "store").samples()}
    assert stored == {record["id"] for record, reason in ARRAY if reason is None}
    named = [(e["file"], e["line"], e["sample"], e["reason"]) for e in summary["skipped_records"]]
    expected = [(start, record["id"], reason) for start, (record, reason) in zip(starts, ARRAY) if reason]
    assert named == [("parts.json", *e) for e in expected] + [("parts.json", starts[-1], "a-cut", "truncated json")]


# ---------------------------------------------------------------- on_error=raise


def no_engine(*args: object, **kwargs: object) -> None:
    pytest.fail("run_dump started an engine for input it should have refused")


def only_bad_line(bad: int) -> list[Line]:
    """The file up to its bad line `bad`, earlier bad lines blanked so that line numbers hold."""
    blank = Line("blank", b"")
    return [line if kept(line) or number == bad else blank
            for number, line in enumerate(LINES[:bad], start=1)]


def refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: Sequence[Line]) -> RecordError:
    from dump.pipeline import run_dump

    monkeypatch.setattr("dump.pipeline.start_capture_engine", no_engine)
    data = write_lines(tmp_path / "mixed.jsonl", lines)
    with pytest.raises(RecordError) as raised:
        run_dump(dump_config(data, tmp_path / "store", "raise"))
    assert not (tmp_path / "store").exists()  # refused before the store was opened
    return raised.value


@pytest.mark.parametrize("number", [n for n, _ in numbered(LINES, lambda line: line.skipped is not None)],
                         ids=[line.kind for _, line in numbered(LINES, lambda line: line.skipped is not None)])
def test_raise_refuses_a_bad_record_before_an_engine_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            number: int) -> None:
    error = refused(tmp_path, monkeypatch, only_bad_line(number))
    line = LINES[number - 1]
    assert (error.line, error.reason, error.sample_id) == (number, line.skipped, line.sample)
    assert str(error).startswith(f"mixed.jsonl:{number}")


def test_raise_refuses_the_whole_mix_at_its_first_bad_record(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    error = refused(tmp_path, monkeypatch, LINES)
    first_bad = numbered(LINES, lambda line: line.skipped is not None)[0][0]
    assert str(error).startswith(f"mixed.jsonl:{first_bad}: bad json")


def test_raise_refuses_a_duplicate_id_naming_both_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [Line("good", chat(Q, A, id="d")), Line("good", chat(Q, A, id="e")),
             Line("duplicate", chat(("user", "again"), A, id="d"))]
    error = refused(tmp_path, monkeypatch, lines)
    assert str(error) == "mixed.jsonl:3 (sample d): duplicate id 'd': first at mixed.jsonl:1, which is kept"


# ---------------------------------------------------------------- chat template


def test_a_chat_template_failure_is_a_rejection_naming_the_record(kimi_tiny_dir: Path) -> None:
    """No record the reader keeps makes kimi-tiny's template fail (it refuses only unknown roles, which
    the reader skips first); a conversation built here does, as another verifier's template might."""
    tokenizer = AutoTokenizer.from_pretrained(kimi_tiny_dir)
    conversation = Conversation("tool-1", (Message("user", "Hi"), Message("tool", "{}"), Message("assistant", "ok")),
                                origin=Origin("mixed.jsonl", 9))
    with pytest.raises(SampleRejected) as raised:
        tokenize_conversation(tokenizer, conversation, MAX_LEN, "drop")
    assert raised.value.kind == "chat template"
    assert raised.value.rejection == Rejection(RejectionKind.CHAT_TEMPLATE, "tool-1",
                                               "chat template failed: unknown role: tool", Origin("mixed.jsonl", 9))
    assert str(raised.value) == "mixed.jsonl:9 (sample tool-1): chat template failed: unknown role: tool"


def test_the_dump_summary_counts_the_records_the_store_keeps(tmp_path: Path, kimi_tiny_dir: Path) -> None:
    """tokenize_batch on the real template and a real store: each rejection is recorded in the store
    and noted for the summary as one record, which the summary counts by kind."""
    from dump.pipeline import Rejections, open_writer, tokenize_batch

    cfg = dump_config(tmp_path / "in.jsonl", tmp_path / "store", "skip")
    tokenizer = AutoTokenizer.from_pretrained(kimi_tiny_dir)
    turns = {"good": (Message(*Q), Message(*A)), "long": (Message("user", "count the words " * 120), Message(*A)),
             "tool": (Message(*Q), Message("tool", "{}"), Message(*A)), "silent": (Message(*Q),),
             "long-2": (Message("user", "count them " * 200), Message(*A))}
    batch = [Conversation(sample, messages, origin=Origin("in.jsonl", n)) for n, (sample, messages)
             in enumerate(turns.items(), start=1)]
    rejections = Rejections()
    with open_writer(cfg.output_dir, cfg.verifier, cfg.store, {}) as writer:
        samples = tokenize_batch(writer, tokenizer, batch, cfg, rejections)
    assert [s.id for s in samples] == ["good"]
    summary = rejections.summary()
    assert summary["rejected_by_kind"] == {"over-long": 2, "chat template": 1, "no assistant turn": 1}
    assert summary["samples_rejected"] == 4
    assert {sample: (r["kind"], r["file"], r["line"]) for sample, r in summary["rejected"].items()} == {
        "long": ("over-long", "in.jsonl", 2), "tool": ("chat template", "in.jsonl", 3),
        "silent": ("no assistant turn", "in.jsonl", 4), "long-2": ("over-long", "in.jsonl", 5)}
    assert inspect_store(tmp_path / "store")["rejected"] == summary["rejected"]

