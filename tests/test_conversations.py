"""Tests of data/conversations.py (and data/records.py): real ShareGPT and HumanEval data, fixtures of bad records."""

import collections
import itertools
import json
import logging
import pathlib

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

from data.conversations import (
    Conversation,
    Message,
    ReadStats,
    RecordError,
    first_user_text,
    load_conversations,
    read_conversations,
    read_humaneval,
    read_messages_jsonl,
    read_sharegpt,
    select_share,
    sharegpt_default_path,
)
from data.records import Origin
from data.split import is_held_out, sharegpt_split_key
from config import compose_config

DATA = pathlib.Path(__file__).parent / "data"
SHAREGPT_FIXTURE = DATA / "malformed_sharegpt.jsonl"
MESSAGES_FIXTURE = DATA / "malformed_messages.jsonl"

# (line, sample id, reason) of every bad record in the fixtures.
SHAREGPT_BAD = [
    (2, None, "bad json"),
    (3, None, "wrong nesting"),
    (4, "noconv_0", "wrong nesting"),
    (5, "turnlist_0", "wrong nesting"),
    (6, "novalue_0", "wrong nesting"),
    (7, "role_0", "unknown role"),
    (8, "number_0", "content not a string"),
    (9, "empty_0", "empty content"),
    (10, "noanswer_0", "no assistant turn"),
    (11, "twice_0", "turns do not alternate"),
]
MESSAGES_BAD = [
    (3, None, "bad json"),
    (4, None, "wrong nesting"),
    (5, "chat-nomessages", "wrong nesting"),
    (6, "chat-turn", "wrong nesting"),
    (7, "chat-tool", "unknown role"),
    (8, "chat-null", "content not a string"),
    (9, "chat-empty", "empty content"),
    (10, "chat-noanswer", "no assistant turn"),
    (11, "chat-first", "first turn not user"),
    (12, "chat-alternate", "turns do not alternate"),
    (13, None, "bad id"),
]


@pytest.fixture(scope="module")
def real_records() -> list[dict]:
    """The first few raw records of the packaged ShareGPT file, read with plain json."""
    return [json.loads(text) for text in _first_array_items(sharegpt_default_path(), 4)]


def _first_array_items(path: pathlib.Path, count: int) -> list[str]:
    # The packaged file is pretty-printed with two-space indents: a record is the lines
    # from "  {" to "  }" (a cheap cut that avoids parsing 125 MB in a test).
    items, current = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.rstrip() == "  {":
                current = [line]
            elif current:
                current.append(line)
                if line.rstrip() in ("  }", "  },"):
                    items.append("".join(current).rstrip().rstrip(","))
                    current = []
                    if len(items) == count:
                        return items
    raise AssertionError(f"fewer than {count} records in {path}")


