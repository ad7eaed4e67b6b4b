"""The config class a Kimi-K2 checkpoint folder names in its config.json `auto_map`.

Copied into a Kimi-shaped folder (tools/rehearsal_verifier.py): transformers knows DeepSeek-V3 but
not the model_type `kimi_k2`, so AutoConfig reads such a folder only through this remote code
(trust_remote_code); vLLM maps kimi_k2 to its own DeepseekV3Config and never runs it.
"""
from __future__ import annotations

from transformers import DeepseekV3Config as _DeepseekV3Config


class DeepseekV3Config(_DeepseekV3Config):
    model_type = "kimi_k2"
