"""Raw records of a conversation file, streamed: the lines of a JSONL file or the items of a
top-level JSON array, each with the line it starts on. A record that cannot be parsed comes with
its problem (`_Invalid`) instead of a value; data/conversations.py validates the others.
`Origin` is where a record is: the file's name and the line it starts on.
"""
from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import ijson

# ijson gets the file a line at a time, cut to pieces of at most this size so that a
# file written on one line does not come into memory whole.
_PIECE_BYTES = 1 << 16
_WHITESPACE = b" \t\r\n"
# A JSON string never holds an unescaped quote, so this only matches a real "id" key.
_ID_KEY = re.compile(rb'"id"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Origin:
    """Where a record is: its file's name and the line it starts on (None: the file as a whole).
    Its text, "<file>:<line>", is how messages point at the record."""

    file: str
    line: int | None = None

    def __str__(self) -> str:
        return self.file if self.line is None else f"{self.file}:{self.line}"


class _Invalid(Exception):
    """Raised inside the readers; the read loop (data/conversations.py) turns it into a RecordError."""

    def __init__(self, reason: str, detail: str | None = None) -> None:
        super().__init__(detail or reason)
        self.reason = reason
        self.detail = detail or reason


@dataclass(frozen=True)
class _Raw:
    """One record as parsed from the file, before validation."""

    line: int
    fallback_id: str  # used when the record has no "id"
    value: Any = None
    problem: _Invalid | None = None  # set when the record could not even be parsed


def _raw_records(path: pathlib.Path) -> Iterator[_Raw]:
    with open(path, "rb") as f:
        first = _first_byte(f)
    if first == b"[":
        return _array_records(path)
    return _jsonl_records(path)


def _first_byte(f: BinaryIO) -> bytes:
    while chunk := f.read(_PIECE_BYTES):
        stripped = chunk.lstrip(_WHITESPACE)
        if stripped:
            return stripped[:1]
    return b""


def _jsonl_records(path: pathlib.Path) -> Iterator[_Raw]:
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip(_WHITESPACE):
                continue
            fallback_id = f"{path.stem}:{line_number}"
            try:
                value = json.loads(line)
            except ValueError as e:  # also catches bytes that are not UTF-8
                problem = _Invalid("bad json", f"bad json: {e}")
                yield _Raw(line_number, fallback_id, problem=problem)
                continue
            yield _Raw(line_number, fallback_id, value)


def _array_records(path: pathlib.Path) -> Iterator[_Raw]:
    """The items of a top-level JSON array, streamed, each with the line it starts on.

    ijson is fed one line (or piece of a long line) at a time, so the items it finishes
    after a piece are known to end on that piece's line. A record is given the first line
    after the previous record with anything but separators on it: exact when records
    start on lines of their own (pretty-printed arrays) or all share one line.

    A syntax error ends the array: nothing after it can be trusted. So does a file that
    stops before the closing bracket, as the packaged ShareGPT file does in the middle of
    its last record.
    """
    items = ijson.sendable_list()
    parser = ijson.items_coro(items, "item", use_float=True)
    index = 0
    line = 1
    start: int | None = None  # line of the record being parsed, once it has begun
    pending_id: str | None = None  # that record's id, if seen, to name it when truncated
    with open(path, "rb") as f:
        for piece in _pieces(f):
            if start is None and piece.strip(_WHITESPACE + b",["):
                start = line
            failure = _send(parser, piece)  # items finished by this piece land in `items`
            for value in items:
                yield _Raw(start or line, f"{path.stem}#{index}", value)
                index += 1
            if items:
                del items[:]
                start, pending_id = None, None
            elif start is not None and pending_id is None:
                pending_id = _id_in(piece)
            if failure is not None:
                problem = _Invalid("bad json", f"bad json: {failure}")
                # The partial record is given as {"id": ...} so that the error can name it.
                yield _Raw(start or line, f"{path.stem}#{index}", {"id": pending_id}, problem)
                return
            if piece.endswith(b"\n"):
                line += 1
    try:
        parser.close()
    except (ijson.JSONError, ValueError):
        detail = "truncated/incomplete JSON: the file ends before its array is closed"
        problem = _Invalid("truncated json", detail)
        yield _Raw(start or line, f"{path.stem}#{index}", {"id": pending_id}, problem)


def _send(parser: Any, piece: bytes) -> str | None:
    """Feed the parser; the parse error, on one line, if the piece holds one."""
    try:
        parser.send(piece)
    except (ijson.JSONError, ValueError) as e:  # ValueError: bytes that are not UTF-8
        return " ".join(str(e).split())
    return None


def _pieces(f: BinaryIO) -> Iterator[bytes]:
    while piece := f.readline(_PIECE_BYTES):
        yield piece


def _id_in(piece: bytes) -> str | None:
    match = _ID_KEY.search(piece)
    if match is None:
        return None
    try:
        return json.loads(b'"' + match.group(1) + b'"')
    except ValueError:
        return None
