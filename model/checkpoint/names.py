"""The names of the draft folder contract: files, config.json keys, tensor names, the target families
whose engines read the aux ids differently (the contract: model/checkpoint/__init__.py).
"""
from __future__ import annotations

import torch


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
VLLM_CONFIG_TYPE = {"kimi_k2": "deepseek_v3"}

# Target families whose engines read the aux ids differently (the verifier's model_type).
DEEPSEEK_V3 = "deepseek_v3"     # Kimi-K2, the Kimi-K2.5 text tower, kimi-tiny
KIMI_K3 = "kimi_k3"
TARGETS = (DEEPSEEK_V3, KIMI_K3)

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
