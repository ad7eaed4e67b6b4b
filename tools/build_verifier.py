"""`make verifier` (`python -m tools.build_verifier`): train kimi-tiny (tokenizer + DeepSeek-V3 model)
on ShareGPT and write its folder, model/verifier/kimi_tiny.

The folder (config.json, model.safetensors in bf16, tokenizer, generation_config.json, README.md
model card, training_log.json) is written to a staging folder and renamed into place at the end,
so an interrupted build never leaves a half-written verifier behind.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import config
import infra

infra.configure_environment()  # offline hubs, caches in the repo: before transformers loads below
config.register()              # the schemas conf/build_verifier.yaml is merged onto

import hydra  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from data.conversations import Conversation, ReadStats, load_conversations  # noqa: E402
from model.verifier import verifier_dir  # noqa: E402
from tools.verifier_card import write_model_card  # noqa: E402
from tools.verifier_tokenizer import train_tokenizer  # noqa: E402


def hf_config_dict(cfg: DictConfig) -> dict[str, Any]:
    """The verifier's architecture (conf/verifier `architecture`) as a Hugging Face config dict (the
    keys vLLM reads too)."""
    arch = OmegaConf.to_container(cfg.architecture, resolve=True)
    assert isinstance(arch, dict)
    return arch


def conversation_text(conv: Conversation) -> Iterator[str]:
    for message in conv.messages:
        yield message.content


def tokenize_until(tokenizer: PreTrainedTokenizerFast, conversations: Iterator[Conversation],
                   n_tokens: int, desc: str) -> torch.Tensor:
    """Render conversations in the chat format and concatenate their ids until n_tokens."""
    ids: list[int] = []
    with tqdm(total=n_tokens, desc=desc, unit="tok") as bar:
        for conv in conversations:
            text = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in conv.messages], tokenize=False)
            new = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids.extend(new)
            bar.update(len(new))
            if len(ids) >= n_tokens:
                break
    if len(ids) < n_tokens:
        raise ValueError(f"{desc}: the data holds only {len(ids)} tokens, {n_tokens} needed")
    return torch.tensor(ids[:n_tokens], dtype=torch.long)


def unigram_cross_entropy(train_ids: torch.Tensor, eval_ids: torch.Tensor, vocab: int) -> float:
    """Held-out cross-entropy (nats/token) of the add-one-smoothed unigram model of the train ids."""
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[eval_ids[1:]].mean())


def lr_at(step: int, cfg: DictConfig) -> float:
    """Linear warmup then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def heldout_windows(eval_ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """The held-out stream cut into windows of seq_len + 1 tokens, in batches of 8 windows."""
    windows = eval_ids[: (len(eval_ids) // (seq_len + 1)) * (seq_len + 1)].view(-1, seq_len + 1)
    return list(windows.split(8))


def batch_loss_sum(model: DeepseekV3ForCausalLM, batch: torch.Tensor, autocast: bool) -> float:
    """Summed next-token cross-entropy (nats) of one batch of windows."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=batch[:, :-1]).logits.float()
    return float(torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"))


def evaluate_sums(model: DeepseekV3ForCausalLM, eval_ids: torch.Tensor, seq_len: int,
                  autocast: bool) -> list[float]:
    """batch_loss_sum of every batch of heldout_windows, in order."""
    model.eval()
    with torch.no_grad():
        sums = [batch_loss_sum(model, batch, autocast) for batch in heldout_windows(eval_ids, seq_len)]
    model.train()
    return sums


def evaluate(model: DeepseekV3ForCausalLM, eval_ids: torch.Tensor, seq_len: int,
             autocast: bool) -> float:
    """Mean next-token cross-entropy (nats) over held-out windows of seq_len + 1 tokens."""
    return mean_loss(evaluate_sums(model, eval_ids, seq_len, autocast), eval_ids, seq_len)


def mean_loss(sums: list[float], eval_ids: torch.Tensor, seq_len: int) -> float:
    """Mean next-token cross-entropy (nats) of evaluate_sums' per-batch sums."""
    return sum(sums) / sum(batch[:, 1:].numel() for batch in heldout_windows(eval_ids, seq_len))


def train_model(model: DeepseekV3ForCausalLM, train_ids: torch.Tensor, eval_ids: torch.Tensor,
                cfg: DictConfig, seed: int, log: list[dict]) -> None:
    """Plain PyTorch pre-training on random windows of the packed token stream."""
    window = cfg.seq_len + 1
    n_windows = len(train_ids) // window
    windows = train_ids[: n_windows * window].view(n_windows, window)
    gen = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(n_windows, generator=gen)
                       for _ in range(math.ceil(cfg.steps * cfg.batch_size / n_windows))])
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=cfg.lr, betas=tuple(cfg.betas))
    model.train()
    start = time.time()
    bar = tqdm(range(cfg.steps), desc="train kimi-tiny", unit="step")
    for step in bar:
        batch = windows[order[step * cfg.batch_size:(step + 1) * cfg.batch_size]]
        for group in optim.param_groups:
            group["lr"] = lr_at(step, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"step {step}: loss is {loss.item()}")
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optim.step()
        optim.zero_grad(set_to_none=True)
        elapsed = time.time() - start
        tok_s = (step + 1) * batch[:, 1:].numel() / elapsed
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tok_s:.0f}")
        entry = {"step": step + 1, "loss": loss.item(), "lr": lr_at(step, cfg),
                 "grad_norm": float(grad_norm), "elapsed_s": elapsed}
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            entry["heldout_loss"] = evaluate(model, eval_ids, cfg.seq_len, cfg.bf16_autocast)
            tqdm.write(f"step {step + 1}: held-out loss {entry['heldout_loss']:.4f}")
        log.append(entry)


