"""The samples of a rank's next shard: each encoded as the storage settings say (store/format.py,
store/encoding.py) when it is added, and concatenated into the shard's arrays when it commits.
A writer keeps one buffer per kind of shard: training samples, and the trainer's held-out ones."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from config.groups import StoreConf
from store.encoding import encode_bf16_planes, encode_fp4, encode_fp8, encode_topk, target_rows
from store.format import (AUX, AUX_SCALE, FINAL, FINAL_OFFSETS, INPUT_IDS, LOSS_MASK, OFFSETS, TARGET_IDS,
                          TARGET_LOGPROBS, final_arrays)


@dataclass
class Pending:
    sample_id: str
    arrays: dict[str, np.ndarray]  # this sample's rows of the token arrays

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


@dataclass
class ShardBuffer:
    """The samples of the next shard of one kind: training, or held out (`heldout`)."""

    heldout: bool
    samples: list[Pending] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    nbytes: int = 0

    def add(self, pending: Pending) -> None:
        self.samples.append(pending)
        self.ids.add(pending.sample_id)
        self.nbytes += pending.nbytes

    def clear(self) -> None:
        self.samples, self.ids, self.nbytes = [], set(), 0


def encode_sample(storage: StoreConf, target_head: torch.Tensor | None, ids: torch.Tensor, mask: torch.Tensor,
                  aux: torch.Tensor, final: torch.Tensor) -> dict[str, np.ndarray]:
    """One sample's rows of a shard's arrays, as the storage settings encode them."""
    # Copies (the caller may reuse its buffers), as every encode_* function makes too.
    arrays = {INPUT_IDS: ids.to("cpu", torch.int32, copy=True).numpy(),
              LOSS_MASK: mask.to("cpu", torch.bool, copy=True).numpy()}
    arrays.update(_encode_aux(storage, aux))
    if storage.final_rows == "loss":  # the rows a training loss reads, no others
        final = final[target_rows(mask).to(final.device)]
    arrays.update(_encode_final(storage, target_head, final))
    return arrays


def _encode_aux(storage: StoreConf, aux: torch.Tensor) -> dict[str, np.ndarray]:
    encoding = storage.aux
    if encoding == "fp32":
        return {AUX: aux.to("cpu", torch.float32, copy=True).numpy()}
    if encoding == "fp8":
        codes, scale = encode_fp8(aux)
        return {AUX: codes, AUX_SCALE: scale}
    if encoding == "fp4":
        codes, scale = encode_fp4(aux, storage.fp4_block)
        return {AUX: codes, AUX_SCALE: scale}
    return {AUX: encode_bf16_planes(aux)}


def _encode_final(storage: StoreConf, target_head: torch.Tensor | None, final: torch.Tensor
                  ) -> dict[str, np.ndarray]:
    encoding = storage.final
    if encoding == "topk":
        assert target_head is not None  # checked_head made sure
        ids, logprobs = encode_topk(final, target_head, storage.topk)
        return {TARGET_IDS: ids, TARGET_LOGPROBS: logprobs}
    if encoding == "fp32":
        return {FINAL: final.to("cpu", torch.float32, copy=True).numpy()}
    return {FINAL: encode_bf16_planes(final)}


def checked_head(storage: StoreConf, head: torch.Tensor | None, hidden_size: int,
                 vocab_size: int) -> torch.Tensor | None:
    """What the storage settings need of the verifier's shapes, checked before anything is
    written; the lm_head as encode_topk uses it (float32, on its device), where final is topk."""
    if storage.aux == "fp4" and (hidden_size % 2 or hidden_size % storage.fp4_block):
        raise ValueError(f"storage mode {storage.mode!r}: aux fp4 needs fp4_block "
                         f"({storage.fp4_block}) to divide the hidden size {hidden_size}, and an "
                         "even hidden size")
    if storage.final != "topk":
        return None
    if storage.topk > vocab_size:
        raise ValueError(f"storage mode {storage.mode!r}: topk {storage.topk} is more than the "
                         f"vocabulary of {vocab_size} tokens")
    if head is None:
        raise ValueError(f"storage mode {storage.mode!r} stores the verifier's top-{storage.topk} "
                         "next-token distribution (final: topk): pass StoreWriter the verifier's "
                         "lm_head [V, H] as target_head")
    if tuple(head.shape) != (vocab_size, hidden_size):
        raise ValueError(f"target_head has shape {tuple(head.shape)}; the verifier's lm_head is "
                         f"[vocab_size, hidden_size] = [{vocab_size}, {hidden_size}]")
    return head.detach().float()  # a no-op for a float32 head


def concatenate(pending: Sequence[Pending], storage: StoreConf) -> dict[str, np.ndarray]:
    arrays = {name: np.concatenate([p.arrays[name] for p in pending])
              for name in pending[0].arrays}
    arrays[OFFSETS] = _offsets([len(p.arrays[INPUT_IDS]) for p in pending])
    if storage.final_rows == "loss":  # each sample's share of the compacted final side
        final_side = final_arrays(storage)[0]
        arrays[FINAL_OFFSETS] = _offsets([len(p.arrays[final_side]) for p in pending])
    return arrays


def _offsets(lengths: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
