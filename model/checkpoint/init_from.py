"""Training started from a draft folder (`train.init_from`): the folder's config, switches and
vocabulary read (`read_draft_folder`, `init_switches`, `draft_config_for_run`) and its weights put
into a built draft (`init_from_draft`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from model.draft import ARCHITECTURE_FLAGS, DraftConfig, Eagle3Draft
from model.checkpoint.names import CONFIG_FILE, EMBED, HEAD, WEIGHTS_FILE
from model.checkpoint.config_json import draft_config_from_json
from model.checkpoint.folder import read_tensors, read_folder_config, stored_names

if TYPE_CHECKING:
    from model.compatibility import DraftFolder
    from model.verifier_handle import Verifier

logger = logging.getLogger(__name__)


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


def draft_config_for_run(draft_conf: Mapping[str, Any], verifier: Verifier | None,
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
    tensors = read_tensors(path)
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
