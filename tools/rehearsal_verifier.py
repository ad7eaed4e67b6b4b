"""`python -m tools.rehearsal_verifier [OUT] [--verifier NAME] [--seed S]`: a checkpoint folder shaped
like a real Kimi-K2 one, made from a seed in minutes, for rehearsing a cluster run on one machine.

What it holds is what a published Kimi-K2 folder holds, at the widths of conf/verifier/<NAME>.yaml
(default kimi_k2_rehearsal: Kimi-K2's every width, fewer layers and experts):

- config.json: `model_type: kimi_k2`, every architecture field of the verifier conf, the legacy
  `rope_scaling` / `rope_theta` keys a Kimi folder writes, and an `auto_map` naming the folder's own
  configuration module (transformers does not know kimi_k2; vLLM maps it to DeepSeek-V3);
- random bf16 weights at the architecture's init scale (normal(0, initializer_range) matrices,
  unit norms, zero router bias in fp32), in DeepSeek-V3's tensor names, sharded over several
  safetensors files with model.safetensors.index.json;
- Kimi's tokenizer conventions: no tokenizer.json, but `tiktoken.model` (mergeable ranks) and
  `tokenization_kimi.py`, named in tokenizer_config.json's auto_map, so it loads only with
  trust_remote_code; the ranks are byte-level BPE merges trained on ShareGPT text (as many as the
  vocabulary leaves after its 256 special tokens, which sit at the top ids with Kimi's names);
  Kimi's chat template (without generation markers) in chat_template.jinja;
- generation_config.json (ends on <|im_end|>).

The folder is written under a staging name and renamed into place, never shipped in the repository
(default: runs/rehearsal/<verifier name>). The same builder makes the small folder the tests use
(tests/kimi_folder.py), at kimi-tiny's widths.
"""
from __future__ import annotations

import argparse
import base64
import json
import math
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import infra

infra.configure_environment()

import torch  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

TEMPLATES = Path(__file__).with_name("kimi_folder")
REMOTE_FILES = ("tokenization_kimi.py", "configuration_deepseek.py", "chat_template.jinja")
NUM_SPECIAL = 256
INDEX_FILE = "model.safetensors.index.json"

# Kimi-K2's named special tokens, by offset above the mergeable ranks (163,584 in Kimi-K2: [BOS] is
# 163,584, <|im_end|> 163,586, [PAD] 163,839); the other offsets are <|reserved_token_i|>.
SPECIAL_TOKENS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                  6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                  11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
                  13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
                  17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: str            # normal | ones | zeros
    dtype: torch.dtype = torch.bfloat16

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


# ---- the weights -------------------------------------------------------------------------------
def tensor_specs(arch: Mapping[str, Any]) -> list[TensorSpec]:
    """DeepSeek-V3's tensors (names as in its checkpoints and vLLM's loader), in file order."""
    H, V = arch["hidden_size"], arch["vocab_size"]
    heads, nope, rope, v = (arch[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                              "v_head_dim"))
    q_lora, kv_lora = arch["q_lora_rank"], arch["kv_lora_rank"]
    specs = [TensorSpec("model.embed_tokens.weight", (V, H), "normal")]
    for i in range(arch["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [TensorSpec(p + "input_layernorm.weight", (H,), "ones"),
                  TensorSpec(p + "post_attention_layernorm.weight", (H,), "ones")]
        a = p + "self_attn."
        if q_lora is None:
            specs.append(TensorSpec(a + "q_proj.weight", (heads * (nope + rope), H), "normal"))
        else:
            specs += [TensorSpec(a + "q_a_proj.weight", (q_lora, H), "normal"),
                      TensorSpec(a + "q_a_layernorm.weight", (q_lora,), "ones"),
                      TensorSpec(a + "q_b_proj.weight", (heads * (nope + rope), q_lora), "normal")]
        specs += [TensorSpec(a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, H), "normal"),
                  TensorSpec(a + "kv_a_layernorm.weight", (kv_lora,), "ones"),
                  TensorSpec(a + "kv_b_proj.weight", (heads * (nope + v), kv_lora), "normal"),
                  TensorSpec(a + "o_proj.weight", (H, heads * v), "normal")]
        m = p + "mlp."
        if i < arch["first_k_dense_replace"]:
            specs += _swiglu(m, H, arch["intermediate_size"])
            continue
        experts = arch["n_routed_experts"]
        specs += [TensorSpec(m + "gate.weight", (experts, H), "normal"),
                  TensorSpec(m + "gate.e_score_correction_bias", (experts,), "zeros", torch.float32)]
        for e in range(experts):
            specs += _swiglu(f"{m}experts.{e}.", H, arch["moe_intermediate_size"])
        specs += _swiglu(m + "shared_experts.", H, arch["moe_intermediate_size"] * arch["n_shared_experts"])
    specs += [TensorSpec("model.norm.weight", (H,), "ones"), TensorSpec("lm_head.weight", (V, H), "normal")]
    return specs


