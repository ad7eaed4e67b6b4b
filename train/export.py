"""From the trainer's state to a draft: the draft's weights gathered off a live DeepSpeed engine,
or consolidated from a DeepSpeed checkpoint folder, and the CPU fp32 draft holding them (which
model.checkpoint.export_draft writes as a vLLM draft folder)."""
from __future__ import annotations

from pathlib import Path

import torch

from model.checkpoint import HEAD
from model.draft import DraftConfig, Eagle3Draft
from model.verifier_handle import Verifier
from model.vocab import t2d_from_d2t
from train.deepspeed_setup import zero_stage


def gathered_draft_state(engine) -> dict[str, torch.Tensor]:
    """The draft's exported tensors on the CPU in the dtype they train in, on every rank (collective
    under ZeRO-3): copies, since training goes on after an export, but for a lm_head that is the
    verifier's, which nothing writes (at Kimi's vocabulary an fp32 copy of it is 4.7 GB)."""
    import deepspeed

    draft = engine.module.draft
    verifiers = None if isinstance(draft.lm_head.weight, torch.nn.Parameter) else draft.lm_head.weight
    with deepspeed.zero.GatheredParameters(list(draft.parameters()), enabled=zero_stage(engine) == 3):
        return {k: v.detach() if v is verifiers else v.detach().to("cpu", copy=True)
                for k, v in draft.exported_state().items()}


def draft_from_state(cfg: DraftConfig, state: dict[str, torch.Tensor], d2t: torch.Tensor | None,
                     verifier: Verifier | Path | None = None) -> Eagle3Draft:
    """A CPU draft holding the tensors of `state` themselves (keys as Eagle3Draft.state_dict names
    them; no copy, no [V, H] of its own: the embedding is left unmade, an export that ships it reads
    the verifier's). A checkpoint of a draft whose lm_head is the verifier's does not hold it: it is
    read from `verifier`."""
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    wanted = draft.state_dict()
    if HEAD not in state and verifier is not None and draft.shares_verifier_head:
        state = {**state, HEAD: Verifier.of(verifier).lm_head()}
    missing = [k for k in wanted if k not in state and k not in ("d2t", "t2d")]
    if missing:
        why = (" (a frozen full-vocabulary lm_head is the verifier's: name the verifier folder)"
               if missing == [HEAD] else "")
        raise KeyError(f"the training state lacks {missing}{why}")
    draft.load_state_dict({k: state[k] for k in wanted if k in state}, strict=False, assign=True)
    if d2t is not None:
        draft.d2t = d2t.clone()
    if cfg.pruned and (d2t is not None or draft.t2d.is_meta):
        draft.t2d = t2d_from_d2t(draft.d2t, cfg.vocab_size)
    return draft


def consolidated_checkpoint_state(folder: Path) -> dict[str, torch.Tensor]:
    """The draft's fp32 weights from a DeepSpeed checkpoint folder (any ZeRO stage, any ranks)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    prefix = "draft."
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
