"""The exported draft's model card (README.md in the draft folder), like the public draft cards.

Written at export with what training knows (architecture, verifier, training set-up) and again
by `make eval` with the accept-length table. Launch commands for vLLM, SGLang and TokenSpeed
use chain drafting: 3 steps, topk 1, 4 draft tokens (the verifier's token + 3 drafts).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from model.checkpoint import (AUX_KEY, CONFIG_FILE, DEEPSEEK_V3, EAGLE_CONFIG, EMBED, ENGINE_VERSIONS, TARGET_KEY,
                              engine_captures, engine_load_problems, read_folder_config, stored_names,
                              tokenspeed_flag_ids)
from model.aux_ids import vllm_to_sglang_aux_ids
from model.training_facts import TrainingFacts

CARD = "README.md"        # in the draft folder, beside the training facts (model/training_facts.py)


def _architecture(config: dict[str, Any], aux: list[int], names: list[str]) -> list[str]:
    q = "q_proj" if config.get("q_lora_rank") is None else f"q_lora_rank {config['q_lora_rank']}"
    vocab = config["draft_vocab_size"]
    pruned = vocab != config["vocab_size"]
    return [
        f"- EAGLE-3 draft, one MLA decoder layer ({config['architectures'][0]}, model_type "
        f"`{config['model_type']}`): hidden {config['hidden_size']}, {config['num_attention_heads']} heads, "
        f"{q}, kv_lora_rank {config['kv_lora_rank']}, qk_nope/rope/v head dims "
        f"{config['qk_nope_head_dim']}/{config['qk_rope_head_dim']}/{config['v_head_dim']}, dense SwiGLU MLP "
        f"{config['intermediate_size']}.",
        f"- fc fuses {len(aux)} verifier hidden states "
        f"({config['target_hidden_size']} wide each"
        + (", each through its own RMSNorm first: `fc_norm`" if config.get("fc_norm") else "")
        + ") into the draft's hidden size.",
        *_norm_switches(config),
        f"- lm_head over {vocab} tokens" + (f" (pruned from {config['vocab_size']}; `d2t` maps draft ids to "
                                            "target ids)" if pruned else " (the verifier's full vocabulary)")
        + ("; the embedding is a copy of the verifier's (`embed_tokens.weight`: TokenSpeed cannot share a Kimi-K3 "
           "verifier's TP-sharded one)." if EMBED in names else "; the embedding is the verifier's (not stored)."),
    ]


def _norm_switches(config: dict[str, Any]) -> list[str]:
    """The layer's optional norm wiring, when the folder turns it on (vLLM reads both from config.json)."""
    parts = (["the residual starts from the normed hidden state (`norm_before_residual`)"]
             if config.get("norm_before_residual") else [])
    parts += (["the next draft step reads the final-normed state (`norm_output`)"]
              if config.get("norm_output") else [])
    if any(config.get(flag) for flag in ("fc_norm", "norm_before_residual", "norm_output")):
        parts.append("vLLM reads `fc_norm`, `norm_before_residual` and `norm_output` from config.json (tested "
                     "against this project's draft); SGLang and TokenSpeed read `fc_norm` and `norm_output` (read in "
                     "their sources, not run)"
                     + (", not `norm_before_residual`: only vLLM serves this folder as trained"
                        if config.get("norm_before_residual") else ""))
    text = "; ".join(parts)
    return [f"- {text[0].upper()}{text[1:]}."] if parts else []


def _aux_lines(config: dict[str, Any], aux: list[int], captures: dict[str, tuple[int, ...] | None],
               loads: dict[str, list[str]]) -> list[str]:
    """Which key each engine reads, the layers it then captures, and what its loader lacks
    (model/checkpoint/engine_rules.py)."""
    target = config.get(TARGET_KEY) or DEEPSEEK_V3
    sglang = (f"; SGLang numbers the same layers by their output: "
              f"{vllm_to_sglang_aux_ids(aux, int(config.get('target_num_hidden_layers') or max(aux)))}"
              if min(aux) >= 1 else "")
    nested = (config.get(EAGLE_CONFIG) or {}).get(AUX_KEY)
    captured = ", ".join(f"{ENGINE_VERSIONS[engine]} {'none' if got is None else list(got)}"
                         for engine, got in captures.items())
    lines = [
        f"Aux layers: the draft reads the hidden states entering verifier layers {aux} (vLLM's numbering{sglang}). "
        f"vLLM reads the top-level `{AUX_KEY}` = {config.get(AUX_KEY)}; SGLang and TokenSpeed read "
        f"`{EAGLE_CONFIG}.{AUX_KEY}` = {nested}, each through its `{target}` model's rule. Layers each engine "
        f"captures from this folder: {captured}.",
    ]
    for engine, got in captures.items():
        for problem in loads.get(engine, []) if got is not None else []:
            lines.append(f"{ENGINE_VERSIONS[engine]} {problem}.")
        if got is None:
            lines.append(f"{ENGINE_VERSIONS[engine]} has no EAGLE-3 capture for `{target}` verifiers: it cannot serve "
                         "this draft.")
        elif list(got) != aux:
            lines.append(f"{ENGINE_VERSIONS[engine]} would feed the draft the wrong layers"
                         + (": pass the `--eagle3-layers-to-capture` flag shown below." if engine == "tokenspeed"
                            else ": do not serve this draft with it."))
    return lines


