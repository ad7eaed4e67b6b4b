"""THE draft checkpoint contract: one Eagle3DeepseekV2ForCausalLM folder for vLLM, SGLang and
TokenSpeed, both ways (export, and import of drafts other tools published). The module is
over 500 lines because the contract has one owner: each engine's reading rule (aux ids, tensor
names, switches) sits beside the writer and the importer that must agree with it, so no rule is
stated twice.

A draft folder holds config.json + model.safetensors, read by
vllm/model_executor/models/deepseek_eagle3.py (vLLM 0.32) like this:

- config.json is parsed by transformers' DeepseekV2Config (model_type "deepseek_v2"; with
  "deepseek_v3" vLLM turns the draft into an MTP model). vLLM reads q_lora_rank with hasattr,
  and DeepseekV2Config defaults it to 1536, so it is always written (null = q_proj).
- RoPE: vLLM 0.32 / transformers 5 read `rope_parameters`; older readers (transformers 4,
  SGLang) read `rope_scaling` + `rope_theta`. Both are written with the same values. vLLM
  builds "deepseek_yarn" from them (always interleaved for MLA) and, since no
  `attention_factor` is written, applies the mscale^2 softmax correction like the verifier.
- draft_vocab_size always; vocab_size = target vocabulary; target_hidden_size.
- fc_norm, norm_before_residual, norm_output: the optional switches of
  Eagle3DeepseekV2ForCausalLM (getattr(config, ..., False) in vLLM), always written as bools.
- Weights without a "model." prefix: fc, fc_norm.{i} (with fc_norm), midlayer.*, norm, lm_head
  (vLLM's loader prefixes and renames them; "layers.0.*", TorchSpec's name for midlayer, is
  read too); d2t only with a pruned vocabulary (vLLM scatters logits to i + d2t[i]); t2d with
  it (vLLM skips t2d, it documents the vocabulary for other readers); embed_tokens.weight only
  for Kimi-K3 targets (TokenSpeed cannot share K3's TP-sharded embedding; the other engines
  share the target's). `vllm_loads`, `sglang_loads` and `tokenspeed_loads` below state what
  each engine's loader needs, with the source it comes from.
- The switches: vLLM reads all three; SGLang and TokenSpeed read fc_norm and norm_output but
  not norm_before_residual, so a folder with it on is served right by vLLM only (the exporter
  and the card say so).

Aux layers. The draft is trained on the hidden states entering layers `aux_layer_ids` (vLLM's
convention). Each engine finds its ids in config.json by its own rule, and the same key means
different layers to different engines and targets; `vllm_capture`, `sglang_capture` and
`tokenspeed_capture` below state each rule as code (with the engine source it comes from):

- top-level `eagle_aux_hidden_state_layer_ids`: vLLM ids. vLLM reads it first; the others only
  look at it when there is no `eagle_config` (TokenSpeed) or never (SGLang).
- `eagle_config.eagle_aux_hidden_state_layer_ids`: read by SGLang and TokenSpeed, whose target
  models convert it differently: on DeepSeek-V3 targets (Kimi-K2, K2.5, kimi-tiny) both add 1
  (SGLang only when the first id is 1), so it holds SGLang ids (layer outputs); TokenSpeed's
  Kimi-K3 takes it unchanged (vLLM ids) and SGLang has no EAGLE-3 capture for K3. The exporter
  picks the value with the rules, for the target named by `target_model_type`.
- `target_model_type` (the verifier's model_type) records which target that value was made
  for; no engine reads it.

Import (`aux_ids_from_json`, `draft_config_from_json`) reads folders other tools published:
TorchSpec's vLLM export (tools/convert_to_hf.py --vllm: `layers.0.*` names, eagle_config ids
already raised by 1 for model_type kimi_k2, no top-level key) as vLLM ids, other
eagle_config-only folders by SGLang's rule (a first id of 1 means layer outputs), and a missing
max_position_embeddings as vLLM reads it. `train.init_from` takes the folder's switches where
the draft conf leaves them null (`init_switches`).

Aux-layer id conventions are converted in model/aux_ids.py only; this module applies each
engine's reading rule to them.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from model.aux_ids import sglang_to_vllm_aux_ids, to_vllm_aux_ids, vllm_to_sglang_aux_ids  # noqa: F401 (re-exported)
from model.draft import ARCHITECTURE_FLAGS, DraftConfig, Eagle3Draft, architecture_flags, layer_shapes
from model.vocab import t2d_from_d2t

if TYPE_CHECKING:
    from model.compatibility import DraftFolder
    from model.verifier_handle import Verifier

logger = logging.getLogger(__name__)

ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
MODEL_TYPE = "deepseek_v2"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
EAGLE_CONFIG = "eagle_config"
TARGET_KEY = "target_model_type"
EMBED = "embed_tokens.weight"
HEAD = "lm_head.weight"
LAYER = "midlayer."             # the draft layer's tensors, as this project and vLLM's mapper name them
TORCHSPEC_LAYER = "layers.0."   # ... as TorchSpec's vLLM export and the engines' modules name them
# vLLM parses these model_types with another config class (vllm/transformers_utils/config.py,
# _CONFIG_REGISTRY: kimi_k2 -> DeepseekV3Config).
_VLLM_CONFIG_TYPE = {"kimi_k2": "deepseek_v3"}

# Target families whose engines read the aux ids differently (the verifier's model_type).
DEEPSEEK_V3 = "deepseek_v3"     # Kimi-K2, the Kimi-K2.5 text tower, kimi-tiny
KIMI_K3 = "kimi_k3"
TARGETS = (DEEPSEEK_V3, KIMI_K3)

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


# ---- each engine's reading rule ---------------------------------------------------------
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


def _eagle_config_ids(config: dict[str, Any]) -> list[int] | None:
    eagle = config.get(EAGLE_CONFIG)
    return eagle.get(AUX_KEY) if isinstance(eagle, dict) else None


def _check_target(target: str) -> None:
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
    _check_target(target)
    ids = config.get(AUX_KEY) or _eagle_config_ids(config)
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
    _check_target(target)
    if target == KIMI_K3:
        return None
    eagle = config.get(EAGLE_CONFIG)
    if isinstance(eagle, dict) and eagle.get("use_aux_hidden_state", True) is False:
        return ()
    ids = _eagle_config_ids(config)
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
    _check_target(target)
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
    _check_target(target)
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


def _reconciled(config: dict[str, Any], top: Sequence[int], num_layers: int) -> bool:
    """Does some engine, on some target, read eagle_config's ids as the top-level (vLLM) ids?"""
    nested_only = {k: v for k, v in config.items() if k != AUX_KEY}
    return any(rule(nested_only, target, num_layers) == tuple(sorted(top))
               for rule in ENGINE_RULES.values() for target in TARGETS)


