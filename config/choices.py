"""The config's named choices, one StrEnum each: the schema classes (config/groups.py,
config/stages.py) type a key with one, so OmegaConf refuses any other value at composition, naming
the key and the choices, before any stage starts.

A member's name is its value (OmegaConf reads a choice by name), and a StrEnum member is a str:
code compares it with the plain name (`cfg.regenerate.turns == "first"`), formats it as that name
and writes it to JSON as that name. Code that is handed a value by hand (a test, a tool) converts
it with `Choice(value)`, which raises ValueError naming the choice.
"""
from __future__ import annotations

from enum import StrEnum


def names(choice: type[StrEnum]) -> tuple[str, ...]:
    """The values of a choice, in order (for messages and membership tests of plain strings)."""
    return tuple(member.value for member in choice)


class Turns(StrEnum):
    """regenerate.turns: which assistant turns the verifier rewrites."""
    all = "all"                 # every assistant turn, in order
    first = "first"             # the first answer only; later turns dropped


class DecodeDtype(StrEnum):
    """The dtype a verifier engine decodes in (dump/engine.py decode_dtype): the dump's
    regenerate.dtype, the evaluation's decode_dtype."""
    engine = "engine"           # conf/engine's dtype (the capture engine's): one engine does both
    auto = "auto"               # bfloat16 where it runs natively (a GPU, a CPU with bf16 units), else engine
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Split(StrEnum):
    """The dump's split and an eval category's: conf/data's held-out rule by sample id."""
    train = "train"
    heldout = "heldout"
    all = "all"


class OverLong(StrEnum):
    """over_long: what the dump does with a sample past max_len."""
    truncate = "truncate"
    drop = "drop"


OnError = StrEnum("OnError", ["raise", "skip"])   # data.on_error (`raise` is a keyword: functional form)
OnError.__doc__ = "data.on_error: a malformed record stops the read (raise) or is counted and passed over."


class DataFormat(StrEnum):
    """data.format: how a conversation file is read (auto: by its first record)."""
    auto = "auto"
    sharegpt = "sharegpt"
    messages = "messages"
    humaneval = "humaneval"


class Precision(StrEnum):
    """train.precision: auto is bf16 on accelerators and on CPUs with bf16 units, else fp32."""
    auto = "auto"
    bf16 = "bf16"
    fp32 = "fp32"


class ExportDtype(StrEnum):
    """train.export_dtype: the exported draft's tensors (torch dtype names)."""
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Acceptance(StrEnum):
    """train.loss.acceptance (or null): the acceptance term beside the soft cross-entropy."""
    tv = "tv"                   # 1 - sum_v min(p, q)
    lk = "lk"                   # -log sum_v min(p, q)
    hybrid = "hybrid"           # lambda CE + (1 - lambda) TV, lambda = exp(-eta alpha)


class DraftSample(StrEnum):
    """The evaluation's draft_sample (vLLM's draft_sample_method); auto: by the draft's vocabulary."""
    auto = "auto"
    greedy = "greedy"
    probabilistic = "probabilistic"


class AuxConvention(StrEnum):
    """verifier.aux_layer_ids are given as vLLM counts them, or as SGLang does (model/aux_ids.py)."""
    vllm = "vllm"
    sglang = "sglang"


class AuxCapture(StrEnum):
    """What the hidden state of an aux id is: residual_stream, the DeepSeek-V3 hidden + residual
    entering layer k (Kimi-K2, kimi-tiny); for Kimi-K3, whose blocks keep a prefix sum of their
    layers' outputs, prefix_only (that prefix sum: vLLM's default, what EAGLE-3 drafts are served
    with) or attn_res_stream (the AttnRes-mixed stream). A draft trained on one and served with
    another loses most of its acceptance, so a store records it."""
    residual_stream = "residual_stream"
    prefix_only = "prefix_only"
    attn_res_stream = "attn_res_stream"


class AuxEncoding(StrEnum):
    """store.aux: how aux states are stored (fp8: e4m3 with a scale per token; fp4: e2m1 with a
    scale per fp4_block values)."""
    bf16 = "bf16"
    fp32 = "fp32"
    fp8 = "fp8"
    fp4 = "fp4"


class FinalEncoding(StrEnum):
    """store.final: the final hidden states, or the verifier's top-k next tokens and log-probabilities."""
    bf16 = "bf16"
    fp32 = "fp32"
    topk = "topk"


class FinalRows(StrEnum):
    """store.final_rows: final states on every row, or only on rows whose next token is in the loss mask."""
    all = "all"
    loss = "loss"


class Attention(StrEnum):
    """draft.attention: the draft layer's attention while training (model/ttt_attention.py)."""
    ttt = "ttt"                 # the TTT-masked attention over the cached steps (fused CPU kernel where it runs)
    ttt_blocked = "ttt_blocked" # the same on plain-PyTorch query blocks everywhere (the GPU path)
    reference = "reference"     # the same attention written out plainly (tests compare the two)
