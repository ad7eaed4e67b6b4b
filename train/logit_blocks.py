"""The [chunk, V] fp32 blocks the chunked losses (train/soft_ce.py, train/topk_ce.py) compute
their logits in, a chunk of rows at a time, and the in-place maths both share on them.

Memory: logits exist only for `chunk` tokens at a time ([chunk, V] fp32 blocks of about
`chunk_bytes`), in the forward and in the backward, which recomputes them. In a low precision
(bf16) the matmuls run on rows padded up to a multiple of ROW_GRID and land in a scratch buffer
before their fp32 copy.
"""
from __future__ import annotations

import torch
from torch import Tensor

# Row counts of the loss's low-precision matmuls are padded up to a multiple of this: the CPU's
# bf16 kernels (oneDNN) build and keep a kernel per shape, and the counted positions of a
# micro-batch are a new number at nearly every step, so unpadded matmuls spend the step compiling
# kernels, and a long run fills the kernel cache (and the memory) with shapes seen once.
ROW_GRID = 64


def on_row_grid(n: int) -> int:
    return -(-n // ROW_GRID) * ROW_GRID


class LogitBlocks:
    """The [chunk, V] fp32 buffers of one pass, allocated once and reused for every chunk (fresh
    100 MB blocks per chunk cost page faults on the CPU), and the in-place maths on them."""

    def __init__(self, chunk: int, target_vocab: int, draft_vocab: int, pruned: bool, dtype: torch.dtype,
                 device: torch.device, acceptance: bool = False) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        self.target = torch.empty(chunk, target_vocab, **f32)            # verifier logits
        self.kept = torch.empty(chunk, draft_vocab, **f32) if pruned else None   # ... on the draft vocabulary
        self.draft = torch.empty(chunk, draft_vocab, **f32)              # draft logits
        # A third block beside p and z: the acceptance term's q (forward) and d(-alpha)/dz
        # (backward), or p * z where the plain loss takes its gradients in the forward.
        self.accept = torch.empty(chunk, draft_vocab, **f32) if acceptance else None
        # Matmuls in a low precision land here before their fp32 copy, on rows padded to the grid.
        self.grid_rows = on_row_grid(chunk)
        self.scratch = (torch.empty(self.grid_rows * max(target_vocab, draft_vocab), dtype=dtype, device=device)
                        if dtype != torch.float32 else None)
        self.rows: Tensor | None = None          # [grid rows, H] low-precision inputs, zero past the rows

    def padded_rows(self, x: Tensor) -> Tensor:
        """x [c, H] copied into the rows buffer, zero rows up to on_row_grid(c)."""
        n = x.shape[0]
        if self.rows is None or self.rows.shape[1] != x.shape[1]:
            self.rows = x.new_empty(self.grid_rows, x.shape[1])
        rows = self.rows[:on_row_grid(n)]
        rows[:n] = x
        rows[n:].zero_()
        return rows

    def logits(self, out: Tensor, x: Tensor, w: Tensor) -> Tensor:
        """out[:c] = x @ w.T in fp32; x [c, H], w [V, H]."""
        out = out[:x.shape[0]]
        if self.scratch is None:
            return torch.mm(x, w.T, out=out)
        rows = self.padded_rows(x)
        low = self.scratch[:rows.shape[0] * w.shape[0]].view(rows.shape[0], w.shape[0])
        return out.copy_(torch.mm(rows, w.T, out=low)[:x.shape[0]])

    def target_probs(self, target_hidden: Tensor, target_head: Tensor, keep: Tensor | None,
                     with_top: bool = True) -> tuple[Tensor, Tensor | None]:
        """(p [c, Vd] on the draft vocabulary, verifier top-1 [c] target ids or None)."""
        logits = self.logits(self.target, target_hidden, target_head)   # [c, V]
        top = row_argmax(logits) if with_top else None
        if keep is not None:                                             # restricted to t2d
            logits = torch.index_select(logits, 1, keep, out=self.kept[:logits.shape[0]])
        return softmax_(logits), top



# Column width of row_argmax's blocks: the block maxima are one vectorised reduction, and the
# argmax that follows reads 1/ARGMAX_BLOCK of the row plus one block.
ARGMAX_BLOCK = 128
# Logits blocks smaller than this (16 MiB of fp32) keep torch's argmax: it takes a few
# milliseconds there, and the blocked one's two temporaries would set a small step's memory peak,
# which the memory plan's check against a real rank (tests/test_plan.py) reads to 0.1%. The
# training's and Kimi's loss chunks (thousands of rows at V 8k, hundreds at 164k) are above it.
ARGMAX_BLOCKED_MIN = 1 << 22


def row_argmax(z: Tensor) -> Tensor:
    """[c, V] -> [c] int64, z.argmax(-1) exactly (the first of equal maxima). On the CPU, where
    torch's argmax over a row is a scalar loop, several times slower than its amax, through the
    maxima of ARGMAX_BLOCK-wide blocks: the first block holding the row's maximum, then the first
    maximum inside it. Also on the meta device, so that the memory plan (train/plan.py) follows the
    CPU's temporaries; a GPU's plan then counts a [c, V / ARGMAX_BLOCK] and a [c, ARGMAX_BLOCK]
    block more than its torch argmax makes."""
    c, V = z.shape
    if (z.device.type not in ("cpu", "meta") or V % ARGMAX_BLOCK or c * V < ARGMAX_BLOCKED_MIN
            or not z.is_contiguous()):
        return z.argmax(-1)
    blocks = z.view(c, V // ARGMAX_BLOCK, ARGMAX_BLOCK)
    first = blocks.amax(-1).argmax(-1)                                      # [c] block index
    inner = blocks[torch.arange(c, device=z.device), first].argmax(-1)      # [c] index inside it
    return first * ARGMAX_BLOCK + inner


def softmax_(z: Tensor) -> Tensor:
    """Softmax over the last dim, in place (no temporary of z's size)."""
    z.sub_(z.amax(-1, keepdim=True)).exp_()
    return z.div_(z.sum(-1, keepdim=True))


def logsumexp_(z: Tensor) -> Tensor:
    """[c, V] -> [c] logsumexp, overwriting z; -inf for a row that is all -inf."""
    m = z.amax(-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return z.sub_(m[:, None]).exp_().sum(-1).log_().add_(m)


def accumulate_grads(blocks: LogitBlocks, dz: Tensor, x: Tensor, head: Tensor, grad_x: Tensor | None,
                      grad_w: Tensor | None) -> None:
    """One chunk's gradients from dz [c, Vd] = d loss / d logits: grad_x [c, H] = dz @ head
    (written), grad_w [Vd, H] += dz.T @ x (fp32); the matmuls in x's dtype (a low one on rows
    padded to the grid, zero past c)."""
    if x.dtype == torch.float32:
        if grad_x is not None:
            torch.mm(dz, head, out=grad_x)
        if grad_w is not None:
            grad_w.addmm_(dz.T, x)
        return
    n = dz.shape[0]
    low = blocks.scratch[:on_row_grid(n) * dz.shape[1]].view(-1, dz.shape[1])
    low[:n].copy_(dz)
    low[n:].zero_()
    if grad_x is not None:
        grad_x.copy_(torch.mm(low, head)[:n])
    if grad_w is not None:
        grad_w += (low.T @ blocks.padded_rows(x)).float()