def _eagle_config_value(config: dict[str, Any], aux: list[int], num_layers: int) -> list[int]:
    """eagle_config's ids for `config`'s target: SGLang ids (what SGLang and TokenSpeed read on
    DeepSeek-V3 targets) or, when those are misread, vLLM ids (TokenSpeed's Kimi-K3); SGLang ids
    again when no value satisfies every engine (export_draft then warns)."""
    candidates = ([vllm_to_sglang_aux_ids(aux, num_layers)] if all(i >= 1 for i in aux) else []) + [aux]
    for ids in candidates:
        trial = {**config, EAGLE_CONFIG: {**config[EAGLE_CONFIG], AUX_KEY: ids}}
        if not misreading_engines(trial, aux):
            return ids
    return candidates[0]


# ---- config.json ------------------------------------------------------------------------
def draft_config_json(cfg: DraftConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The config.json the engines read, for the verifier named by cfg.target_model_type."""
    target_model_type = cfg.target_model_type
    _check_target(target_model_type)
    rope_parameters = dict(cfg.rope_parameters)
    rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    if rope_scaling.get("rope_type", "default") != "default":
        rope_scaling["type"] = rope_scaling["rope_type"]   # transformers-4 readers look for "type"
    aux = list(cfg.aux_layer_ids)
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "attention_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_interleave": cfg.rope_interleave,
        "rope_theta": rope_parameters["rope_theta"],
        "rope_scaling": rope_scaling if rope_scaling.get("rope_type", "default") != "default" else None,
        "rope_parameters": rope_parameters,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "target_num_hidden_layers": cfg.target_num_hidden_layers,
        # Written even when False, so that no reader falls back on a default of its own.
        **{flag: bool(getattr(cfg, flag)) for flag in ARCHITECTURE_FLAGS},
        TARGET_KEY: target_model_type,   # which target eagle_config's ids were chosen for; no engine reads it
        # vLLM 0.32.0 reads this first, as entering-layer ids (vllm/v1/worker/gpu_model_runner.py,
        # _get_eagle3_aux_layers_from_config, line 5268; see vllm_capture).
        AUX_KEY: aux,
        # SGLang 0.5.23 reads only this (spec_aux_hidden_state.py, _resolve_eagle_aux_hidden_state,
        # line 192; DeepseekV2ForCausalLM.set_eagle3_layers_to_capture adds 1 when the first id is 1),
        # and TokenSpeed 0.1.0 prefers it to the top level (execution/factory.py,
        # _eagle_aux_layer_ids, line 68; its DeepSeek-V3 adds 1, its Kimi-K3 does not). The value
        # is chosen with those rules (sglang_capture, tokenspeed_capture). vLLM 0.32.0 sizes fc
        # from its length (model_executor/models/deepseek_eagle3.py, lines 188-193).
        EAGLE_CONFIG: {AUX_KEY: aux, "use_aux_hidden_state": True},
        "tie_word_embeddings": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }
    config[EAGLE_CONFIG][AUX_KEY] = _eagle_config_value(config, aux, cfg.target_num_hidden_layers)
    return config


def is_torchspec_vllm_export(d: dict[str, Any], tensor_names: Iterable[str]) -> bool:
    """A folder written by TorchSpec's tools/convert_to_hf.py --vllm for a Kimi draft (the
    lightseekorg kimi-k2.5 / k2.6 / k3 eagle3 MLA folders): `_remap_weight_keys` renames
    midlayer.* to layers.0.*, and `_fixup_export_config` adds 1 to eagle_config's ids when
    model_type is kimi_k2, so those ids are vLLM's (TorchSpec's templates, e.g.
    configs/draft_models/kimi_k25_eagle3_mla.json, hold SGLang ids: [1, 29, 57] -> [2, 30, 58])."""
    return d.get("model_type") == "kimi_k2" and any(n.startswith(TORCHSPEC_LAYER) for n in tensor_names)


def _nested_as_vllm(d: dict[str, Any], nested: list[int], tensor_names: Iterable[str]) -> list[int]:
    """eagle_config's ids of a folder with no top-level key, as vLLM ids."""
    if is_torchspec_vllm_export(d, tensor_names):
        return list(nested)
    # TorchSpec's own and SpecForge/SGLang folders: what SGLang, the engine they were made for,
    # captures from them (SGLang ids start at 1 in every published template).
    return sglang_entering_ids(nested)


