"""Which samples are held out: a pure function of (seed, conversation id), so every stage, rank
and resumed run agrees without a list. The data split (conf/data: heldout_fraction, split_seed)
picks the conversations a `make dump` train-split store never contains; the trainer's split
(conf/heldout_split) picks, among a store's samples, those it evaluates on and never trains on, which the
dump writes to shards of their own.

A sampled copy of a conversation (the dump's regenerate.sampled_share: the same conversation answered
again by sampling, under the id `<id>~sampled`) is split with the conversation it copies.
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable


def is_held_out(sample_id: str, fraction: float, seed: int = 0) -> bool:
    """Whether a sample belongs to the held-out split: a pure function of (seed, id)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1], got {fraction}")
    digest = hashlib.sha256(f"{seed}\0{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


SAMPLED_COPY = "~sampled"


def sampled_copy_id(sample_id: str) -> str:
    """The id of the sampled copy of sample `sample_id`."""
    return sample_id + SAMPLED_COPY


def is_sampled_copy(sample_id: str) -> bool:
    return sample_id.endswith(SAMPLED_COPY)


def split_key_for(data_format: str | None) -> Callable[[str], str]:
    """Sample id -> the conversation the trainer's held-out split decides by, for data of
    conf/data's `format`: ShareGPT parts "id_3" count as "id"; other formats by the id itself;
    a sampled copy as the sample it copies."""
    return sharegpt_split_key if data_format == "sharegpt" else copied_from


def copied_from(sample_id: str) -> str:
    """The sample a sampled copy copies; any other id as it is."""
    return sample_id.removesuffix(SAMPLED_COPY)


def held_out_by(fraction: float, seed: int, data_format: str | None) -> Callable[[str], bool]:
    """The trainer's held-out rule (conf/heldout_split) as a predicate on sample ids; a plain picklable
    value, so the dump's writer and the trainer's split apply one function."""
    return functools.partial(_is_held_out_sample, fraction=fraction, seed=seed, key=split_key_for(data_format))


def _is_held_out_sample(sample_id: str, fraction: float, seed: int, key: Callable[[str], str]) -> bool:
    return is_held_out(key(sample_id), fraction, seed)


def sharegpt_split_key(sample_id: str) -> str:
    """The conversation a ShareGPT sample was cut from: "QWJhYvA_3" -> "QWJhYvA".

    The packaged file splits long conversations into numbered parts; splitting by the
    whole id would put parts of one conversation on both sides and leak training text
    into the held-out set.
    """
    base, sep, part = copied_from(sample_id).rpartition("_")
    return base if sep and base and part.isdigit() else copied_from(sample_id)