def _swiglu(prefix: str, hidden: int, inner: int) -> list[TensorSpec]:
    return [TensorSpec(prefix + "gate_proj.weight", (inner, hidden), "normal"),
            TensorSpec(prefix + "up_proj.weight", (inner, hidden), "normal"),
            TensorSpec(prefix + "down_proj.weight", (hidden, inner), "normal")]


def make_tensor(spec: TensorSpec, std: float, generator: torch.Generator) -> torch.Tensor:
    """The tensor, drawn in row blocks so that a 163,840-row matrix never exists in fp32 whole."""
    if spec.init != "normal":
        return (torch.ones if spec.init == "ones" else torch.zeros)(spec.shape, dtype=spec.dtype)
    out = torch.empty(spec.shape, dtype=spec.dtype)
    rows_per_block = max(1, (64 << 20) // (4 * math.prod(spec.shape[1:])))
    for start in range(0, spec.shape[0], rows_per_block):
        block = out[start:start + rows_per_block]
        block.copy_(torch.randn(block.shape, generator=generator) * std)
    return out


def file_groups(specs: Iterable[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors in files of at most max_bytes (a larger tensor alone)."""
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if groups[-1] and size + spec.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    return groups


def write_weights(folder: Path, arch: Mapping[str, Any], seed: int, max_file_bytes: int) -> dict[str, Any]:
    """The sharded safetensors files and their index; one file's tensors in memory at a time."""
    generator = torch.Generator().manual_seed(seed)
    std = float(arch.get("initializer_range", 0.02))
    groups = file_groups(tensor_specs(arch), max_file_bytes)
    weight_map, total = {}, 0
    for n, group in enumerate(groups, 1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        tensors = {spec.name: make_tensor(spec, std, generator) for spec in group}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        (folder / name).chmod(0o644)          # safetensors writes 0600; a shared filesystem's readers need more
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        print(f"  {name}: {len(tensors)} tensors", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return {"files": len(groups), "bytes": total,
            "parameters": sum(math.prod(s.shape) for g in groups for s in g)}


# ---- the tokenizer -----------------------------------------------------------------------------
def train_ranks(texts: Iterable[str], n_ranks: int) -> list[bytes]:
    """n_ranks byte strings in rank order: the 256 single bytes, then byte-level BPE merges learned
    on `texts` (each merge after its two parts, as tiktoken's BPE needs)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tools.kimi_folder.tokenization_kimi import byte_to_char, char_to_byte

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=n_ranks, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != n_ranks:
        raise ValueError(f"the BPE merges of the training text give {tok.get_vocab_size()} tokens, the "
                         f"vocabulary needs {n_ranks} besides its {NUM_SPECIAL} special tokens: give it "
                         "more text (--conversations)")
    to_byte = char_to_byte()
    learned = [bytes(to_byte[c] for c in token) for token, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    singles = [bytes([b]) for b in sorted(byte_to_char())]
    merges = [t for t in learned if len(t) > 1]
    ranks = singles + merges
    if len(set(ranks)) != n_ranks:
        raise ValueError(f"{n_ranks - len(set(ranks))} repeated tokens among the learned ranks")
    return ranks


def special_tokens(n_ranks: int) -> dict[int, str]:
    """Id -> text of the 256 special tokens above the ranks (Kimi's names; the rest reserved)."""
    return {n_ranks + i: SPECIAL_TOKENS.get(i, f"<|reserved_token_{i}|>") for i in range(NUM_SPECIAL)}


def write_tokenizer(folder: Path, ranks: list[bytes], max_len: int) -> dict[str, int]:
    """tiktoken.model, the remote tokenization module, tokenizer_config.json, the chat template;
    returns the ids config.json names."""
    with open(folder / "tiktoken.model", "w") as f:
        for rank, token in enumerate(ranks):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    for name in REMOTE_FILES:
        shutil.copyfile(TEMPLATES / name, folder / name)
    specials = special_tokens(len(ranks))
    named = [text for text in specials.values() if not text.startswith("<|reserved_token_")]
    config = {
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "additional_special_tokens": [t for t in named if t not in ("[BOS]", "[EOS]", "[UNK]", "[PAD]")],
        "added_tokens_decoder": {str(i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, text in specials.items()},
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    by_text = {text: i for i, text in specials.items()}
    return {"bos_token_id": by_text["[BOS]"], "eos_token_id": by_text["[EOS]"],
            "pad_token_id": by_text["[PAD]"], "im_end": by_text["<|im_end|>"]}


# ---- config.json -------------------------------------------------------------------------------
def hf_config(arch: Mapping[str, Any], ids: Mapping[str, int]) -> dict[str, Any]:
    """config.json as a Kimi-K2 folder writes it: transformers 4.x keys (rope_scaling, rope_theta)."""
    arch = dict(arch)
    rope = dict(arch.pop("rope_parameters"))
    theta = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    arch.pop("model_type")
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
        "model_type": "kimi_k2",
        **arch,
        "rope_scaling": rope,
        "rope_theta": theta,
        "initializer_range": arch.get("initializer_range", 0.02),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": 0,
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["eos_token_id"],
        "pad_token_id": ids["pad_token_id"],
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


# ---- the folder --------------------------------------------------------------------------------
def build_folder(verifier: DictConfig, out: Path, texts: Iterable[str], seed: int = 0,
                 max_file_bytes: int = 2 << 30) -> dict[str, Any]:
    """Write the Kimi-shaped folder of the conf/verifier node `verifier` to `out` (replacing it)."""
    arch = OmegaConf.to_container(verifier.architecture, resolve=True)
    assert isinstance(arch, dict)
    staging = out.with_name(out.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    began = time.time()
    ranks = train_ranks(texts, arch["vocab_size"] - NUM_SPECIAL)
    tokenizer_s = time.time() - began
    ids = write_tokenizer(staging, ranks, int(arch["max_position_embeddings"]))
    (staging / "config.json").write_text(json.dumps(hf_config(arch, ids), indent=2) + "\n")
    generation = {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["im_end"],
                  "pad_token_id": ids["pad_token_id"], "max_length": int(arch["max_position_embeddings"])}
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    weights = write_weights(staging, arch, seed, max_file_bytes)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return {"folder": str(out), "seed": seed, "tokenizer_s": tokenizer_s, "wall_s": time.time() - began,
            **weights}


def training_texts(conversations: int) -> Iterator[str]:
    """The message texts of the first `conversations` ShareGPT training conversations (conf/data/sharegpt)."""
    from config import compose_config
    from data.conversations import load_conversations

    data = compose_config("dump", ["data=sharegpt"]).data
    for conv in islice(load_conversations(data, "train"), conversations):
        for message in conv.messages:
            yield message.content


def main(argv: list[str] | None = None) -> int:
    from config import ConfigError, compose_config

    parser = argparse.ArgumentParser(prog="python -m tools.rehearsal_verifier", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="the folder to write (default: runs/rehearsal/<verifier name>)")
    parser.add_argument("--verifier", default="kimi_k2_rehearsal", help="a conf/verifier option (its widths)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--conversations", type=int, default=20000,
                        help="ShareGPT conversations whose text trains the BPE ranks")
    parser.add_argument("--file-gib", type=float, default=2.0, help="largest safetensors file, GiB")
    args = parser.parse_args(argv)
    try:
        verifier = compose_config("dump", [f"verifier={args.verifier}"]).verifier
    except ConfigError as error:
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 2
    out = infra.resolve(args.out or f"runs/rehearsal/{verifier.name}")
    facts = build_folder(verifier, out, training_texts(args.conversations), args.seed, int(args.file_gib * 2**30))
    print(json.dumps(facts, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