def _check_conversation(conversation: Conversation) -> None:
    roles = [m.role for m in conversation.messages]
    dialogue = list(itertools.dropwhile(lambda role: role == "system", roles))
    assert dialogue, conversation.id
    assert dialogue == ["user", "assistant"] * (len(dialogue) // 2) + ["user"] * (len(dialogue) % 2)
    assert "assistant" in dialogue
    assert all(isinstance(m.content, str) and m.content.strip() for m in conversation.messages)


# ---------------------------------------------------------------- real ShareGPT data


def test_real_sharegpt_head_streams_valid_conversations():
    stats = ReadStats()
    head = itertools.islice(read_sharegpt(sharegpt_default_path(), "skip", stats), 200)
    conversations = list(head)

    assert len(conversations) == 200
    first = conversations[0]
    assert first.id == "QWJhYvA_0"
    assert first.category == "dialogue"
    assert first.messages[0] == Message("user", first.messages[0].content)
    assert first.messages[0].content.startswith("Summarize the main ideas of Jeff Walker")
    assert first.messages[1].role == "assistant"
    ids = [c.id for c in conversations]
    assert len(set(ids)) == len(ids)
    assert all(isinstance(i, str) and i for i in ids)
    for conversation in conversations:
        _check_conversation(conversation)
    assert stats.read == 200
    assert stats.skipped == sum(stats.reasons.values())


def test_split_is_deterministic_disjoint_and_near_its_fraction():
    conversations = itertools.islice(read_sharegpt(sharegpt_default_path(), "skip"), 200)
    ids = [c.id for c in conversations]

    held = {i for i in ids if is_held_out(i, 0.3, seed=7)}
    again = {i for i in reversed(ids) if is_held_out(i, 0.3, seed=7)}
    train = {i for i in ids if not is_held_out(i, 0.3, seed=7)}
    assert held == again
    assert held.isdisjoint(train) and held | train == set(ids)
    # Binomial(200, 0.3): mean 60, sd 6.5.
    assert 35 <= len(held) <= 85
    assert held != {i for i in ids if is_held_out(i, 0.3, seed=8)}
    assert not any(is_held_out(i, 0.0) for i in ids)
    assert all(is_held_out(i, 1.0) for i in ids)
    with pytest.raises(ValueError):
        is_held_out("x", 1.5)


def test_sharegpt_split_key_keeps_parts_of_a_conversation_together():
    assert sharegpt_split_key("QWJhYvA_0") == "QWJhYvA"
    assert sharegpt_split_key("QWJhYvA_12") == "QWJhYvA"
    assert sharegpt_split_key("a_b_3") == "a_b"
    assert sharegpt_split_key("no-part") == "no-part"
    assert sharegpt_split_key("_3") == "_3"
    assert sharegpt_split_key("x_y") == "x_y"


@pytest.mark.parametrize("cut", ["inside a string", "after the id", "between records"])
def test_truncated_real_array_is_one_bad_record(tmp_path, real_records, cut):
    head = "[\n" + ",\n".join(json.dumps(r, indent=2) for r in real_records[:3]) + ",\n"
    fourth = json.dumps(real_records[3], indent=2)
    tail = {
        "inside a string": fourth[: fourth.index('"value": "') + 40],
        "after the id": fourth[: fourth.index('"conversations"')],
        "between records": "",
    }[cut]
    path = tmp_path / "ShareGPT_cut.json"
    path.write_text(head + tail, encoding="utf-8")
    line = head.count("\n") + 1
    sample_id = None if cut == "between records" else real_records[3]["id"]

    yielded = []
    with pytest.raises(RecordError) as raised:
        for conversation in read_sharegpt(path, on_error="raise"):
            yielded.append(conversation.id)
    assert yielded == [r["id"] for r in real_records[:3]]
    error = raised.value
    assert _where(error) == (path, line, sample_id, "truncated json")
    assert str(error).startswith(f"ShareGPT_cut.json:{line}")
    assert "truncated/incomplete JSON" in str(error)

    stats = ReadStats()
    kept = [c.id for c in read_sharegpt(path, on_error="skip", stats=stats)]
    assert kept == yielded
    assert (stats.read, stats.skipped, stats.reasons) == (3, 1, {"truncated json": 1})


def test_array_layouts_give_the_same_conversations(tmp_path, real_records):
    pretty = json.dumps(real_records, indent=2)
    expected = list(read_sharegpt(_write(tmp_path / "pretty.json", pretty)))
    one_line = list(read_sharegpt(_write(tmp_path / "one_line.json", json.dumps(real_records))))
    jsonl = "\n".join(json.dumps(r) for r in real_records) + "\n"
    as_jsonl = list(read_sharegpt(_write(tmp_path / "records.jsonl", jsonl)))

    assert [c.id for c in expected] == [r["id"] for r in real_records]
    assert one_line == expected
    assert as_jsonl == expected


def test_syntax_error_in_array_stops_the_read(tmp_path):
    turns = [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]
    good = {"id": "g", "conversations": turns}
    text = "[\n" + json.dumps(good) + ',\n{"id": "broken", oops},\n' + json.dumps(good) + "\n]\n"
    path = _write(tmp_path / "broken.json", text)

    with pytest.raises(RecordError) as raised:
        list(read_sharegpt(path))
    assert _where(raised.value) == (path, 3, "broken", "bad json")
    stats = ReadStats()
    assert [c.id for c in read_sharegpt(path, "skip", stats)] == ["g"]
    assert stats.reasons == {"bad json": 1}


def _write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text, encoding="utf-8")
    return path


