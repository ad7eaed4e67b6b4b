"""Why a sample was rejected: `Rejection`, the one record of it, from the chat template
(data/template.py) through the store's manifest (store/writer.py, store/durable.py) to the dump's
summary and `python -m dump inspect`; `RejectionKind`, the closed set of its kinds.

A rejected sample is not a skipped record: the reader skips a record it cannot read
(data/conversations.py's RecordError); a rejection is a conversation read well that still cannot
become a stored sample.
"""
from __future__ import annotations

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
    def from_json(cls, sample: str, value: Any) -> Rejection:
        """The record `to_json` made of sample's rejection. Anything else raises TypeError naming
        the sample and what it got (a sentence, as manifests written before rejections were
        records kept them, is not read); a kind outside RejectionKind raises ValueError."""
        if not (isinstance(value, Mapping) and _FIELDS <= value.keys() and isinstance(value["reason"], str)
                and isinstance(value["file"], (str, type(None))) and isinstance(value["line"], (int, type(None)))):
            older = (" (a sentence: manifests written by an older version of the dump kept those, and "
                     "are not read any more)" if isinstance(value, str) else "")
            raise TypeError(f"rejection of sample {sample!r} is not a {{kind, file, line, reason}} record: "
                            f"got {type(value).__name__} {value!r}{older}")
        origin = None if value["file"] is None else Origin(value["file"], value["line"])
        return cls(RejectionKind(value["kind"]), sample, value["reason"], origin)


# The keys of a record (`to_json`).
_FIELDS = {"kind", "file", "line", "reason"}