def _launch(verifier: str, draft: str, config: dict[str, Any], aux: list[int], tp: int, pp: int,
            loads: dict[str, list[str]]) -> list[str]:
    num_layers = int(config.get("target_num_hidden_layers") or max(aux))
    target = config.get(TARGET_KEY) or DEEPSEEK_V3
    captures = engine_captures(config, num_layers)
    lines = [*_aux_lines(config, aux, captures, loads), "", "vLLM:", "```bash",
             f"vllm serve {verifier} --tensor-parallel-size {tp}"
             + (f" --pipeline-parallel-size {pp}" if pp > 1 else "") + " \\",
             f"  --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{draft}\", \"num_speculative_tokens\": 3}}'",
             "```"]
    if captures["sglang"] is not None:
        lines += ["SGLang:", "```bash",
                  f"python -m sglang.launch_server --model-path {verifier} --tp {tp} \\",
                  f"  --speculative-algorithm EAGLE3 --speculative-draft-model-path {draft} \\",
                  "  --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4",
                  "```"]
    flag = ""
    if captures["tokenspeed"] is not None and list(captures["tokenspeed"]) != aux:
        flag = " \\\n  --eagle3-layers-to-capture " + ",".join(map(str, tokenspeed_flag_ids(aux, target, num_layers)))
    lines += ["TokenSpeed (chain drafting):", "```bash",
              f"tokenspeed serve {verifier} --tensor-parallel-size {tp} \\",
              f"  --speculative-algorithm EAGLE3 --speculative-draft-model-path {draft} \\",
              "  --speculative-num-steps 3" + flag,
              "```"]
    return lines


def _training(facts: TrainingFacts | None) -> list[str]:
    if facts is None:
        return ["Training set-up: not recorded (the draft was exported outside a training run)."]
    f = facts
    lines = [
        f"- Store `{f.store_dir}`: hidden states of the verifier dumped through vLLM.",
        f"- {f.steps} optimizer steps, {f.grad_accum} x {f.micro_batch} packed rows of up to {f.max_len} tokens "
        f"per step and rank, {f.world_size} rank(s), DeepSpeed ZeRO-{f.zero_stage}, {f.precision}.",
        f"- AdamW lr {f.lr} (warmup {f.warmup}, cosine to {f.min_lr_ratio} x lr), grad clip {f.grad_clip}; "
        f"training-time test {f.ttt_steps} steps, step weights {f.ttt_decay}^k; {f.loss}.",
        f"- Command: `{f.command}`.",
    ]
    if f.heldout_accept_length is not None:
        lines.append(f"- Held-out split of the store: simulated accept length {f.heldout_accept_length:.3f} "
                     f"(chain replay {f.heldout_chain_accept_length:.3f}).")
    return lines


def write_card(draft_dir: Path, verifier_name: str, verifier_path: str, tp: int, pp: int,
               table: str | None = None) -> Path:
    """(Re)write <draft_dir>/README.md from the folder (its training.json, when a run wrote one);
    `table`: the markdown accept-length table from `make eval`."""
    draft_dir = Path(draft_dir)
    config = json.loads((draft_dir / CONFIG_FILE).read_text())
    cfg, names = read_folder_config(draft_dir), stored_names(draft_dir)
    aux = list(cfg.aux_layer_ids)
    loads = engine_load_problems(config, names, cfg)
    lines = [
        f"# EAGLE-3 MLA draft for {verifier_name}",
        "",
        f"Speculative-decoding draft for `{verifier_name}` (`{verifier_path}`), trained by this project's "
        "offline pipeline (`make dump`, `make train`). Load it with the verifier; it is useless alone.",
        "",
        "## Architecture",
        *_architecture(config, aux, names),
        "",
        "## Training",
        *_training(TrainingFacts.read(draft_dir)),
        "",
        "## Accept length (topk 1, 3 steps, 4 draft tokens; ceiling 4)",
        table if table else "Not measured yet: run `make eval DRAFT=<this folder>`.",
        "",
        "## Launch",
        *_launch(verifier_path, str(draft_dir), config, aux, tp, pp, loads),
        "",
    ]
    path = draft_dir / CARD
    path.write_text("\n".join(lines))
    return path
