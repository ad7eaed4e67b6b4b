"""Each engine's reading rule of a draft folder, as code with the engine source it was read from: where
vLLM, SGLang and TokenSpeed find the aux-layer ids for a target (`vllm_capture`, `sglang_capture`,
`tokenspeed_capture`), and what each one's loader needs from model.safetensors (`vllm_loads`,
`sglang_loads`, `tokenspeed_loads`). The writer (config_json.py) and the importers follow them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from model.aux_ids import vllm_to_sglang_aux_ids
from model.draft import DraftConfig, Eagle3Draft
from model.checkpoint.names import (AUX_KEY, DEEPSEEK_V3, EAGLE_CONFIG, EMBED, KIMI_K3, LAYER, TARGETS,
                                    TARGET_KEY, TORCHSPEC_LAYER)


# rule(config.json as a dict, target model_type, target layer count) -> the vLLM ids of the
# layers whose entering hidden state the engine captures, in the order fc receives them
# (ascending: every engine collects them while it walks the layers). None: the engine has no
# EAGLE-3 capture for that target at all; (): it refuses these ids when it starts.
Capture = tuple[int, ...] | None


def _layer_order(ids: Iterable[int], lowest: int, highest: int) -> tuple[int, ...]:
    """Ids the engine's layer walk meets (others are silently never captured), ascending."""
    return tuple(sorted({i for i in ids if lowest <= i <= highest}))


def _default_ids(num_layers: int) -> tuple[int, ...]:
    # The three engines' default for both targets, when a folder names no ids.
    return (2, num_layers // 2, num_layers - 3)


def eagle_config_ids(config: dict[str, Any]) -> list[int] | None:
    eagle = config.get(EAGLE_CONFIG)
    return eagle.get(AUX_KEY) if isinstance(eagle, dict) else None


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"unknown target model_type {target!r}: the engines' rules are known for {TARGETS}")


def vllm_capture(config: dict[str, Any], target: str, num_layers: int) -> Capture:
    """vLLM 0.32.0, any target: top-level ids, else eagle_config's, taken as entering-layer ids.

    vllm/v1/worker/gpu_model_runner.py, GPUModelRunner._get_eagle3_aux_layers_from_config
    (lines 5251-5285; top level 5268, eagle_config only when that is empty, 5279-5280) and
    _setup_eagle3_aux_hidden_state_outputs (5241-5249, the model's default when neither);
    vllm/model_executor/models/deepseek_v2.py, DeepseekV2ForCausalLM.set_aux_hidden_state_layers
    (1955-1956) and DeepseekV2Model.forward (1561-1562: hidden_states + residual before layer
    idx; 1586: the last layer's output for id N).
    """
    check_target(target)
    ids = config.get(AUX_KEY) or eagle_config_ids(config)
    return _layer_order(ids, 0, num_layers) if ids else _default_ids(num_layers)


def sglang_capture(config: dict[str, Any], target: str, num_layers: int) -> Capture:
    """SGLang 0.5.23: eagle_config's ids only; DeepSeek-V3 targets add 1 iff the first id is 1.

    python/sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py,
    _resolve_eagle_aux_hidden_state (lines 185-196: eagle_config["eagle_aux_hidden_state_layer_ids"],
    None when absent; the top-level key is never read), handed by model_executor/model_runner.py
    (1109-1112) to model_runner_components/attention_backend_setup.py,
    configure_aux_hidden_state_capture (40-61), which calls set_eagle3_layers_to_capture;
    python/sglang/srt/models/deepseek_v2.py, DeepseekV2ForCausalLM
    .set_eagle3_layers_to_capture (3458-3473: None -> [2, N//2, N-3]; ids[0] == 1 -> id + 1;
    else as they are), captured entering layer i (3193-3194, layers 0..N-1). Kimi-K3
    (python/sglang/srt/models/kimi_k3.py, KimiK3ForConditionalGeneration) has no
    set_eagle3_layers_to_capture, so configure_aux_hidden_state_capture refuses EAGLE-3 on it (55-60).
    """
    check_target(target)
    if target == KIMI_K3:
        return None
    eagle = config.get(EAGLE_CONFIG)
    if isinstance(eagle, dict) and eagle.get("use_aux_hidden_state", True) is False:
        return ()
    ids = eagle_config_ids(config)
    if ids is None:
        return _default_ids(num_layers)
    return _layer_order(sglang_entering_ids(ids), 0, num_layers - 1)


