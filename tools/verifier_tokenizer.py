"""A byte-level BPE tokenizer with Kimi's control tokens and chat template, trained from text."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from data.template import chat_format_template


def train_tokenizer(texts: Iterable[str], vocab_size: int,
                    special_tokens: Sequence[str]) -> PreTrainedTokenizerFast:
    """Train BPE merges on `texts`; special tokens get ids 0..len(special_tokens)-1."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    # Byte-level: every string is representable, so the model never sees an unknown token.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens, config asks {vocab_size}: "
                         "give it more training text")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="[BOS]",
        eos_token="[EOS]",
        pad_token="[PAD]",
        unk_token="[UNK]",
        chat_template=chat_format_template("kimi"),
        model_max_length=None,
        clean_up_tokenization_spaces=False,
    )
