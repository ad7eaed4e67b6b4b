"""From the trainer's state to a draft: the draft's weights gathered off a live DeepSpeed engine,
or consolidated from a DeepSpeed checkpoint folder, and the CPU fp32 draft holding them (which
model.checkpoint.export_draft writes as a vLLM draft folder); the training facts the run writes
beside them (model/training_facts.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from config.stages import TrainJob
from model.checkpoint import HEAD
from model.draft import DraftConfig, Eagle3Draft
from model.training_facts import TrainingFacts
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
                     verifier: Verifier | None = None) -> Eagle3Draft:
    """A CPU draft holding the tensors of `state` themselves (keys as Eagle3Draft.state_dict names
    them; no copy, no [V, H] of its own: the embedding is left unmade, an export that ships it reads
    the verifier's). A checkpoint of a draft whose lm_head is the verifier's does not hold it: it is
    read from `verifier`."""
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    wanted = draft.state_dict()
    if HEAD not in state and verifier is not None and draft.shares_verifier_head:
        state = {**state, HEAD: verifier.lm_head()}
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


def training_facts(cfg: TrainJob, summary: dict[str, Any]) -> TrainingFacts:
    """The facts of a finished run (its config and `fit`'s summary) that its draft folder keeps."""
    from hydra.core.hydra_config import HydraConfig

    t, held = cfg.train, summary["heldout"] or {}
    warmup = f"{t.warmup_steps} steps" if t.warmup_steps is not None else f"{t.warmup_ratio} of the steps"
    loss = "soft cross-entropy against the verifier's distribution"
    if t.loss.acceptance is not None:
        loss += f", acceptance term {t.loss.acceptance} (weight {t.loss.acceptance_weight})"
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None
    command = "python -m train " + " ".join(overrides) if overrides is not None else "(fit called in-process)"
    return TrainingFacts(
        store_dir=cfg.store_dir, steps=int(summary["steps"]), world_size=int(summary["world_size"]),
        zero_stage=int(summary["zero_stage"]), precision=summary["precision"], micro_batch=t.micro_batch,
        grad_accum=t.grad_accum, max_len=t.max_len, lr=float(summary["peak_lr"]), warmup=warmup,
        min_lr_ratio=t.min_lr_ratio, grad_clip=t.grad_clip, ttt_steps=t.ttt.steps, ttt_decay=t.ttt.decay, loss=loss,
        heldout_accept_length=held.get("accept_length"), heldout_chain_accept_length=held.get("chain_accept_length"),
        command=command.strip())