def sglang_entering_ids(ids: Sequence[int]) -> list[int]:
    """SGLang's reading of eagle_config ids on DeepSeek-V3 targets (sgl-project/sglang PR #25454,
    python/sglang/srt/models/deepseek_v2.py, DeepseekV2ForCausalLM.set_eagle3_layers_to_capture):
    a list starting at 1 names layer outputs (SGLang ids: + 1), any other list names the layers
    the states enter (vLLM ids, as they are)."""
    return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)


def _tokenspeed_config_ids(config: dict[str, Any]) -> list[int] | None:
    # The draft config, then its text_config; in each, eagle_config's ids when it has an
    # eagle_config (the top-level key is then ignored), else the top-level ids.
    for candidate in (config, config.get("text_config")):
        if not isinstance(candidate, dict):
            continue
        eagle = candidate.get(EAGLE_CONFIG)
        if eagle is None:
            ids = candidate.get(AUX_KEY)
        else:
            ids = eagle.get(AUX_KEY) if isinstance(eagle, dict) else None
        if ids:
            return list(ids)
    return None


def tokenspeed_capture(config: dict[str, Any], target: str, num_layers: int) -> Capture:
    """TokenSpeed 0.1.0 (lightseekorg/tokenspeed f4d8ec6e): eagle_config's ids before top-level;
    DeepSeek-V3 targets add 1, Kimi-K3 takes them as they are (one-based completed layers).

    python/tokenspeed/runtime/execution/factory.py, _eagle_aux_layer_ids (lines 44-75) and
    _wire_draft_to_target_model (95-102: --eagle3-layers-to-capture, else the config's ids);
    python/tokenspeed/runtime/models/deepseek_v3.py, DeepseekV3ForCausalLM.set_eagle3_layers_to_capture
    (1688-1695: None -> {2, N//2, N-3}; else {id + 1}), captured entering layer i (1592-1593);
    python/tokenspeed/runtime/models/kimi_k3.py, KimiLinearForCausalLM.set_eagle3_layers_to_capture (2580-2599:
    unchanged; refused unless unique, ascending and in 1..N), captured after layer id - 1 (2555).
    Kimi-K2.5 delegates to its language model (runtime/models/kimi_k25.py,
    KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture, 276-283), so it adds 1 too:
    TorchSpec's published K2.x folders (eagle_config [2, 30, 58], vLLM ids) are captured one
    layer late there unless --eagle3-layers-to-capture (tokenspeed_flag_ids) is passed. Re-read
    at f4d8ec6e: unlike SGLang since PR #25454, TokenSpeed does not look at the first id.
    """
    check_target(target)
    ids = _tokenspeed_config_ids(config)
    if target == KIMI_K3:
        selected = list(_default_ids(num_layers)) if ids is None else ids
        valid = selected == sorted(set(selected)) and all(1 <= i <= num_layers for i in selected)
        return tuple(selected) if valid else ()
    if ids is None:
        return _default_ids(num_layers)
    return _layer_order((i + 1 for i in ids), 0, num_layers - 1)


def tokenspeed_flag_ids(aux: Sequence[int], target: str, num_layers: int) -> list[int]:
    """The value of TokenSpeed's --eagle3-layers-to-capture (it overrides the config's ids, under
    the same target rule) that captures the vLLM ids `aux`."""
    check_target(target)
    return list(aux) if target == KIMI_K3 else vllm_to_sglang_aux_ids(aux, num_layers)


