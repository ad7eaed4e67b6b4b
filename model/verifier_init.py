"""Start the draft layer from the verifier's own weights instead of random ones.

The draft layer has the verifier's attention and dense-MLP shapes (conf/draft), so a verifier layer
fits it almost as is:
- attention (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj and their norms) from the
  verifier's layer `layer`. The draft's q_a_proj and kv_a_proj_with_mqa read [embeds, hidden]
  (2H); the verifier's weights go to the hidden half, the embedding half keeps its random init;
- hidden_norm (the norm of the hidden half) from that layer's input_layernorm;
- the dense MLP and post_attention_layernorm from the verifier's last dense layer (DeepSeek-V3's
  first_k_dense_replace layers; the MoE layers' experts are another shape);
- fc passes the deepest aux state through (its block the identity, the others zero), so the hidden
  the copied layer first reads is a verifier residual stream, as it was trained on.
The embedding's input_layernorm, the final norm and lm_head are left as they are (the final norm
and lm_head are the verifier's already). Nothing else of the verifier is read: a handful of
tensors by name (model/verifier_weights.py), whatever the checkpoint's size.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from model.draft import Eagle3Draft
from model.verifier_weights import read_tensors

ATTENTION = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
             "o_proj")
WIDE_INPUT = ("q_a_proj", "kv_a_proj_with_mqa")     # read [embeds, hidden] in the draft
MLP = ("gate_proj", "up_proj", "down_proj")


def last_dense_layer(verifier_dir: Path) -> int:
    """The last layer whose MLP is dense (DeepSeek-V3: the first first_k_dense_replace layers)."""
    config = json.loads((Path(verifier_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    dense = int(config.get("first_k_dense_replace", config["num_hidden_layers"]))
    if dense < 1:
        raise ValueError(f"{verifier_dir}: no dense layer (first_k_dense_replace {dense}) to start the MLP from")
    return dense - 1


@torch.no_grad()
def init_from_verifier_layer(draft: Eagle3Draft, verifier_dir: Path, layer: int) -> None:
    """Copy the verifier's layer `layer` (attention) and its last dense MLP into the draft layer
    (module docstring). Refuses shapes that differ from the draft's, naming the tensor."""
    cfg = draft.config
    if not 0 <= layer < cfg.target_num_hidden_layers:
        raise ValueError(f"train.init_from_verifier={layer}: the verifier has layers 0..{cfg.target_num_hidden_layers - 1}")
    if cfg.target_hidden_size != cfg.hidden_size:
        raise ValueError("train.init_from_verifier needs the draft's hidden size to be the verifier's")
    prefix = f"model.layers.{layer}."
    dense = f"model.layers.{last_dense_layer(verifier_dir)}."
    names = {f"self_attn.{n}": prefix + f"self_attn.{n}.weight" for n in ATTENTION}
    names |= {f"mlp.{n}": dense + f"mlp.{n}.weight" for n in MLP}
    names |= {"hidden_norm": prefix + "input_layernorm.weight",
              "post_attention_layernorm": dense + "post_attention_layernorm.weight"}
    tensors = read_tensors(verifier_dir, names.values())
    H = cfg.hidden_size
    midlayer = draft.midlayer
    for ours, theirs in names.items():
        target: nn.Parameter = midlayer.get_submodule(ours).weight
        source = tensors[theirs]
        wide = ours.split(".")[-1] in WIDE_INPUT
        expected = (target.shape[0], target.shape[1] - H) if wide else tuple(target.shape)
        if tuple(source.shape) != tuple(expected):
            raise ValueError(f"{theirs} is {tuple(source.shape)}, the draft's {ours} needs {tuple(expected)}")
        if wide:
            target[:, H:].copy_(source)             # the hidden half; [embeds, hidden] order (model/draft.py)
        else:
            target.copy_(source)
    fc = draft.fc.weight                            # [H, n_aux * H_t], aux states in aux_layer_ids order
    deepest = max(range(cfg.num_aux), key=lambda i: cfg.aux_layer_ids[i])
    fc.zero_()
    fc[:, deepest * H:(deepest + 1) * H].copy_(torch.eye(H, dtype=fc.dtype))