def save_verifier(model: DeepseekV3ForCausalLM, tokenizer: PreTrainedTokenizerFast,
                  arch: dict, out: Path) -> None:
    """bf16 safetensors + a config.json that both transformers and vLLM read identically."""
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    # Keys transformers drops but vLLM needs: without them vLLM routes experts with softmax.
    config["topk_method"] = arch["topk_method"]
    config["scoring_func"] = arch["scoring_func"]
    config["num_nextn_predict_layers"] = 0
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = {"bos_token_id": tokenizer.bos_token_id,
                  "eos_token_id": [im_end, tokenizer.eos_token_id],
                  "pad_token_id": tokenizer.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


@hydra.main(version_base=None, config_path=str(infra.CONF_DIR), config_name="build_verifier")
def main(cfg: DictConfig) -> None:
    config.check_entry(cfg, "python -m tools.build_verifier")
    torch.manual_seed(cfg.seed)
    if cfg.training.threads:
        torch.set_num_threads(cfg.training.threads)
    out = verifier_dir(cfg.verifier)
    staging = out.with_name(out.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    arch = hf_config_dict(cfg.verifier)
    t0 = time.time()

    stats = ReadStats()
    tok_convs = islice(load_conversations(cfg.data, "train", stats), cfg.tokenizer.train_conversations)
    tokenizer = train_tokenizer((t for c in tok_convs for t in conversation_text(c)),
                                arch["vocab_size"], cfg.tokenizer.special_tokens)
    tcfg = cfg.training
    n_train = tcfg.steps * tcfg.batch_size * (tcfg.seq_len + 1)
    train_ids = tokenize_until(tokenizer, load_conversations(cfg.data, "train", stats), n_train,
                               "tokenize train")
    eval_ids = tokenize_until(tokenizer, load_conversations(cfg.data, "heldout", stats),
                              tcfg.eval_tokens, "tokenize held-out")
    unigram = unigram_cross_entropy(train_ids, eval_ids, arch["vocab_size"])
    print(f"data: {stats.summary()}; unigram held-out cross-entropy {unigram:.4f} nats")

    hf_arch = {k: v for k, v in arch.items() if k not in ("model_type", "topk_method", "scoring_func")}
    hf_config = DeepseekV3Config(**hf_arch, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                              pad_token_id=tokenizer.pad_token_id, num_nextn_predict_layers=0)
    model = DeepseekV3ForCausalLM(hf_config)
    log: list[dict] = []
    t_train = time.time()
    train_model(model, train_ids, eval_ids, tcfg, cfg.seed, log)
    train_wall = time.time() - t_train

    save_verifier(model, tokenizer, arch, staging)
    # The card's figures come from the shipped bf16 weights, run in fp32.
    shipped = DeepseekV3ForCausalLM.from_pretrained(staging, dtype=torch.float32)
    # Per batch too, so that a check of the shipped weights can recompute a few batches.
    heldout_sums = evaluate_sums(shipped, eval_ids, tcfg.seq_len, autocast=False)
    heldout = mean_loss(heldout_sums, eval_ids, tcfg.seq_len)
    facts = {
        "parameters": sum(p.numel() for p in shipped.parameters()),
        "training_tokens": tcfg.steps * tcfg.batch_size * tcfg.seq_len,
        "train_wall_s": train_wall,
        "build_wall_s": time.time() - t0,
        "heldout_loss": heldout,
        "heldout_batch_loss_sums": heldout_sums,
        "heldout_tokens": len(eval_ids) - 1,
        "unigram_loss": unigram,
        "data": stats.summary(),
        "torch_threads": torch.get_num_threads(),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    (staging / "training_log.json").write_text(json.dumps({"facts": facts, "log": log}, indent=1) + "\n")
    write_model_card(staging, shipped, tokenizer, facts, list(cfg.card.samples), cfg.card.max_new_tokens)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    print(f"kimi-tiny written to {out}: held-out loss {heldout:.4f} vs unigram {unigram:.4f}")


if __name__ == "__main__":
    main()