def _where(error: RecordError) -> tuple:
    return error.path, error.line, error.sample_id, error.reason


# ---------------------------------------------------------------- fixtures of bad records


def _only_bad_line(fixture: pathlib.Path, tmp_path: pathlib.Path, keep: int, bad: list):
    """A copy of the fixture where bad lines other than `keep` are blank (numbers unchanged)."""
    blank = {line for line, _, _ in bad} - {keep}
    lines = fixture.read_text(encoding="utf-8").splitlines(keepends=True)
    text = "".join("\n" if number in blank else line for number, line in enumerate(lines, 1))
    return _write(tmp_path / fixture.name, text)


@pytest.mark.parametrize("line, sample_id, reason", SHAREGPT_BAD)
def test_sharegpt_raise_names_file_line_sample_and_reason(tmp_path, line, sample_id, reason):
    path = _only_bad_line(SHAREGPT_FIXTURE, tmp_path, line, SHAREGPT_BAD)
    yielded = []
    with pytest.raises(RecordError) as raised:
        for conversation in read_sharegpt(path, on_error="raise"):
            yielded.append(conversation.id)
    error = raised.value
    assert _where(error) == (path, line, sample_id, reason)
    sample = "" if sample_id is None else f" (sample {sample_id})"
    assert str(error).startswith(f"malformed_sharegpt.jsonl:{line}{sample}: ")
    assert yielded == ["good_0"]


@pytest.mark.parametrize("line, sample_id, reason", MESSAGES_BAD)
def test_messages_raise_names_file_line_sample_and_reason(tmp_path, line, sample_id, reason):
    path = _only_bad_line(MESSAGES_FIXTURE, tmp_path, line, MESSAGES_BAD)
    with pytest.raises(RecordError) as raised:
        list(read_messages_jsonl(path, on_error="raise"))
    error = raised.value
    assert _where(error) == (path, line, sample_id, reason)
    assert str(error).startswith(f"malformed_messages.jsonl:{line}")


def test_raise_mode_stops_at_the_first_bad_record():
    conversations = read_sharegpt(SHAREGPT_FIXTURE)
    assert next(conversations).id == "good_0"
    with pytest.raises(RecordError, match=r"^malformed_sharegpt\.jsonl:2: bad json"):
        next(conversations)


def test_unknown_role_message_quotes_the_role(tmp_path):
    path = _only_bad_line(SHAREGPT_FIXTURE, tmp_path, 7, SHAREGPT_BAD)
    with pytest.raises(RecordError) as raised:
        list(read_sharegpt(path))
    expected = "malformed_sharegpt.jsonl:7 (sample role_0): unknown role 'narrator'"
    assert str(raised.value) == expected


def test_sharegpt_skip_yields_good_records_and_counts_reasons(caplog):
    stats = ReadStats()
    with caplog.at_level(logging.WARNING, logger="data.conversations"):
        conversations = list(read_sharegpt(SHAREGPT_FIXTURE, on_error="skip", stats=stats))

    assert [(c.id, [(m.role, m.content) for m in c.messages]) for c in conversations] == [
        ("good_0", [("user", "Hi there"), ("assistant", "Hello! How can I help?")]),
        # Opened with an assistant turn (a later part of a split conversation): dropped.
        ("good_1", [("user", "Thanks. Another one?"), ("assistant", "Sure: once upon a time...")]),
        ("good_2", [("system", "Be brief."), ("user", "2+2?"), ("assistant", "4")]),
    ]
    assert all(c.category == "dialogue" for c in conversations)
    assert stats.read == 3
    assert stats.skipped == len(SHAREGPT_BAD)
    assert stats.reasons == collections.Counter(reason for _, _, reason in SHAREGPT_BAD)
    assert stats.trimmed == 1
    assert stats.summary().startswith("read 3, skipped 10 (wrong nesting: 4, bad json: 1, ")
    assert stats.summary().endswith(", 1 began with assistant turns that were dropped")
    # One line per skipped record for the first ten, then the total.
    assert len(caplog.records) == 11
    assert "skipped 10 records of malformed_sharegpt.jsonl" in caplog.records[-1].getMessage()


