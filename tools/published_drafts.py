"""Draft folders other tools published, rebuilt at kimi-tiny's shapes so that the importer can be
tested on them here: config.json field by field and the tensor names as each source writes them.

Sources (public; read at the commit named):
- TorchSpec's templates: lightseekorg/TorchSpec configs/draft_models/kimi_k25_eagle3_mla.json
  (6f21829) and configs/draft_models/kimi_k3_eagle3_mla.json (a31111ee).
- TorchSpec's export: tools/convert_to_hf.py (6f21829). `_save_without_vocab_pruning` writes the
  template plus draft_vocab_size, _torchspec_version (version.txt: 0.1.0) and torch_dtype, and the
  state_dict of torchspec/models/draft/deepseek_eagle.py Eagle3DeepseekV2ForCausalLM (embed_tokens,
  midlayer.*, fc, norm, lm_head; its rotary caches are not persistent). With --vllm,
  `_remap_weight_keys` renames midlayer.* to layers.0.* and `_fixup_export_config` adds 1 to
  eagle_config's ids for model_type kimi_k2. No top-level aux key either way.
- The K2.6 / K2.7 EAGLE 3.1 MLA drafts (lightseekorg/kimi-k2.6-eagle3.1-mla,
  kimi-k2.7-coder-eagle3.1-mla): sgl-project/sglang PR #26506 (python/sglang/srt/models/
  kimi_k25_eagle3.py) and lightseekorg/tokenspeed commit 6b0b578a describe them as the K2.5 MLA
  layout plus `fc_norm` and `norm_output` in config.json and fc_norm.{i}.weight tensors. Their
  config.json itself was not among the sources read: the other fields are the K2.5 export's.

At kimi-tiny's shapes: the layer shapes, vocabulary and bos/eos ids are the tiny draft's; every
other field is the template's (RoPE, max positions, eagle_config's extra keys). The aux ids follow
the same rule as the templates: SGLang's defaults [1, N//2 - 1, N - 4] (K2.x N = 61 -> [1, 29, 57],
K3 N = 93 -> [1, 45, 89]; kimi-tiny N = 8 -> [1, 3, 4]), raised by 1 in a --vllm export.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from model.draft import LAYER_SHAPE_KEYS, Eagle3Draft

TORCHSPEC_VERSION = "0.1.0"
EAGLE_CONFIG_EXTRAS = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                       "use_last_layernorm": True, "use_mtp_layernorm": False}
# The templates' fields that are not shapes, vocabulary or token ids.
K25_TEMPLATE = {
    "model_type": "kimi_k2", "hidden_act": "silu", "torch_dtype": "bfloat16", "pad_token_id": 0,
    "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    # no max_position_embeddings
}
K3_TEMPLATE = {
    "model_type": "kimi_k2", "hidden_act": "silu", "torch_dtype": "bfloat16", "pad_token_id": 0,
    "mla_use_nope": True, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32768, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 1048576,
}
TEMPLATES = {"k2": K25_TEMPLATE, "k3": K3_TEMPLATE}


def template_sglang_ids(num_layers: int) -> list[int]:
    """The rule behind the templates' eagle_config ids (SGLang's defaults, layer outputs)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def _template(draft: Eagle3Draft, family: str) -> dict[str, Any]:
    cfg = draft.config
    shapes = {k: getattr(cfg, k) for k in LAYER_SHAPE_KEYS if k != "max_position_embeddings"}
    return {"architectures": ["Eagle3DeepseekV2ForCausalLM"], **TEMPLATES[family], **shapes,
            "num_hidden_layers": 1, "num_key_value_heads": cfg.num_attention_heads,
            "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.vocab_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": template_sglang_ids(cfg.target_num_hidden_layers),
                             **EAGLE_CONFIG_EXTRAS},
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}


def _torchspec_tensors(draft: Eagle3Draft, embedding: torch.Tensor) -> dict[str, torch.Tensor]:
    """TorchSpec's draft state_dict: embed_tokens + the modules this project names alike, bf16."""
    tensors = {"embed_tokens.weight": embedding, **draft.exported_state()}
    return {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}


def _write(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"torchspec_version": TORCHSPEC_VERSION})
    return path


def torchspec_export(path: Path, draft: Eagle3Draft, embedding: torch.Tensor, family: str = "k2",
                     vllm: bool = True) -> Path:
    """tools/convert_to_hf.py of a full-vocabulary TorchSpec draft, with or without --vllm."""
    config = {**_template(draft, family), "_torchspec_version": TORCHSPEC_VERSION}
    tensors = _torchspec_tensors(draft, embedding)
    if vllm:      # _fixup_export_config (model_type kimi_k2) and _remap_weight_keys
        ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]
        tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
                   for k, v in tensors.items()}
    return _write(path, config, tensors)


def eagle31_export(path: Path, draft: Eagle3Draft, embedding: torch.Tensor) -> Path:
    """A K2.6 / K2.7 EAGLE 3.1 MLA draft: the K2.x --vllm export plus fc_norm and norm_output
    (the draft must have fc_norm, so that its fc_norm.{i}.weight tensors are written)."""
    assert draft.fc_norm is not None, "an EAGLE 3.1 draft has fc_norm tensors"
    torchspec_export(path, draft, embedding, "k2", vllm=True)
    config = json.loads((path / "config.json").read_text())
    config |= {"fc_norm": True, "norm_output": True}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


# The folders the tests rebuild: name -> which template, whether --vllm, whether EAGLE 3.1.
PUBLISHED = {
    "torchspec_vllm_k2": dict(family="k2", vllm=True),
    "torchspec_vllm_k3": dict(family="k3", vllm=True),
    "torchspec_sglang_ids": dict(family="k2", vllm=False),
    "eagle31_k2": dict(family="k2", vllm=True, eagle31=True),
}


def write_published(name: str, path: Path, draft: Eagle3Draft, embedding: torch.Tensor) -> Path:
    """The folder PUBLISHED[name] describes, holding `draft`'s weights."""
    spec = PUBLISHED[name]
    if spec.get("eagle31"):
        return eagle31_export(path, draft, embedding)
    return torchspec_export(path, draft, embedding, spec["family"], spec["vllm"])
