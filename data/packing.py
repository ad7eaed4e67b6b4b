"""Next-fit grouping of items by token count: the trainer packs rows with it (train/batches.py)
and the dump sizes its capture calls with it (dump/pipeline.py). A leaf module."""
from __future__ import annotations

from collections.abc import Sequence


def pack_next_fit(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """Indices into `lengths`, in order, grouped into rows of at most max_len tokens (each length
    counted as min(length, max_len)); a row closes when the next sample does not fit."""
    rows: list[list[int]] = []
    row: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        n = min(n, max_len)
        if row and used + n > max_len:
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += n
    if row:
        rows.append(row)
    return rows
