"""Why a sample was rejected: `Rejection`, the one record of it, from the chat template
(data/template.py) through the store's manifest (store/writer.py, store/durable.py) to the dump's
summary and `python -m dump inspect`; `RejectionKind`, the closed set of its kinds.

A rejected sample is not a skipped record: the reader skips a record it cannot read
(data/conversations.py's RecordError); a rejection is a conversation read well that still cannot
become a stored sample.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from data.records import Origin


class RejectionKind(StrEnum):
    """What made a sample unusable; the value is the few words summaries count it under."""

    NO_ASSISTANT_TURN = "no assistant turn"     # nothing to learn from (regeneration can leave this)
    CHAT_TEMPLATE = "chat template"             # the verifier's template refused the conversation
    OVER_LONG = "over-long"                     # more than max_len tokens under over_long=drop
    NO_ASSISTANT_TOKEN = "no assistant token"   # none within max_len tokens
    NON_FINITE = "non-finite hidden states"     # NaN or inf in the captured states
    NO_TOKENS = "no tokens"                     # an empty sample
    UNKNOWN = "unknown"                         # a legacy reason none of the above matches


@dataclass(frozen=True)
class Rejection:
    """One rejected sample: its kind, its id, what exactly was wrong (`reason`), and the record it
    came from where known. str() is the message: "<file>:<line> (sample <id>): <reason>"."""

    kind: RejectionKind
    sample: str
    reason: str
    origin: Origin | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RejectionKind(self.kind))  # a kind outside the set raises

    @property
    def file(self) -> str | None:
        return None if self.origin is None else self.origin.file

    @property
    def line(self) -> int | None:
        return None if self.origin is None else self.origin.line

    @property
    def where(self) -> str | None:
        """The record's "<file>:<line>", for messages; None where unknown."""
        return None if self.origin is None else str(self.origin)

    def __str__(self) -> str:
        where = f"sample {self.sample}" if self.origin is None else f"{self.origin} (sample {self.sample})"
        return f"{where}: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        """The record as a manifest (store/format.py) and the dump's summary keep it, under its
        sample id."""
        return {"kind": self.kind.value, "file": self.file, "line": self.line, "reason": self.reason}

    @classmethod
    def from_json(cls, sample: str, value: Mapping[str, Any] | str) -> Rejection:
        """The record `to_json` made of sample's rejection; a plain string is the legacy form
        (`from_legacy`). ValueError, KeyError or TypeError for anything else."""
        if isinstance(value, str):
            return cls.from_legacy(sample, value)
        file, line = value["file"], value["line"]
        if not isinstance(value["reason"], str) or not isinstance(file, (str, type(None))) \
                or not isinstance(line, (int, type(None))):
            raise TypeError(f"rejection of sample {sample!r} is not {{kind, file, line, reason}}: {value!r}")
        origin = None if file is None else Origin(file, line)
        return cls(RejectionKind(value["kind"]), sample, value["reason"], origin)

    @classmethod
    def from_legacy(cls, sample: str, text: str) -> Rejection:
        """The legacy path, the one place it is read: manifests written before rejections were
        records kept a sentence per sample, "<file>:<line> (sample <id>): <reason>" for the chat
        template's rejections, the bare reason for the writer's. The record and kind are
        recovered from the sentences those versions wrote; any other is kind UNKNOWN."""
        where, marker, rest = text.partition(f" (sample {sample}): ")
        origin = _legacy_origin(where) if marker else None
        reason = rest if origin is not None else text.removeprefix(f"sample {sample}: ")
        kind = next((k for pattern, k in _LEGACY_KINDS if pattern.fullmatch(reason)), RejectionKind.UNKNOWN)
        return cls(kind, sample, reason, origin)


# The reasons the earlier versions wrote, each as they worded it.
_LEGACY_KINDS = [
    (re.compile(r"no assistant turn"), RejectionKind.NO_ASSISTANT_TURN),
    (re.compile(r"chat template failed: .*", re.DOTALL), RejectionKind.CHAT_TEMPLATE),
    (re.compile(r"\d+ tokens > max_len \d+"), RejectionKind.OVER_LONG),
    (re.compile(r"no assistant token within \d+ tokens"), RejectionKind.NO_ASSISTANT_TOKEN),
    (re.compile(r"(aux|final) hidden states have \d+ non-finite values \(NaN/Inf\)(; .*)?"),
     RejectionKind.NON_FINITE),
    (re.compile(r"no tokens"), RejectionKind.NO_TOKENS),
]
_LEGACY_LINE = re.compile(r"(?P<file>.+):(?P<line>\d+)")


def _legacy_origin(where: str) -> Origin | None:
    match = _LEGACY_LINE.fullmatch(where)
    return None if match is None else Origin(match["file"], int(match["line"]))
