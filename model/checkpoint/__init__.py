"""THE draft checkpoint contract: one Eagle3DeepseekV2ForCausalLM folder for vLLM, SGLang and
TokenSpeed, both ways (export, and import of drafts other tools published). The package is
its one owner, a module per job: names.py (files, keys, tensor names, targets), engine_rules.py
(each engine's reading rule: aux ids, what its loader needs), config_json.py (config.json written
and read), folder.py (the weights exported and loaded), init_from.py (training started from a
folder). The writer and the importers follow engine_rules.py, so no rule is stated twice.

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

from model.checkpoint.names import (
    ARCHITECTURE,
    AUX_KEY,
    CONFIG_FILE,
    DEEPSEEK_V3,
    EAGLE_CONFIG,
    EMBED,
    HEAD,
    KIMI_K3,
    LAYER,
    MODEL_TYPE,
    TARGETS,
    TARGET_KEY,
    TORCHSPEC_LAYER,
    WEIGHTS_FILE)
from model.checkpoint.engine_rules import (
    Capture,
    ENGINE_RULES,
    ENGINE_VERSIONS,
    LOAD_RULES,
    LoadRule,
    engine_captures,
    engine_load_problems,
    misreading_engines,
    needs_embedding,
    our_name,
    our_names,
    sglang_capture,
    sglang_entering_ids,
    sglang_loads,
    tokenspeed_capture,
    tokenspeed_flag_ids,
    tokenspeed_loads,
    vllm_capture,
    vllm_loads)
from model.checkpoint.config_json import (
    aux_ids_from_json,
    draft_config_from_json,
    draft_config_json,
    is_torchspec_vllm_export,
    vllm_max_positions)
from model.checkpoint.folder import (
    export_draft,
    export_size_bytes,
    export_tensors,
    load_draft,
    read_folder_config,
    stored_names)
from model.checkpoint.init_from import (
    draft_config_for_run,
    init_from_draft,
    init_switches,
    read_draft_folder)

__all__ = [
    "ARCHITECTURE",
    "AUX_KEY",
    "CONFIG_FILE",
    "Capture",
    "DEEPSEEK_V3",
    "EAGLE_CONFIG",
    "EMBED",
    "ENGINE_RULES",
    "ENGINE_VERSIONS",
    "HEAD",
    "KIMI_K3",
    "LAYER",
    "LOAD_RULES",
    "LoadRule",
    "MODEL_TYPE",
    "TARGETS",
    "TARGET_KEY",
    "TORCHSPEC_LAYER",
    "WEIGHTS_FILE",
    "aux_ids_from_json",
    "draft_config_for_run",
    "draft_config_from_json",
    "draft_config_json",
    "engine_captures",
    "engine_load_problems",
    "export_draft",
    "export_size_bytes",
    "export_tensors",
    "init_from_draft",
    "init_switches",
    "is_torchspec_vllm_export",
    "load_draft",
    "misreading_engines",
    "needs_embedding",
    "our_name",
    "our_names",
    "read_draft_folder",
    "read_folder_config",
    "sglang_capture",
    "sglang_entering_ids",
    "sglang_loads",
    "stored_names",
    "tokenspeed_capture",
    "tokenspeed_flag_ids",
    "tokenspeed_loads",
    "vllm_capture",
    "vllm_loads",
    "vllm_max_positions",
]
