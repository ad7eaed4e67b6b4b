"""Kimi's tokenizer as its checkpoint folders ship it: remote code over tiktoken.

This file is copied into a Kimi-shaped checkpoint folder (tools/rehearsal_verifier.py) and loaded
from there by transformers' AutoTokenizer, which runs it only with trust_remote_code, as a real
Kimi folder's own tokenization module is. It is written for this project (transformers 5.x's
Python tokenizer backend), following the conventions of Kimi's: `tiktoken.model` holds the
mergeable ranks (one `<base64 bytes> <rank>` line per token), the pre-tokenizer splits Han runs
from other words, and the special tokens take the 256 ids above the ranks, named in
tokenizer_config.json's `added_tokens_decoder` (the unnamed ones are `<|reserved_token_i|>`).

Tokens are shown as byte-level strings (each byte one printable character, GPT-2's mapping), so
that vLLM's incremental detokenizer can join and decode them like any slow BPE tokenizer's.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import AddedToken, PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
NUM_RESERVED_SPECIAL_TOKENS = 256

# Han characters alone; other words with their leading punctuation and English contractions;
# up to three digits; punctuation runs; newlines; other whitespace.
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


@lru_cache(maxsize=1)
def byte_to_char() -> dict[int, str]:
    """Each byte as one printable character (GPT-2's byte-level alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@lru_cache(maxsize=1)
def char_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_char().items()}


class TikTokenTokenizer(PreTrainedTokenizer):
    """tiktoken BPE over `tiktoken.model`; special tokens from tokenizer_config.json."""

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, bos_token: str = "[BOS]", eos_token: str = "[EOS]",
                 unk_token: str = "[UNK]", pad_token: str = "[PAD]",
                 added_tokens_decoder: dict[int, AddedToken] | None = None, **kwargs: Any) -> None:
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        self.num_base_tokens = len(ranks)
        named = {int(i): (t.content if isinstance(t, AddedToken) else str(t))
                 for i, t in (added_tokens_decoder or {}).items()}
        specials = {named.get(self.num_base_tokens + i, f"<|reserved_token_{i}|>"): self.num_base_tokens + i
                    for i in range(NUM_RESERVED_SPECIAL_TOKENS)}
        self.model = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=PAT_STR,
                                       mergeable_ranks=ranks, special_tokens=specials)
        chars = byte_to_char()
        self.encoder = {"".join(chars[b] for b in token): rank for token, rank in ranks.items()}
        self.decoder = {rank: token for token, rank in self.encoder.items()}
        self.special_tokens = specials
        decoder = {i: AddedToken(text, special=True, normalized=False) for text, i in specials.items()}
        decoder.update(added_tokens_decoder or {})
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=decoder, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return {**self.encoder, **self.special_tokens}

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        # The added tokens were split out before (PreTrainedTokenizer.tokenize): ordinary text only.
        return [self.decoder[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self.encoder.get(token, self.special_tokens[self.unk_token])

    def _convert_id_to_token(self, index: int) -> str:
        if index in self.decoder:
            return self.decoder[index]
        return self.model.decode_single_token_bytes(index).decode("utf-8", errors="replace")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        pieces, pending = [], bytearray()
        to_byte = char_to_byte()
        for token in tokens:
            if token in self.special_tokens:
                pieces.append(pending.decode("utf-8", errors="replace"))
                pending = bytearray()
                pieces.append(token)
            else:
                pending.extend(to_byte[c] for c in token)
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        import shutil

        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, out)
        return (out,)
