"""From the trainer's state to a draft: the draft's weights gathered off a live DeepSpeed engine,
or consolidated from a DeepSpeed checkpoint folder, and the CPU fp32 draft holding them (which
model.checkpoint.export_draft writes as a vLLM draft folder)."""
from __future__ import annotations

from pathlib import Path

import torch

from model.draft import DraftConfig, Eagle3Draft
from train.deepspeed_setup import zero_stage


def gathered_draft_state(engine) -> dict[str, torch.Tensor]:
    """The draft's state_dict in fp32 on the CPU, on every rank (collective under ZeRO-3)."""
    import deepspeed

    draft = engine.module.draft
    with deepspeed.zero.GatheredParameters(list(draft.parameters()), enabled=zero_stage(engine) == 3):
        return {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype, copy=True)
                for k, v in draft.state_dict().items()}


def draft_from_state(cfg: DraftConfig, state: dict[str, torch.Tensor], d2t: torch.Tensor | None) -> Eagle3Draft:
    """A CPU fp32 draft holding `state` (keys as Eagle3Draft.state_dict names them)."""
    draft = Eagle3Draft(cfg)
    wanted = draft.state_dict()
    missing = [k for k in wanted if k not in state and k not in ("d2t", "t2d")]
    if missing:
        raise KeyError(f"the training state lacks {missing}")
    draft.load_state_dict({k: state[k] for k in wanted if k in state}, strict=False)
    if d2t is not None:
        draft.set_vocab(d2t)
    return draft


def consolidated_checkpoint_state(folder: Path) -> dict[str, torch.Tensor]:
    """The draft's fp32 weights from a DeepSpeed checkpoint folder (any ZeRO stage, any ranks)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    prefix = "draft."
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