def _rule_layers(d: dict[str, Any], aux: Sequence[int]) -> int:
    """The target's layer count for the engines' rules: stated, else the fewest layers in which
    every engine's layer walk meets every id (SGLang and TokenSpeed capture entering layers 0..N-1)."""
    return int(d.get("target_num_hidden_layers") or max(aux) + 1)


def aux_ids_from_json(d: dict[str, Any], source: str | Path = CONFIG_FILE,
                      tensor_names: Iterable[str] = ()) -> list[int]:
    """The draft's aux ids (vLLM convention) from a config.json written by any tool.

    Top-level ids are vLLM's and win. A folder with only eagle_config's is read by
    `_nested_as_vllm` (`tensor_names`, the names in its model.safetensors, tell TorchSpec's vLLM
    export apart). With both, some engine's rule must read eagle_config's as the same layers
    (equal, or one below), else the folder is refused. Engines that would misread the folder, on
    its target or (when it names none) on either, are logged.
    """
    top, nested = d.get(AUX_KEY), _eagle_config_ids(d)
    if not top and not nested:
        raise ValueError(f"{source} names no {AUX_KEY}")
    if top:
        aux = list(top)
        if nested and not _reconciled(d, aux, _rule_layers(d, aux)):
            raise ValueError(f"{source}: {AUX_KEY} {aux} and {EAGLE_CONFIG}.{AUX_KEY} {list(nested)} name "
                             "different layers under every engine's rule (eagle_config must hold the same ids, "
                             "or each one below: SGLang's numbering)")
    else:
        aux = _nested_as_vllm(d, list(nested), list(tensor_names))
    num_layers = _rule_layers(d, aux)
    to_vllm_aux_ids(aux, "vllm", num_layers)          # refuses ids outside the target
    for target in ([d[TARGET_KEY]] if d.get(TARGET_KEY) else TARGETS):
        for engine, got in misreading_engines(d, aux, num_layers, target).items():
            logger.warning("%s: %s would feed the draft the layers entering %s, not the %s it was trained on "
                           "(on a %s target)", source, engine, list(got), aux, target)
    return aux