# The engine versions whose sources the rules above restate.
ENGINE_VERSIONS = {"vllm": "vLLM 0.32.0", "sglang": "SGLang 0.5.23", "tokenspeed": "TokenSpeed 0.1.0"}

ENGINE_RULES: dict[str, Callable[[dict[str, Any], str, int], Capture]] = {
    "vllm": vllm_capture,
    "sglang": sglang_capture,
    "tokenspeed": tokenspeed_capture,
}


def engine_captures(config: dict[str, Any], num_layers: int | None = None,
                    target: str | None = None) -> dict[str, Capture]:
    """What each engine captures for this config.json, on `target` (default: the target it
    names, DeepSeek-V3 when it names none). num_layers: for configs without target_num_hidden_layers."""
    target = target or config.get(TARGET_KEY) or DEEPSEEK_V3
    layers = int(config.get("target_num_hidden_layers") or num_layers or 0)
    if layers <= 0:
        raise ValueError("the target's layer count is unknown (no target_num_hidden_layers)")
    return {engine: rule(config, target, layers) for engine, rule in ENGINE_RULES.items()}


def misreading_engines(config: dict[str, Any], trained: Sequence[int], num_layers: int | None = None,
                       target: str | None = None) -> dict[str, tuple[int, ...]]:
    """Engines that serve the (config's) target but would not feed the draft its trained layers."""
    return {engine: got for engine, got in engine_captures(config, num_layers, target).items()
            if got is not None and got != tuple(trained)}


def reconciled(config: dict[str, Any], top: Sequence[int], num_layers: int) -> bool:
    """Does some engine, on some target, read eagle_config's ids as the top-level (vLLM) ids?"""
    nested_only = {k: v for k, v in config.items() if k != AUX_KEY}
    return any(rule(nested_only, target, num_layers) == tuple(sorted(top))
               for rule in ENGINE_RULES.values() for target in TARGETS)


def eagle_config_value(config: dict[str, Any], aux: list[int], num_layers: int) -> list[int]:
    """eagle_config's ids for `config`'s target: SGLang ids (what SGLang and TokenSpeed read on
    DeepSeek-V3 targets) or, when those are misread, vLLM ids (TokenSpeed's Kimi-K3); SGLang ids
    again when no value satisfies every engine (export_draft then warns)."""
    candidates = ([vllm_to_sglang_aux_ids(aux, num_layers)] if all(i >= 1 for i in aux) else []) + [aux]
    for ids in candidates:
        trial = {**config, EAGLE_CONFIG: {**config[EAGLE_CONFIG], AUX_KEY: ids}}
        if not misreading_engines(trial, aux):
            return ids
    return candidates[0]


# ---- what each engine's loader needs from model.safetensors --------------------------------
# rule(config.json, tensor names as stored) -> what else goes wrong when that engine loads the
# folder, besides tensors the draft's modules lack or do not have, which every engine's loader
# refuses or leaves uninitialised alike (`_missing_or_unknown`, checked once for all of them).
LoadRule = Callable[[dict[str, Any], set[str]], list[str]]


def our_name(name: str) -> str:
    """A tensor name as this project names it: TorchSpec's layers.0.* is midlayer.* (every
    engine's loader maps one to the other)."""
    return LAYER + name[len(TORCHSPEC_LAYER):] if name.startswith(TORCHSPEC_LAYER) else name


def our_names(names: Iterable[str]) -> set[str]:
    """`our_name` of each name."""
    return {our_name(n) for n in names}


def needs_embedding(target: str) -> bool:
    """Must the folder carry embed_tokens.weight? Yes for Kimi-K3 targets: TokenSpeed cannot share
    K3's embedding (see tokenspeed_loads); every other engine and target shares the target's."""
    return target == KIMI_K3