def test_messages_skip_yields_good_records_and_counts_reasons():
    stats = ReadStats()
    conversations = list(read_messages_jsonl(MESSAGES_FIXTURE, on_error="skip", stats=stats))

    assert [c.id for c in conversations] == ["chat-1", "malformed_messages:2"]
    colour = (Message("user", "Name a colour."), Message("assistant", "Teal."))
    assert conversations[1].messages == colour
    assert stats.reasons == collections.Counter(reason for _, _, reason in MESSAGES_BAD)
    assert (stats.read, stats.skipped, stats.trimmed) == (2, len(MESSAGES_BAD), 0)


def test_stats_accumulate_over_reads():
    stats = ReadStats()
    list(read_messages_jsonl(MESSAGES_FIXTURE, "skip", stats))
    list(read_sharegpt(SHAREGPT_FIXTURE, "skip", stats))
    assert stats.read == 5
    assert stats.reasons["wrong nesting"] == 3 + 4
    assert stats.summary().startswith("read 5, skipped 21 (wrong nesting: 7")


def test_read_conversations_detects_the_format(tmp_path):
    messages = read_conversations(MESSAGES_FIXTURE, on_error="skip")
    assert [c.id for c in messages] == ["chat-1", "malformed_messages:2"]
    sharegpt = read_conversations(SHAREGPT_FIXTURE, on_error="skip")
    assert [c.id for c in sharegpt] == ["good_0", "good_1", "good_2"]
    with pytest.raises(ValueError, match="cannot tell the format"):
        read_conversations(_write(tmp_path / "other.jsonl", '{"text": "hi"}\n'))
    with pytest.raises(ValueError, match="unknown conversation format"):
        read_conversations(MESSAGES_FIXTURE, format="alpaca")
    with pytest.raises(ValueError, match="on_error"):
        read_sharegpt(SHAREGPT_FIXTURE, on_error="ignore")
    with pytest.raises(FileNotFoundError):
        read_sharegpt(tmp_path / "missing.json")


# ---------------------------------------------------------------- HumanEval


