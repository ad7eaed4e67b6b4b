"""Let the verifier answer each user turn itself, so the draft learns the verifier's own text.

Turn by turn: round k asks the verifier for the k-th assistant turn of every conversation in
the batch (one engine call per round), given the conversation so far with the answers it
already regenerated. Each request carries a seed derived from the sample id, so a resumed dump
regenerates exactly what an uninterrupted one would have.

turns: all answers every user turn in order (rounds wait for the longest answer of the batch,
so a batch takes as many generate calls as its longest conversation has turns); first answers
only the first user turn and drops the rest of the conversation: one generate call per batch.

sampled_share: that share of the training conversations (picked by id, so a resumed or sharded dump
picks the same ones; held-out ones never) is answered a second time, at
sampled_temperature, as a sample of its own (data/split.py sampled_copy_id, split with the
conversation it copies): a draft served to sampling requests meets the verifier's sampled text, which
answers at a low temperature never show it. The originals keep their answers at `temperature`, and
the held-out metric stays on those.

Held-out conversations (the dump's, data/heldout_set.py DumpHeldout) are answered within the held-out
set's limits (conf/dump.yaml heldout_set): no token is decoded that the sample's cut to heldout_set.max_tokens
would drop, and an answer stops at heldout_set.answer_tokens.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence

from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from data.conversations import Conversation, Message
from data.heldout_set import HeldoutSet
from data.split import is_sampled_copy, sampled_copy_id
from data.template import as_chat, prompt_ids
from dump.engine import generate_together


def sample_seed(sample_id: str, base_seed: int) -> int:
    digest = hashlib.sha256(f"{base_seed}\0{sample_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def gets_sampled_copy(sample_id: str, cfg: DictConfig, heldout: Callable[[str], bool] | None = None) -> bool:
    """Whether this conversation is also answered at sampled_temperature (see sampled_share above)."""
    if cfg.sampled_share <= 0 or (heldout is not None and heldout(sample_id)):
        return False
    return sample_seed(f"sampled\0{sample_id}", cfg.seed) / 2**32 < cfg.sampled_share   # its own stream


def with_sampled_copies(conversations: Sequence[Conversation], cfg: DictConfig,
                        heldout: Callable[[str], bool] | None = None) -> list[Conversation]:
    """The conversations, then the sampled copies of those picked, in the same order."""
    copies = [dataclasses.replace(c, id=sampled_copy_id(c.id)) for c in conversations
              if gets_sampled_copy(c.id, cfg, heldout)]
    return list(conversations) + copies


def regenerate(llm, tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Conversation],
               cfg: DictConfig, end_of_turn: str, max_len: int,
               heldout: Callable[[str], bool] | None = None,
               heldout_set: HeldoutSet | None = None) -> list[Conversation]:
    """The same conversations with every assistant turn rewritten by the verifier, followed by the
    sampled copies of those sampled_share picks. `heldout`: the held-out conversations
    (data/heldout_set.py DumpHeldout), which get no sampled copy and, given `heldout_set`, are answered
    within its limits."""
    from vllm import SamplingParams, TokensPrompt

    conversations = with_sampled_copies(conversations, cfg, heldout)
    limits = [_limits(c.id, cfg, max_len, heldout, heldout_set) for c in conversations]
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
            sample_len, answer_len = limits[i]
            if len(ids) >= sample_len:  # no room left to answer: the conversation ends here
                pending[i] = []
                continue
            requests.append(TokensPrompt(prompt_token_ids=ids))
            owners.append((i, SamplingParams(
                temperature=cfg.sampled_temperature if is_sampled_copy(conversations[i].id) else cfg.temperature,
                top_p=cfg.top_p, seed=sample_seed(
                    conversations[i].id, cfg.seed) + len(done[i]),
                max_tokens=min(answer_len, sample_len - len(ids)), stop_token_ids=stop)))
        if not requests:
            break
        outputs = generate_together(llm, requests, [p for _, p in owners])
        for (i, _), out in zip(owners, outputs):
            text = tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
            done[i].append(Message("assistant", text))
    return [dataclasses.replace(c, messages=tuple(_trim_to_last_answer(m)))
            for c, m in zip(conversations, done)]


def _limits(sample_id: str, cfg: DictConfig, max_len: int, heldout: Callable[[str], bool] | None,
            heldout_set: HeldoutSet | None) -> tuple[int, int]:
    """(tokens of the sample, tokens of one answer) the verifier may fill for this conversation."""
    if heldout_set is not None and heldout is not None and heldout(sample_id):
        return min(max_len, heldout_set.max_tokens), min(cfg.max_tokens, heldout_set.answer_tokens)
    return max_len, cfg.max_tokens


def _trim_to_last_answer(messages: list[Message]) -> list[Message]:
    """Drop trailing user turns left unanswered (their answer no longer fit)."""
    while messages and messages[-1].role != "assistant":
        messages = messages[:-1]
    return messages
