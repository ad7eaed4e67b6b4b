"""config.json of a draft folder both ways: written for Eagle3DeepseekV2ForCausalLM with the aux ids
each engine's rule needs (`draft_config_json`), and read back from this project's folders and from
those other tools published (`aux_ids_from_json`, `draft_config_from_json`).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from model.aux_ids import to_vllm_aux_ids
from model.draft import ARCHITECTURE_FLAGS, DraftConfig, architecture_flags, layer_shapes
from model.checkpoint.names import (ARCHITECTURE, AUX_KEY, CONFIG_FILE, DEEPSEEK_V3, EAGLE_CONFIG, MODEL_TYPE,
                                    TARGETS, TARGET_KEY, TORCHSPEC_LAYER, DTYPE_NAMES, VLLM_CONFIG_TYPE)
from model.checkpoint.engine_rules import (check_target, eagle_config_ids, eagle_config_value, reconciled,
                                           misreading_engines, sglang_entering_ids)

logger = logging.getLogger(__name__)


def draft_config_json(cfg: DraftConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The config.json the engines read, for the verifier named by cfg.target_model_type."""
    target_model_type = cfg.target_model_type
    check_target(target_model_type)
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
        "torch_dtype": DTYPE_NAMES[dtype],
    }
    config[EAGLE_CONFIG][AUX_KEY] = eagle_config_value(config, aux, cfg.target_num_hidden_layers)
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
    top, nested = d.get(AUX_KEY), eagle_config_ids(d)
    if not top and not nested:
        raise ValueError(f"{source} names no {AUX_KEY}")
    if top:
        aux = list(top)
        if nested and not reconciled(d, aux, _rule_layers(d, aux)):
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

    model_type = VLLM_CONFIG_TYPE.get(d.get("model_type", MODEL_TYPE), d.get("model_type", MODEL_TYPE))
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