def _missing_or_unknown(names: set[str], cfg: DraftConfig) -> list[str]:
    """Names the draft's modules need but the folder lacks, and names no module of it has."""
    with torch.device("meta"):
        wanted = set(Eagle3Draft(cfg).state_dict()) - {"t2d"}
    have = our_names(names) - {"t2d", EMBED}     # t2d: skipped by every engine; embed: optional
    problems = [f"lacks {sorted(wanted - have)} (left uninitialised)"] if wanted - have else []
    return problems + ([f"holds {sorted(have - wanted)}, which its config.json gives no module"]
                       if have - wanted else [])


def _unread_switch(config: dict[str, Any]) -> list[str]:
    return (["does not read norm_before_residual (its draft layer always takes the residual from the "
             "un-normed hidden state): only vLLM serves this folder as trained"]
            if config.get("norm_before_residual") else [])


def vllm_loads(config: dict[str, Any], names: set[str]) -> list[str]:
    """vLLM 0.32.0, vllm/model_executor/models/deepseek_eagle3.py: Eagle3DeepseekV2ForCausalLM
    .load_weights (skips t2d, reads d2t, embed_tokens optional: the target's is shared when
    absent), DeepseekV2Eagle3Model.hf_to_vllm_mapper (midlayer. -> layers.0.), fc_norm.{i} only
    with `fc_norm` (DeepseekV2Eagle3Model.__init__); a name without a parameter raises
    (vllm/model_executor/models/utils.py, AutoWeightsLoader._load_module). All three switches read."""
    return []


def sglang_loads(config: dict[str, Any], names: set[str]) -> list[str]:
    """SGLang (sgl-project/sglang python/sglang/srt/models/kimi_k25_eagle3.py at 054a1cef, the Kimi
    MLA draft of PR #26506): Eagle3DeepseekV2ForCausalLM.load_weights (layers.0. -> midlayer., d2t -> hot
    token ids, t2d skipped, unknown names skipped with a warning); Eagle3MLADecoderLayer refuses
    q_lora_rank null; Eagle3MLAModel reads fc_norm and norm_output, never norm_before_residual."""
    problems = _unread_switch(config)
    if config.get("q_lora_rank") is None:
        problems.append("refuses q_lora_rank null (Eagle3MLADecoderLayer needs the low-rank q)")
    return problems


def tokenspeed_loads(config: dict[str, Any], names: set[str]) -> list[str]:
    """TokenSpeed 0.1.0 (lightseekorg/tokenspeed f4d8ec6e), python/tokenspeed/runtime/models/
    deepseek_v3.py: Eagle3DeepseekV2ForCausalLM.load_weights (layers.0. -> midlayer., d2t, t2d
    skipped), Eagle3MlaModel reads fc_norm and norm_output (commit 6b0b578a), never
    norm_before_residual. Its draft embedding is replicated; set_embed_and_head shares the target's
    only when the shapes agree and otherwise raises unless the folder carried embed_tokens. A
    DeepSeek-V3 target's embedding is replicated too (DeepseekV3Model.__init__), Kimi-K3's is
    sharded over attention TP (runtime/models/kimi_k3.py, KimiLinearModel.__init__; the public
    K3 recipes run TP 8), so a K3 folder without embed_tokens.weight fails at load."""
    problems = _unread_switch(config)
    if needs_embedding(config.get(TARGET_KEY) or DEEPSEEK_V3) and EMBED not in names:
        problems.append(f"needs {EMBED} on a Kimi-K3 target (it cannot share K3's TP-sharded embedding) "
                        "and raises at load without it")
    return problems


LOAD_RULES: dict[str, LoadRule] = {"vllm": vllm_loads, "sglang": sglang_loads, "tokenspeed": tokenspeed_loads}


def engine_load_problems(config: dict[str, Any], names: Iterable[str], cfg: DraftConfig) -> dict[str, list[str]]:
    """Engine -> what goes wrong when it loads a folder with this config.json and these tensors."""
    stored = set(names)
    tensors = _missing_or_unknown(stored, cfg)
    return {engine: tensors + rule(config, stored) for engine, rule in LOAD_RULES.items()}
