"""The dump's conversations, with a held-out set that can tell two drafts apart.

The trainer holds out whole conversations (data/split.py, conf/heldout_split), so a store of a few
hundred conversations holds only a handful of held-out ones, and one long ShareGPT conversation cut
into many parts can hold most of the held-out positions: the standard error of a difference between
two drafts, clustered by conversation, is then about as large as the levers it should tell. The dump
therefore (conf/dump.yaml `heldout_set`):
- keeps one part of each held-out conversation, its first (the others are neither trained on nor
  held out: training on them would leak held-out text);
- reads on past data.max_samples for more held-out conversations (the same rule, so the trainer's
  split finds them held out without a list) until the set holds `conversations` of them, picked
  with the data's select share so the set mixes code and dialogue as the training data does;
- cuts a held-out sample to `max_tokens` tokens (dump/pipeline.py), so that no conversation weighs
  much more than another.
The training conversations are exactly those the data config alone gives.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from data.conversations import Conversation, ReadStats, load_conversations, select_share
from data.split import split_key_for


@dataclasses.dataclass(frozen=True)
class HeldoutSet:
    """conf/dump.yaml heldout_set: how many held-out conversations, and how long a sample of one."""

    conversations: int      # held-out conversations the dump reads on for (0: only those within max_samples)
    max_tokens: int         # tokens a held-out sample is cut to

    def __post_init__(self) -> None:
        if self.conversations < 0:
            raise ValueError(f"heldout_set.conversations is {self.conversations}: it must be >= 0")
        if self.max_tokens < 1:
            raise ValueError(f"heldout_set.max_tokens is {self.max_tokens}: it must be positive")


def dump_conversations(data: Mapping[str, Any], split: str, held_out: Callable[[str], bool],
                       heldout_set: HeldoutSet, stats: ReadStats | None = None) -> Iterator[Conversation]:
    """The conversations a dump of `data` (a conf/data node) writes, in a fixed order: the data's
    own, a held-out conversation by its first part only; then the first parts of further held-out
    conversations read past max_samples, picked with the data's select share, until
    `heldout_set.conversations` are held out. `held_out`: the trainer's predicate on sample ids
    (data/split.py held_out_by)."""
    key = split_key_for(data["format"])
    held: set[str] = set()          # conversations with a part in the held-out set
    for conversation in load_conversations(data, split, stats):
        if held_out(conversation.id):
            if key(conversation.id) in held:
                continue            # a later part: neither trained on (it would leak) nor held out
            held.add(key(conversation.id))
        yield conversation
    missing = heldout_set.conversations - len(held)
    if missing <= 0 or data["max_samples"] is None:   # no cap: every held-out conversation is in
        return
    seen = set(held)

    def first_parts() -> Iterator[Conversation]:
        # The whole split in file order: what max_samples cut off comes after what it kept.
        for conversation in load_conversations({**data, "max_samples": None, "select": None}, split):
            k = key(conversation.id)
            if held_out(conversation.id) and k not in seen:
                seen.add(k)
                yield conversation

    select = data["select"]
    if select is None:
        yield from itertools.islice(first_parts(), missing)
    else:
        yield from select_share(first_parts(), select["pattern"], select["share"], missing)
