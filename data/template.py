"""Conversations -> token ids and loss masks through the verifier's own chat template.

Loss-mask convention (the one this project stores): loss_mask[t] = 1 iff token t was written by
the assistant, i.e. the tokens of an assistant turn's content and its closing <|im_end|>; role
headers (<|im_assistant|>assistant<|im_middle|>), system and user turns are 0. The template marks
these tokens itself with a `{% generation %}` block, so there is one definition of "assistant
token" and it lives with the chat format. How the trainer shifts the mask is the trainer's
business (train/objective.py states the alignment).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from data.conversations import Conversation
from data.records import Origin
from data.rejection import Rejection, RejectionKind

OverLong = Literal["truncate", "drop"]


@dataclass(frozen=True)
class TokenizedSample:
    id: str
    category: str
    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] bool
    origin: Origin | None = None  # the record's file and line (Conversation.origin)


class SampleRejected(ValueError):
    """A conversation that cannot become a training sample; `rejection` is its record (kind,
    sample, reason, origin), which the store keeps and the dump's summary counts by kind. The
    message is the record's: it names the sample and the record it came from."""

    def __init__(self, conv: Conversation, kind: RejectionKind, detail: str) -> None:
        self.rejection = Rejection(kind, conv.id, detail, conv.origin)
        super().__init__(str(self.rejection))

    @property
    def kind(self) -> RejectionKind:
        return self.rejection.kind


def as_chat(conv: Conversation) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in conv.messages]


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, conv: Conversation, max_len: int,
                          over_long: OverLong) -> TokenizedSample:
    """Render `conv` with the chat template; mark assistant tokens; apply the over-long policy."""
    if not any(m.role == "assistant" for m in conv.messages):
        # Regeneration can leave nothing to learn from (no answer fitted in max_len).
        raise SampleRejected(conv, RejectionKind.NO_ASSISTANT_TURN, "no assistant turn")
    try:
        out = tokenizer.apply_chat_template(as_chat(conv), tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    except TemplateError as err:
        # A template's raise_exception refuses what its format cannot express; that is this
        # conversation's problem, not a reason to stop the dump.
        raise SampleRejected(conv, RejectionKind.CHAT_TEMPLATE, f"chat template failed: {err}") from None
    ids = np.asarray(out["input_ids"], dtype=np.int32)
    mask = np.asarray(out["assistant_masks"], dtype=bool)
    if len(ids) > max_len:
        if over_long == "drop":
            raise SampleRejected(conv, RejectionKind.OVER_LONG, f"{len(ids)} tokens > max_len {max_len}")
        ids, mask = ids[:max_len], mask[:max_len]
    if not mask.any():
        raise SampleRejected(conv, RejectionKind.NO_ASSISTANT_TOKEN,
                             f"no assistant token within {max_len} tokens")
    return TokenizedSample(conv.id, conv.category, ids, mask, conv.origin)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation prefix ending in the assistant header, ready to generate."""
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