def vllm_max_positions(d: dict[str, Any]) -> int:
    """max_position_embeddings as vLLM 0.32 reads it: the folder's, else the default of the
    transformers config class it parses the folder with (vllm/transformers_utils/config.py,
    _CONFIG_REGISTRY: kimi_k2 -> DeepseekV3Config; others by model_type). TorchSpec's
    configs/draft_models/kimi_k25_eagle3_mla.json has none (DeepseekV3Config: 4096)."""
    if d.get("max_position_embeddings") is not None:
        return int(d["max_position_embeddings"])
    from transformers import AutoConfig

    model_type = _VLLM_CONFIG_TYPE.get(d.get("model_type", MODEL_TYPE), d.get("model_type", MODEL_TYPE))
    return int(AutoConfig.for_model(model_type).max_position_embeddings)


def draft_config_from_json(d: dict[str, Any], source: str | Path = CONFIG_FILE,
                           tensor_names: Iterable[str] = ()) -> DraftConfig:
    """Inverse of `draft_config_json`; also reads drafts other tools wrote (legacy rope keys,
    aux ids only in eagle_config, no max_position_embeddings). `source` names the file in
    errors and warnings; `tensor_names` are the names in the folder's model.safetensors."""
    if d.get("architectures") != [ARCHITECTURE]:
        raise ValueError(f"{source}: not an {ARCHITECTURE} checkpoint: {d.get('architectures')}")
    rope_parameters = d.get("rope_parameters")
    if not rope_parameters:  # legacy form: rope_scaling (with "type" or "rope_type") + rope_theta
        legacy = dict(d.get("rope_scaling") or {})
        rope_type = legacy.pop("rope_type", None) or legacy.get("type") or "default"
        legacy.pop("type", None)
        rope_parameters = {"rope_type": rope_type, **legacy, "rope_theta": d["rope_theta"]}
    aux = aux_ids_from_json(d, source, tensor_names)
    return DraftConfig(
        **layer_shapes({**d, "max_position_embeddings": vllm_max_positions(d)}),
        rope_parameters=dict(rope_parameters),
        rope_interleave=d.get("rope_interleave", True),   # vLLM's MLA always rotates interleaved
        vocab_size=d["vocab_size"],
        draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
        target_hidden_size=d.get("target_hidden_size", d["hidden_size"]),
        # Unknown for third-party drafts: the smallest layer count the ids allow.
        target_num_hidden_layers=d.get("target_num_hidden_layers", max(aux)),
        # Third-party drafts do not say (TorchSpec writes model_type kimi_k2 for K2.x and K3 alike).
        target_model_type=d.get(TARGET_KEY, DEEPSEEK_V3),
        aux_layer_ids=tuple(aux),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        **architecture_flags(d),              # False when absent, as vLLM reads them
    )


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


# ---- weights ----------------------------------------------------------------------------
def export_tensors(draft: Eagle3Draft, dtype: torch.dtype = torch.bfloat16,
                   verifier_dir: Path | Verifier | None = None) -> dict[str, Tensor]:
    """Checkpoint name -> tensor. The module names already are vLLM's, so this casts, and adds
    the verifier's embedding where `needs_embedding`."""
    out: dict[str, Tensor] = {}
    for name, tensor in draft.exported_state().items():
        # d2t (int64) and t2d (bool) keep their dtypes; float weights take the export dtype.
        t = tensor.to(dtype) if tensor.is_floating_point() else tensor
        out[name] = t.detach().cpu().contiguous()
    if needs_embedding(draft.config.target_model_type):
        out[EMBED] = _verifier_embedding(draft, verifier_dir).to(dtype).cpu().contiguous()
    return out


