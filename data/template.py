"""Conversations -> token ids and loss masks through the verifier's own chat template.

Loss-mask convention (the one this project stores): loss_mask[t] = 1 iff token t was written by
the assistant, i.e. the tokens of an assistant turn's content and its closing <|im_end|>; role
headers (<|im_assistant|>assistant<|im_middle|>), system and user turns are 0. The template marks
these tokens itself with a `{% generation %}` block, so there is one definition of "assistant
token" and it lives with the chat format. How the trainer shifts the mask is the trainer's
business (train/objective.py states the alignment).

Which template marks them (`marked_template`): the verifier folder's own when it has generation
markers (kimi-tiny's does); else the project's template of the verifier's chat format
(data/chat_formats/<verifier.chat_format>.jinja), once it has been seen to render the same text as
the folder's on probe conversations. A real Kimi folder's template has no markers, and without
them every assistant mask is empty. The mask comes from the tokenizer's character offsets where it
has them (a fast tokenizer); a Python tokenizer (Kimi's tiktoken one) has none, so the rendered text
is tokenized piece by piece, marked and unmarked, and the pieces must add up to the ids of the whole.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Literal

import numpy as np
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from data.conversations import Conversation
from data.records import Origin
from data.rejection import Rejection, RejectionKind

OverLong = Literal["truncate", "drop"]
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Conversations the two templates must render alike before the project's marks the folder's text.
PROBES: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello! How can I help?"}),
    ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"},
     {"role": "assistant", "content": "6\n```py\nprint(6)\n```"}),
)


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


def chat_format_template(chat_format: str) -> str:
    """The project's template of a chat format (data/chat_formats/<chat_format>.jinja), with
    generation markers around what the assistant writes."""
    path = resources.files("data") / "chat_formats" / f"{chat_format}.jinja"
    if not path.is_file():
        known = sorted(p.name.removesuffix(".jinja") for p in (resources.files("data") / "chat_formats").iterdir()
                       if p.name.endswith(".jinja"))
        raise ValueError(f"verifier.chat_format={chat_format!r}: no such chat format (known: {', '.join(known)})")
    return path.read_text()


def marked_template(tokenizer: PreTrainedTokenizerBase, chat_format: str | None, where: str = "the verifier") -> str:
    """The template whose generation markers give the loss mask: the folder's own if it has them,
    else the chat format's, refused unless it renders the PROBES as the folder's template does."""
    own = tokenizer.chat_template
    if isinstance(own, str) and GENERATION_MARK.search(own):
        return own
    if chat_format is None:
        raise ValueError(f"{where}'s chat template has no {{% generation %}} markers and no chat format is "
                         "named to mark the assistant's tokens (verifier.chat_format)")
    marked = chat_format_template(chat_format)
    if own is None:
        return marked
    for probe in PROBES:
        for prompt in (False, True):
            messages = list(probe[:-1] if prompt else probe)
            theirs = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            ours = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt,
                                                 chat_template=marked)
            if theirs != ours:
                at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
                raise ValueError(
                    f"{where}'s chat template has no {{% generation %}} markers, and the template of "
                    f"verifier.chat_format={chat_format!r} (data/chat_formats/{chat_format}.jinja) renders "
                    f"conversations differently, from character {at}: {theirs[at:at + 40]!r} there, "
                    f"{ours[at:at + 40]!r} here; the loss masks would mark the wrong tokens. Give the "
                    "folder a template with generation markers, or name the chat format it follows")
    return marked


def as_chat(conv: Conversation) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in conv.messages]


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, conv: Conversation, max_len: int,
                          over_long: OverLong) -> TokenizedSample:
    """Render `conv` with the chat template; mark assistant tokens; apply the over-long policy."""
    if not any(m.role == "assistant" for m in conv.messages):
        # Regeneration can leave nothing to learn from (no answer fitted in max_len).
        raise SampleRejected(conv, RejectionKind.NO_ASSISTANT_TURN, "no assistant turn")
    try:
        if tokenizer.is_fast:
            out = tokenizer.apply_chat_template(as_chat(conv), tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            ids_list, mask_list = out["input_ids"], out["assistant_masks"]
        else:
            ids_list, mask_list = _marked_pieces(tokenizer, conv)
    except TemplateError as err:
        # A template's raise_exception refuses what its format cannot express; that is this
        # conversation's problem, not a reason to stop the dump.
        raise SampleRejected(conv, RejectionKind.CHAT_TEMPLATE, f"chat template failed: {err}") from None
    ids = np.asarray(ids_list, dtype=np.int32)
    mask = np.asarray(mask_list, dtype=bool)
    if len(ids) > max_len:
        if over_long == "drop":
            raise SampleRejected(conv, RejectionKind.OVER_LONG, f"{len(ids)} tokens > max_len {max_len}")
        ids, mask = ids[:max_len], mask[:max_len]
    if not mask.any():
        raise SampleRejected(conv, RejectionKind.NO_ASSISTANT_TOKEN,
                             f"no assistant token within {max_len} tokens")
    return TokenizedSample(conv.id, conv.category, ids, mask, conv.origin)


def _marked_pieces(tokenizer: PreTrainedTokenizerBase, conv: Conversation) -> tuple[list[int], list[bool]]:
    """Ids and assistant mask of a tokenizer without character offsets: the rendered text cut at
    the generation markers' spans, each piece tokenized alone. Refused when the pieces' ids are
    not the whole text's (a marker inside what the tokenizer would merge across)."""
    texts, spans = render_jinja_template([as_chat(conv)], chat_template=tokenizer.chat_template,
                                         return_assistant_tokens_mask=True, **tokenizer.special_tokens_map)
    text = texts[0]
    ids: list[int] = []
    mask: list[bool] = []
    at = 0
    for start, end in [*spans[0], (len(text), len(text))]:
        for piece, marked in ((text[at:start], False), (text[start:end], True)):
            if piece:
                new = tokenizer.encode(piece, add_special_tokens=False)
                ids += new
                mask += [marked] * len(new)
        at = end
    if ids != tokenizer.encode(text, add_special_tokens=False):
        raise SampleRejected(conv, RejectionKind.CHAT_TEMPLATE,
                             "the chat template's generation markers do not fall on token boundaries")
    return ids, mask


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation prefix ending in the assistant header, ready to generate."""
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
