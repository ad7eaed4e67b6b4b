"""Whether a run's parts fit together: the one check, reporting every disagreement at once.

    check_compatible(verifier=..., draft=..., store=..., aux_capture=..., folder=..., d2t=...)

Parts (each optional; the pairs of those given are compared):

- verifier: the Verifier handle (model/verifier_handle.py): its folder's config and identity
  hashes, and the aux layers the configuration names
- draft: the DraftConfig the run builds (`d2t`: its pruned vocabulary, once counted)
- store: a StoreReader, what its store.json says it was dumped with; `aux_capture`: what the
  draft's aux states are when it is served (the draft conf's aux_capture)
- folder: an exported draft folder (`DraftFolder`): train.init_from's, or the draft an
  evaluation serves

Pairs: store and verifier (config and tokenizer hashes, layer count), store and draft (hidden
size, vocabulary, aux layers in the vLLM convention, aux capture), draft and verifier (vocabulary,
hidden size, layer count, aux layers), folder and draft (what fixes the tensors' shapes, what
the draft reads, the architecture switches, d2t), or, without a draft, folder and verifier. Each
Disagreement names the two sides, their values and the setting to change. A disagreement that
involves the store raises StoreIncompatibleError (a StoreMismatchError: `python -m train` exits
with status 2), any other IncompatibleError (a ValueError).
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from model.aux_ids import to_vllm_aux_ids
from model.draft import ARCHITECTURE_FLAGS, DraftConfig
from model.verifier_handle import Verifier
from store.identity import StoreMismatchError

if TYPE_CHECKING:
    from store.reader import StoreReader

logger = logging.getLogger(__name__)

# Which pair a disagreement is of (reported in this order): the store and the verifier or the
# draft; the draft and the verifier; a draft folder and the draft it would start; a draft folder
# and the verifier it would serve.
STORE, DRAFT, INIT_FROM, FOLDER = "store", "draft", "init_from", "folder"
PAIRS = (STORE, DRAFT, INIT_FROM, FOLDER)

# What fixes a draft folder's tensor shapes, what the draft reads, or how its norms are wired
# (weights trained under one wiring are no starting point for another): must match to seed a run.
INIT_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
               "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "target_hidden_size",
               "vocab_size", "draft_vocab_size", "aux_layer_ids", *ARCHITECTURE_FLAGS)
# What changes the draft's computation but not its tensors: reported, training may move on from it.
INIT_SOFT_FIELDS = ("rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_interleave")
_IDENTITY_KEYS = ("config_sha256", "tokenizer_sha256", "num_hidden_layers")


@dataclass(frozen=True)
class DraftFolder:
    """An exported draft folder as the check reads it (model/checkpoint/init_from.py read_draft_folder)."""

    path: Path
    config: DraftConfig
    states_layers: bool          # its config.json names target_num_hidden_layers (others' may not)
    d2t: Tensor | None = None    # its pruned vocabulary, where it has one and it was read


@dataclass(frozen=True)
class Disagreement:
    """One setting two parts disagree on: (side, value) of each, and what to change."""

    pair: str
    what: str
    sides: tuple[tuple[str, Any], tuple[str, Any]]
    change: str

    def __str__(self) -> str:
        (a, mine), (b, theirs) = self.sides
        return f"{self.what}: {a} has {_show(mine)}, {b} has {_show(theirs)} (change {self.change})"


class IncompatibleError(ValueError):
    """Parts of a run that do not fit together; `problems` holds every Disagreement found."""

    def __init__(self, message: str, problems: Sequence[Disagreement]) -> None:
        super().__init__(message)
        self.problems = tuple(problems)


class StoreIncompatibleError(IncompatibleError, StoreMismatchError):
    """IncompatibleError with the store among the parts that disagree."""


def check_compatible(*, verifier: Verifier | None = None, draft: DraftConfig | None = None,
                     store: StoreReader | None = None, aux_capture: str | None = None,
                     folder: DraftFolder | None = None, d2t: Tensor | None = None) -> None:
    """Refuse parts that do not fit together, naming every disagreement (see the module doc)."""
    problems = disagreements(verifier=verifier, draft=draft, store=store, aux_capture=aux_capture,
                             folder=folder, d2t=d2t)
    if folder is not None and draft is not None:
        _warn_soft_fields(folder, draft)
    if not problems:
        return
    message = " ".join(_sentence(pair, [p for p in problems if p.pair == pair], verifier, store, folder)
                       for pair in PAIRS if any(p.pair == pair for p in problems))
    error = StoreIncompatibleError if any(p.pair == STORE for p in problems) else IncompatibleError
    raise error(message, problems)


def disagreements(*, verifier: Verifier | None = None, draft: DraftConfig | None = None,
                  store: StoreReader | None = None, aux_capture: str | None = None,
                  folder: DraftFolder | None = None, d2t: Tensor | None = None) -> list[Disagreement]:
    """Every Disagreement between the parts given, store pairs first."""
    found: list[Disagreement] = []
    if store is not None and verifier is not None:
        found += _store_and_verifier(store, verifier)
    if store is not None and draft is not None:
        found += _store_and_draft(store, draft, aux_capture)
    if draft is not None and verifier is not None:
        found += _draft_and_verifier(draft, verifier)
    if folder is not None and draft is not None:
        found += _folder_and_draft(folder, draft, d2t)
    elif folder is not None and verifier is not None:
        found += _folder_and_verifier(folder, verifier)
    return found


# ---- the pairs ----------------------------------------------------------------------------
def _store_and_verifier(store: StoreReader, verifier: Verifier) -> list[Disagreement]:
    recorded, here = store.identity, verifier.identity
    change = "verifier.path to the verifier the store was dumped from, or store_dir"
    return [Disagreement(STORE, f"verifier {key}", (("the store", recorded.get(key)), ("the verifier", here[key])),
                         change)
            for key in _IDENTITY_KEYS if recorded.get(key) != here[key]]


def _store_and_draft(store: StoreReader, draft: DraftConfig, aux_capture: str | None) -> list[Disagreement]:
    recorded = store.identity
    try:
        store_aux: Any = to_vllm_aux_ids(store.aux_layer_ids, store.aux_convention, int(recorded["num_hidden_layers"]))
    except ValueError as error:
        store_aux = f"unreadable ids ({error})"
    pairs = [
        ("hidden size", store.hidden_size, draft.target_hidden_size, "store_dir, or verifier"),
        ("vocabulary", int(recorded["vocab_size"]), draft.vocab_size, "store_dir, or verifier"),
        ("aux layer ids (vLLM convention)", store_aux, list(draft.aux_layer_ids),
         "verifier.aux_layer_ids, which the draft's follow, or store_dir"),
    ]
    if aux_capture is not None:
        pairs.append(("aux capture", store.aux_capture, aux_capture,
                      "draft.aux_capture, the mode the draft is served with, or store_dir"))
    return [Disagreement(STORE, what, (("the store", theirs), ("the draft", mine)), change)
            for what, theirs, mine, change in pairs if theirs != mine]


def _draft_and_verifier(draft: DraftConfig, verifier: Verifier) -> list[Disagreement]:
    pairs = [
        ("vocab_size", draft.vocab_size, verifier.vocab_size, "verifier.architecture.vocab_size, or verifier.path"),
        ("target_hidden_size", draft.target_hidden_size, verifier.hidden_size,
         "verifier.architecture.hidden_size, or verifier.path"),
        ("target_num_hidden_layers", draft.target_num_hidden_layers, verifier.num_hidden_layers,
         "verifier.architecture.num_hidden_layers, or verifier.path"),
    ]
    if verifier.aux_layer_ids is not None:
        pairs.append(("aux_layer_ids (vLLM convention)", list(draft.aux_layer_ids), list(verifier.aux_layer_ids),
                      "draft.aux_layer_ids, or verifier.aux_layer_ids"))
    return [Disagreement(DRAFT, what, (("the draft", mine), ("the verifier", theirs)), change)
            for what, mine, theirs, change in pairs if mine != theirs]


def _folder_and_draft(folder: DraftFolder, draft: DraftConfig, d2t: Tensor | None) -> list[Disagreement]:
    found = folder.config
    # Third-party folders may not state the target's layer count; their aux ids are checked anyway.
    fields = INIT_FIELDS + (("target_num_hidden_layers",) if folder.states_layers else ())
    problems = [Disagreement(INIT_FROM, field, (("the folder", getattr(found, field)),
                                             ("the configured draft", getattr(draft, field))),
                             f"draft.{field}, or train.init_from")
                for field in fields if getattr(found, field) != getattr(draft, field)]
    if d2t is not None and (folder.d2t is None or not _same(folder.d2t, d2t)):
        problems.append(Disagreement(INIT_FROM, "d2t (the pruned vocabulary)",
                                     (("the folder", _Text(_fingerprint(folder.d2t))),
                                      ("the configured draft (counted from the run's store)", _Text(_fingerprint(d2t)))),
                                     "train.init_from to a draft of this vocabulary, or draft.draft_vocab_size"))
    return problems


def _folder_and_verifier(folder: DraftFolder, verifier: Verifier) -> list[Disagreement]:
    found = folder.config
    pairs = [("vocab_size", found.vocab_size, verifier.vocab_size),
             ("target_hidden_size", found.target_hidden_size, verifier.hidden_size)]
    if folder.states_layers:
        pairs.append(("target_num_hidden_layers", found.target_num_hidden_layers, verifier.num_hidden_layers))
    if verifier.aux_layer_ids is not None:
        pairs.append(("aux_layer_ids (vLLM convention)", list(found.aux_layer_ids), list(verifier.aux_layer_ids)))
    return [Disagreement(FOLDER, what, (("the draft folder", mine), ("the verifier", theirs)),
                         "draft_dir to a draft trained for this verifier, or verifier")
            for what, mine, theirs in pairs if mine != theirs]


def _warn_soft_fields(folder: DraftFolder, draft: DraftConfig) -> None:
    for field in INIT_SOFT_FIELDS:
        theirs, mine = getattr(folder.config, field), getattr(draft, field)
        if theirs != mine:
            logger.warning("%s: %s is %s there, %s in the configured draft; training continues with the latter",
                           folder.path, field, theirs, mine)


# ---- the message --------------------------------------------------------------------------
def _sentence(pair: str, problems: list[Disagreement], verifier: Verifier | None, store: StoreReader | None,
              folder: DraftFolder | None) -> str:
    items = "; ".join(str(p) for p in problems)
    where = f"verifier {verifier.name} ({verifier.path})" if verifier is not None else "the verifier"
    if pair == STORE:
        assert store is not None
        return (f"store {store.path} does not match the draft config ({where}): {items}. "
                "Dump a store with this verifier, or point `store_dir=` at one.")
    if pair == DRAFT:
        return f"the draft config does not fit {where}: {items}."
    assert folder is not None
    if pair == INIT_FROM:
        return f"{folder.path} cannot start this draft: {items}."
    return f"{folder.path} does not fit {where}: {items}."


class _Text(str):
    """A value shown as written, not quoted."""

    def __repr__(self) -> str:
        return str(self)


def _show(value: Any) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and bool((a.cpu() == b.cpu()).all())


def _fingerprint(d2t: Tensor | None) -> str:
    if d2t is None:
        return "none"
    digest = hashlib.sha256(d2t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:12]
    return f"{d2t.numel()} ids (sha256 {digest})"