def _verifier_embedding(draft: Eagle3Draft, verifier_dir: Path | Verifier | None) -> Tensor:
    """The draft's copy of the verifier's embedding, else the verifier's own; never zeros (a
    draft rebuilt from a training state has not loaded it)."""
    if draft.embed_tokens.device.type != "meta" and torch.count_nonzero(draft.embed_tokens) > 0:
        return draft.embed_tokens.detach()
    if verifier_dir is None:
        raise ValueError(f"a {draft.config.target_model_type} draft folder carries {EMBED} (TokenSpeed cannot "
                         "share the target's), but this draft has not loaded the verifier's embedding: pass "
                         "verifier_dir or call load_verifier_embedding first")
    from model.verifier_handle import Verifier

    return Verifier.of(verifier_dir).embedding()


def export_size_bytes(draft: Eagle3Draft, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of tensor data in model.safetensors (works for a draft on the meta device)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0
    for tensor in draft.exported_state().values():
        total += tensor.numel() * (itemsize if tensor.is_floating_point() else tensor.element_size())
    if needs_embedding(draft.config.target_model_type):
        total += draft.embed_tokens.numel() * itemsize
    return total


def export_draft(draft: Eagle3Draft, out_dir: Path, dtype: torch.dtype = torch.bfloat16,
                 verifier_dir: Path | Verifier | None = None) -> Path:
    """Write config.json + model.safetensors; returns out_dir. The draft's target_model_type
    (DEEPSEEK_V3 | KIMI_K3) decides what SGLang and TokenSpeed read, and whether the folder
    carries the embedding (from the draft, else from `verifier_dir`). Warns of every engine that
    would not serve the folder as trained (aux layers, loader, switches)."""
    out_dir = Path(out_dir)
    config = draft_config_json(draft.config, dtype)
    tensors = export_tensors(draft, dtype, verifier_dir)
    for engine, got in misreading_engines(config, draft.config.aux_layer_ids).items():
        logger.warning("%s: no config.json serves aux layers %s on every engine: %s would capture %s",
                       out_dir, list(draft.config.aux_layer_ids), engine, list(got))
    serving = {engine for engine, got in engine_captures(config).items() if got is not None}
    for engine, problems in engine_load_problems(config, tensors, draft.config).items():
        for problem in problems if engine in serving else []:
            logger.warning("%s: %s %s", out_dir, ENGINE_VERSIONS[engine], problem)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir


def stored_names(path: Path) -> list[str]:
    """The tensor names of a folder's model.safetensors (its header only)."""
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
        return list(f.keys())


def read_folder_config(path: Path) -> DraftConfig:
    """The DraftConfig of a draft folder, read with its tensor names (see aux_ids_from_json)."""
    path = Path(path)
    return draft_config_from_json(json.loads((path / CONFIG_FILE).read_text()), path / CONFIG_FILE,
                                  stored_names(path))


def _read_tensors(path: Path) -> dict[str, Tensor]:
    """model.safetensors under our names (TorchSpec's exports call midlayer "layers.0")."""
    tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    return {our_name(k): v for k, v in tensors.items()}


def load_draft(
    path: Path,
    verifier_dir: Path | Verifier | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Eagle3Draft:
    """An exported draft back as Eagle3Draft (weights exactly as stored, cast to `dtype`).

    The embedding: a stored `embed_tokens.weight` (Kimi-K3 folders, other tools) when present,
    else the verifier's when `verifier_dir` is given, else zeros.
    """
    path = Path(path)
    cfg = read_folder_config(path)
    tensors = _read_tensors(path)
    embed = tensors.pop(EMBED, None)
    if cfg.pruned and "t2d" not in tensors:
        tensors["t2d"] = t2d_from_d2t(tensors["d2t"], cfg.vocab_size)
    with torch.device(device):
        draft = Eagle3Draft(cfg)
    draft.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, strict=True)
    draft.to(dtype)
    if embed is not None:
        draft.embed_tokens.copy_(embed)
    elif verifier_dir is not None:
        draft.load_verifier_embedding(verifier_dir)
    return draft


# ---- starting training from an exported draft --------------------------------------------
def read_draft_folder(path: Path, with_d2t: bool = False) -> DraftFolder:
    """An exported draft folder as model/compatibility.py checks it: its DraftConfig (read with
    its tensor names where it has weights), whether it states the target's layer count, and
    with `with_d2t` its pruned vocabulary (None for a full one)."""
    from model.compatibility import DraftFolder

    path = Path(path)
    raw = json.loads((path / CONFIG_FILE).read_text())
    names = stored_names(path) if (path / WEIGHTS_FILE).exists() else []
    d2t = None
    if with_d2t and "d2t" in names:
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            d2t = f.get_tensor("d2t")
    return DraftFolder(path, draft_config_from_json(raw, path / CONFIG_FILE, names),
                       "target_num_hidden_layers" in raw, d2t)


def init_switches(conf_flags: Mapping[str, bool | None], path: Path) -> dict[str, bool]:
    """The architecture switches of a run that starts from the folder in `path`: the folder's
    where the draft conf leaves a switch null (unset), the conf's where it sets one; a set
    switch that differs from the folder's is refused, naming both values (weights trained
    under one norm wiring are no starting point for another)."""
    path = Path(path)
    found = read_folder_config(path)
    switches = {}
    for flag in ARCHITECTURE_FLAGS:
        theirs, mine = getattr(found, flag), conf_flags.get(flag)
        if mine is not None and bool(mine) != theirs:
            raise ValueError(f"{path} cannot start this draft: {flag} is {theirs} in its {CONFIG_FILE}, "
                             f"{bool(mine)} in draft.{flag}; set draft.{flag}={str(theirs).lower()}, or null to "
                             "take the folder's")
        switches[flag] = theirs
    return switches


def draft_config_for_run(draft_conf: Mapping[str, Any], verifier: Verifier | Path | None,
                         init_from: Path | str | None) -> DraftConfig:
    """DraftConfig.from_conf, with the switches of the `train.init_from` folder where the conf
    leaves them null (null without init_from: off)."""
    cfg = DraftConfig.from_conf(draft_conf, verifier)
    if not init_from:
        return cfg
    conf_flags = {flag: draft_conf.get(flag) for flag in ARCHITECTURE_FLAGS}
    return dataclasses.replace(cfg, **init_switches(conf_flags, Path(init_from)))


def init_from_draft(draft: Eagle3Draft, path: Path) -> None:
    """Copy the weights of the exported draft in `path` into `draft` (built from the run's
    configuration, vocabulary installed); refuse a folder of another shape, vocabulary, aux
    layers or architecture switches. The embedding stays the verifier's; d2t/t2d stay the
    draft's (they must be equal)."""
    from model.compatibility import check_compatible

    path = Path(path)
    # Every disagreement at once (shapes, aux layers, switches, vocabulary): IncompatibleError.
    check_compatible(draft=draft.config, folder=read_draft_folder(path, with_d2t=draft.config.pruned), d2t=draft.d2t)
    tensors = _read_tensors(path)
    tensors.pop(EMBED, None)
    own = draft.state_dict()
    state = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    state |= {k: own[k] for k in ("d2t", "t2d") if k in own}
    with torch.no_grad():
        if HEAD not in own:                  # the verifier's own lm_head (take_verifier_head)
            _take_folder_head(draft, state.pop(HEAD))
            if HEAD in draft.state_dict():   # the folder's, now the draft's own parameter
                state[HEAD] = draft.lm_head.weight
        draft.load_state_dict(state, strict=True)


def _take_folder_head(draft: Eagle3Draft, head: Tensor) -> None:
    """A folder's frozen lm_head for a draft that holds the verifier's: nothing to do where they
    are equal; else the folder's, as a frozen parameter of the draft's own (the verifier's tensor,
    which the targets come from, is never written)."""
    mine = draft.lm_head.weight
    if torch.equal(head.to(mine.dtype), mine):
        return
    logger.info("the folder's lm_head is not the verifier's: the draft keeps its own frozen copy")
    del draft.lm_head.weight
    draft.lm_head.weight = nn.Parameter(head.to(draft.fc.weight.dtype), requires_grad=False)
