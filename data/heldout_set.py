"""The dump's conversations, with a held-out set that can tell two drafts apart.

The trainer holds out whole conversations (data/split.py, conf/heldout_split), so a store of a few
hundred conversations holds only a handful of held-out ones, and one long ShareGPT conversation cut
into many parts can hold most of the held-out positions: the standard error of a difference between
two drafts, clustered by conversation, is then about as large as the levers it should tell. The dump
therefore (conf/dump.yaml `heldout_set`):
- keeps one part of each held-out conversation, its first (the others are neither trained on nor
  held out: training on them would leak held-out text);
- reads on past data.max_samples for more conversations to hold out, until the set holds
  `conversations` of them: the first part of each conversation the data's own read did not reach,
  picked with the data's select share so the set mixes code and dialogue as the training data does.
  They are held out because the dump read them for the set, not by the trainer's rule, so the
  store records it: the writer puts them in the held-out shards, and the trainer holds out every
  sample of a held-out shard (train/batches.py). Growing the set therefore never moves a
  conversation between training and held out;
- cuts a held-out sample to `max_tokens` tokens (dump/pipeline.py), so that no conversation weighs
  much more than another;
- has the verifier answer a held-out conversation in at most `answer_tokens` tokens (dump/regenerate.py).
  A standard error of a difference between two drafts, clustered by conversation, is mostly how the
  conversations differ: on 433 conversations of 256-token answers the second half of each answer
  added more spread between conversations than precision, and the answers' decode is most of what a
  held-out conversation costs the dump. Shorter answers buy more conversations at the same cost.
The training conversations are exactly those the data config alone gives, whatever the set's size.
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
    """conf/dump.yaml heldout_set: how many held-out conversations, how long a sample of one, and how long
    its answer."""

    conversations: int      # held-out conversations the dump reads on for (0: only those within max_samples)
    max_tokens: int         # tokens a held-out sample is cut to
    answer_tokens: int      # tokens the verifier answers a held-out conversation in, at most

    def __post_init__(self) -> None:
        if self.conversations < 0:
            raise ValueError(f"heldout_set.conversations is {self.conversations}: it must be >= 0")
        for key in ("max_tokens", "answer_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"heldout_set.{key} is {getattr(self, key)}: it must be positive")


@dataclasses.dataclass(frozen=True)
class DumpHeldout:
    """Which of a dump's samples are held out: those the trainer's rule holds out, and those of the
    conversations read past max_samples for the held-out set. A plain picklable value."""

    rule: Callable[[str], bool]         # the trainer's rule on sample ids (data/split.py held_out_by)
    key: Callable[[str], str]           # sample id -> its conversation (data/split.py split_key_for)
    past_cap: frozenset[str]            # conversations read past max_samples for the set

    def __call__(self, sample_id: str) -> bool:
        return self.rule(sample_id) or self.key(sample_id) in self.past_cap


def dump_conversations(data: Mapping[str, Any], split: str, held_out: Callable[[str], bool],
                       heldout_set: HeldoutSet, stats: ReadStats | None = None) -> Iterator[Conversation]:
    """The conversations a dump of `data` (a conf/data node) writes, in a fixed order: the data's
    own, a conversation `held_out` by its first part only; then the first parts of conversations
    the data's own read did not reach, picked with the data's select share, until
    `heldout_set.conversations` are held out. `held_out`: the trainer's predicate on sample ids
    (data/split.py held_out_by)."""
    return (conversation for conversation, _ in _tagged(data, split, held_out, heldout_set, stats))


def dump_heldout(data: Mapping[str, Any], split: str, held_out: Callable[[str], bool],
                 heldout_set: HeldoutSet, stats: ReadStats | None = None) -> DumpHeldout:
    """The held-out predicate of the dump `dump_conversations` describes; reads the data through once."""
    key = split_key_for(data["format"])
    past_cap = frozenset(key(c.id) for c, read_on in _tagged(data, split, held_out, heldout_set, stats) if read_on)
    return DumpHeldout(held_out, key, past_cap)


def _tagged(data: Mapping[str, Any], split: str, held_out: Callable[[str], bool], heldout_set: HeldoutSet,
            stats: ReadStats | None) -> Iterator[tuple[Conversation, bool]]:
    """(conversation, read past max_samples for the held-out set) in dump order."""
    key = split_key_for(data["format"])
    seen: set[str] = set()          # every conversation the data's own read reached
    held: set[str] = set()          # conversations with a part in the held-out set
    for conversation in load_conversations(data, split, stats):
        k = key(conversation.id)
        seen.add(k)
        if held_out(conversation.id):
            if k in held:
                continue            # a later part: neither trained on (it would leak) nor held out
            held.add(k)
        yield conversation, False
    missing = heldout_set.conversations - len(held)
    if missing <= 0 or data["max_samples"] is None:   # no cap: every conversation is in already
        return

    def first_parts() -> Iterator[Conversation]:
        # The whole split in file order, less what the data's own read reached (any of its parts:
        # a conversation partly trained on is no held-out text).
        for conversation in load_conversations({**data, "max_samples": None, "select": None}, split):
            k = key(conversation.id)
            if k not in seen:
                seen.add(k)
                yield conversation

    select = data["select"]
    more = (itertools.islice(first_parts(), missing) if select is None
            else select_share(first_parts(), select["pattern"], select["share"], missing))
    for conversation in more:
        yield conversation, True