def test_humaneval_problems():
    problems = list(read_humaneval())

    assert len(problems) == 164
    assert [p.id for p in problems] == [f"HumanEval/{n}" for n in range(164)]
    assert all(p.category == "code" for p in problems)
    assert all(len(p.messages) == 1 and p.messages[0].role == "user" for p in problems)
    first = problems[0].messages[0].content
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in first
    assert "```python\n" in first and first.endswith("```")
    assert [p.id for p in read_humaneval(limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


# ---------------------------------------------------------------- configs


def test_load_sharegpt_config_splits_the_packaged_file():
    cfg = compose_config("dump", ["data=sharegpt"]).data
    assert cfg.path is None
    cfg.max_samples = 30
    train = list(load_conversations(cfg, "train"))
    cfg.max_samples = 2
    stats = ReadStats()
    heldout = list(load_conversations(cfg, "heldout", stats))

    assert len(train) == 30 and len(heldout) == 2
    assert {c.id for c in train}.isdisjoint(c.id for c in heldout)
    assert all(is_held_out(sharegpt_split_key(c.id), 0.02) for c in heldout)
    assert all(c.category == "dialogue" for c in train + heldout)
    assert stats.read >= 2


def test_load_humaneval_config_is_all_evaluation():
    cfg = compose_config("dump", ["data=humaneval"]).data
    assert len(list(load_conversations(cfg, "heldout"))) == 164
    assert list(load_conversations(cfg, "train")) == []
    cfg.max_samples = 5
    assert [c.category for c in load_conversations(cfg, "all")] == ["code"] * 5


def test_load_jsonl_config(tmp_path):
    cfg = compose_config("dump", ["data=jsonl"]).data
    with pytest.raises(MissingMandatoryValue):
        load_conversations(cfg, "train")

    def record(n: int) -> dict:
        turns = [{"role": "user", "content": f"q{n}"}, {"role": "assistant", "content": f"a{n}"}]
        return {"id": f"c{n}", "messages": turns}

    records = [record(n) for n in range(40)]
    cfg.path = str(_write(tmp_path / "chats.jsonl", "".join(json.dumps(r) + "\n" for r in records)))
    cfg.heldout_fraction = 0.5
    train = [c.id for c in load_conversations(cfg, "train")]
    heldout = [c.id for c in load_conversations(cfg, "heldout")]
    assert sorted(train + heldout) == sorted(r["id"] for r in records)
    assert set(train).isdisjoint(heldout) and train and heldout
    assert [c.id for c in load_conversations(cfg, "all")] == [r["id"] for r in records]

    cfg.path = str(MESSAGES_FIXTURE)
    with pytest.raises(RecordError):
        list(load_conversations(cfg, "all"))
    cfg.on_error = "skip"
    assert len(list(load_conversations(cfg, "all"))) == 2


def test_load_accepts_a_plain_dict(tmp_path):
    cfg = OmegaConf.to_container(compose_config("dump", ["data=sharegpt"]).data)
    cfg.update(path=str(SHAREGPT_FIXTURE), heldout_fraction=0.0)
    assert [c.id for c in load_conversations(cfg, "train")] == ["good_0", "good_1", "good_2"]
    with pytest.raises(ValueError, match="unknown split"):
        load_conversations(cfg, "test")


def test_prompt_only_records_are_read_when_no_answer_is_required(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"id": "p1", "messages": [{"role": "user", "content": "Write a haiku."}]}) + "\n"
        + json.dumps({"id": "p2", "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "12 x 7?"}]}) + "\n"
        + json.dumps({"id": "p3", "messages": [{"role": "system", "content": "Only a system turn."}]}) + "\n")
    with pytest.raises(RecordError, match=r"prompts.jsonl:1 \(sample p1\): no assistant turn"):
        list(read_conversations(path))
    stats = ReadStats()
    prompts = list(read_conversations(path, on_error="skip", stats=stats, require_answer=False))
    assert [c.id for c in prompts] == ["p1", "p2"]
    assert [m.role for m in prompts[1].messages] == ["system", "user"]
    assert dict(stats.reasons) == {"no user turn": 1}


# ---------------------------------------------------------------- duplicate ids


def _chat(sample_id: str | None, question: str) -> dict:
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": "ok"}]
    return {"messages": turns} if sample_id is None else {"id": sample_id, "messages": turns}


def _jsonl(path: pathlib.Path, records: list) -> pathlib.Path:
    return _write(path, "".join(json.dumps(r) + "\n" for r in records))


def test_duplicate_ids_keep_the_first_and_name_both_lines(tmp_path):
    # Line 4 has no id and falls back to "chats:4", which line 6 then declares.
    records = [_chat("a", "q1"), _chat("b", "q2"), _chat("a", "q3"), _chat(None, "q4"),
               _chat("a", "q5"), _chat("chats:4", "q6")]
    path = _jsonl(tmp_path / "chats.jsonl", records)

    stats = ReadStats()
    kept = list(read_messages_jsonl(path, "skip", stats))
    assert [(c.id, c.messages[0].content, c.origin) for c in kept] == [
        ("a", "q1", Origin("chats.jsonl", 1)), ("b", "q2", Origin("chats.jsonl", 2)),
        ("chats:4", "q4", Origin("chats.jsonl", 4))]
    assert [str(c.origin) for c in kept] == ["chats.jsonl:1", "chats.jsonl:2", "chats.jsonl:4"]
    assert (stats.read, stats.skipped, dict(stats.reasons)) == (3, 3, {"duplicate id": 3})
    assert [str(e) for e in stats.errors] == [
        "chats.jsonl:3 (sample a): duplicate id 'a': first at chats.jsonl:1, which is kept",
        "chats.jsonl:5 (sample a): duplicate id 'a': first at chats.jsonl:1, which is kept",
        "chats.jsonl:6 (sample chats:4): duplicate id 'chats:4': first at chats.jsonl:4, which is kept",
    ]
    with pytest.raises(RecordError) as raised:
        list(read_messages_jsonl(path))
    assert _where(raised.value) == (path, 3, "a", "duplicate id")


def test_a_bad_record_does_not_take_its_id(tmp_path):
    bad = {"id": "c", "messages": "not a list"}
    path = _jsonl(tmp_path / "chats.jsonl", [bad, _chat("c", "q2"), _chat(7, "q3"), _chat("7", "q4")])
    stats = ReadStats()
    assert [(c.id, c.origin) for c in read_messages_jsonl(path, "skip", stats)] == [
        ("c", Origin("chats.jsonl", 2)), ("7", Origin("chats.jsonl", 3))]
    assert dict(stats.reasons) == {"wrong nesting": 1, "duplicate id": 1}


def test_duplicate_ids_in_a_one_line_array(tmp_path):
    turns = [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]
    records = [{"id": "x", "conversations": turns}, {"id": "y", "conversations": turns},
               {"id": "x", "conversations": turns}]
    path = _write(tmp_path / "array.json", json.dumps(records))
    stats = ReadStats()
    assert [c.id for c in read_sharegpt(path, "skip", stats)] == ["x", "y"]
    assert [(e.line, e.sample_id, e.reason) for e in stats.errors] == [(1, "x", "duplicate id")]


def test_read_stats_name_the_first_skipped_records_and_count_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr("data.conversations._MAX_NAMED_SKIPS", 2)
    stats = ReadStats()
    list(read_messages_jsonl(MESSAGES_FIXTURE, "skip", stats))
    assert stats.skipped == len(MESSAGES_BAD)
    assert [(e.line, e.reason) for e in stats.errors] == [(3, "bad json"), (4, "wrong nesting")]


def _conversations(first_turns: list[str]) -> list[Conversation]:
    return [Conversation(f"c{i}", (Message("user", text), Message("assistant", "a"))) for i, text in enumerate(first_turns)]


def test_select_share_interleaves_the_two_sides_in_file_order():
    convs = _conversations(["def f(): pass" if i % 5 == 0 else "hello" for i in range(100)])
    picked = list(select_share(iter(convs), r"\bdef ", 0.5, 10))
    matching = [c.id for c in picked if c.messages[0].content.startswith("def")]
    assert len(picked) == 10 and len(matching) == 5
    assert matching == ["c0", "c5", "c10", "c15", "c20"]                       # file order per side
    assert [c.id for c in picked if c.id not in matching] == ["c1", "c2", "c3", "c4", "c6"]
    # Every prefix keeps the share within one conversation (a capped or interrupted dump has it).
    for n in range(1, 11):
        share = sum(c.id in matching for c in picked[:n]) / n
        assert abs(share - 0.5) <= 1 / n


def test_select_share_fills_from_the_other_side_when_one_runs_out(caplog):
    convs = _conversations(["code here" if i < 3 else "prose" for i in range(20)])
    with caplog.at_level(logging.WARNING, logger="data.conversations"):
        picked = list(select_share(iter(convs), "code", 0.5, 12))
    assert len(picked) == 12 and sum("code" in c.messages[0].content for c in picked) == 3
    assert "fewer matching conversations" in caplog.text
    assert len(list(select_share(iter(convs), "code", 0.5, 40))) == 20        # the file ran out


def test_select_share_refuses_bad_settings():
    convs = _conversations(["x"])
    with pytest.raises(ValueError, match=r"share must be in \[0, 1\]"):
        list(select_share(iter(convs), "x", 1.5, 4))
    with pytest.raises(ValueError, match="needs data.max_samples"):
        list(select_share(iter(convs), "x", 0.5, None))
    with pytest.raises(ValueError, match="is not a regex"):
        list(select_share(iter(convs), "(", 0.5, 4))
    assert [c.id for c in select_share(iter(convs), "x", 1.0, None)] == ["c0"]   # share 1: a filter


def test_select_from_the_config_on_the_packaged_file():
    cfg = compose_config("dump", ["data=sharegpt", "data.max_samples=40",
                                  "data.select={pattern: python, share: 0.25}"]).data
    picked = list(load_conversations(cfg, "train"))
    hits = [c for c in picked if "python" in first_user_text(c).lower()]
    assert len(picked) == 40 and len(hits) == 10
    assert not any(is_held_out(sharegpt_split_key(c.id), 0.02) for c in picked)   # the split still holds
