"""Let the verifier answer each user turn itself, so the draft learns the verifier's own text.

Turn by turn: round k asks the verifier for the k-th assistant turn of every conversation in
the batch (one engine call per round), given the conversation so far with the answers it
already regenerated. Each request carries a seed derived from the sample id, so a resumed dump
regenerates exactly what an uninterrupted one would have.

turns: all answers every user turn in order (rounds wait for the longest answer of the batch,
so a batch takes as many generate calls as its longest conversation has turns); first answers
only the first user turn and drops the rest of the conversation: one generate call per batch.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from data.conversations import Conversation, Message
from data.template import as_chat, prompt_ids
from dump.engine import generate_together


def sample_seed(sample_id: str, base_seed: int) -> int:
    digest = hashlib.sha256(f"{base_seed}\0{sample_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def regenerate(llm, tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Conversation],
               cfg: DictConfig, end_of_turn: str, max_len: int) -> list[Conversation]:
    """The same conversations with every assistant turn rewritten by the verifier."""
    from vllm import SamplingParams, TokensPrompt

    stop = [tokenizer.convert_tokens_to_ids(end_of_turn)]
    done: list[list[Message]] = [[] for _ in conversations]
    pending = [list(c.messages) for c in conversations]
    n_rounds = max(sum(m.role == "assistant" for m in c.messages) for c in conversations)
    if cfg.turns == "first":
        n_rounds = min(n_rounds, 1)
    for _ in range(n_rounds):
        requests, owners = [], []
        for i, messages in enumerate(pending):
            # Carry over everything up to (not including) the next assistant turn.
            while messages and messages[0].role != "assistant":
                done[i].append(messages.pop(0))
            if not messages:
                continue
            messages.pop(0)  # the original answer, replaced below
            ids = prompt_ids(tokenizer, as_chat(dataclasses.replace(conversations[i],
                                                                    messages=tuple(done[i]))))
            if len(ids) >= max_len:  # no room left to answer: the conversation ends here
                pending[i] = []
                continue
            requests.append(TokensPrompt(prompt_token_ids=ids))
            owners.append((i, SamplingParams(
                temperature=cfg.temperature, top_p=cfg.top_p, seed=sample_seed(
                    conversations[i].id, cfg.seed) + len(done[i]),
                max_tokens=min(cfg.max_tokens, max_len - len(ids)), stop_token_ids=stop)))
        if not requests:
            break
        outputs = generate_together(llm, requests, [p for _, p in owners])
        for (i, _), out in zip(owners, outputs):
            text = tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
            done[i].append(Message("assistant", text))
    return [dataclasses.replace(c, messages=tuple(_trim_to_last_answer(m)))
            for c, m in zip(conversations, done)]


def _trim_to_last_answer(messages: list[Message]) -> list[Message]:
    """Drop trailing user turns left unanswered (their answer no longer fit)."""
    while messages and messages[-1].role != "assistant":
        messages = messages[:-1]
    return messages
