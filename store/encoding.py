"""The encodings of hidden states a store uses (store/format.py describes where each lands):
bf16 bits and byte planes, fp8 (e4m3, a scale per row), fp4 (e2m1, a scale per block), top-k
targets in place of final states, and which rows of a sample a training loss reads. Pure
functions of tensors and arrays; their error bounds are in their docstrings."""
from __future__ import annotations

import sys

import numpy as np
import torch

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP4_MAX = 6.0    # the largest e2m1


def encode_bf16(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """bf16 bits as uint16, same shape; wider floats are rounded to nearest even."""
    # A copy, never a view: the caller may reuse its buffer once a sample is added.
    bits = torch.as_tensor(x).detach().to("cpu", torch.bfloat16, copy=True).contiguous()
    return bits.view(torch.int16).numpy().view(np.uint16)


def decode_bf16(bits: np.ndarray) -> torch.Tensor:
    """The bfloat16 tensor whose bits `encode_bf16` stored."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def encode_bf16_planes(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """bf16 values [N, ...] as two byte planes, uint8 [N, 2, ...]: [:, 0] the high bytes (sign and
    7 exponent bits), [:, 1] the low bytes (the last exponent bit and 7 mantissa bits).

    Why: a hidden state's exponents repeat and its mantissas are noise. Compressed apart (each
    plane is its own chunk), the high plane shrinks about 3x and the low one is left as it is;
    compressed together, or byte-shuffled within one block, the noise hides the repeats. On
    kimi-tiny's states zstd-1 stores planes at 1.51x (aux) against 1.38x for blosc-zstd-3 with
    byte shuffle on the uint16 bits, at twice the speed (bench/results/storage.json)."""
    # Without a copy of the input: the bf16 bits' two bytes, read in place as uint8 pairs (the
    # shifts and masks of uint16 arrays made three temporaries the size of the sample).
    bits = torch.as_tensor(x).detach()
    if bits.device.type != "cpu" or bits.dtype != torch.bfloat16 or not bits.is_contiguous():
        bits = bits.to("cpu", torch.bfloat16).contiguous()
    pairs = bits.view(torch.uint8).numpy().reshape(*bits.shape, 2)        # [..., 2] in memory order
    high, low = (1, 0) if sys.byteorder == "little" else (0, 1)
    planes = np.empty((bits.shape[0], 2, *bits.shape[1:]), dtype=np.uint8)
    planes[:, 0], planes[:, 1] = pairs[..., high], pairs[..., low]
    return planes


def decode_bf16_planes(planes: np.ndarray) -> torch.Tensor:
    """The bfloat16 tensor [N, ...] whose byte planes [N, 2, ...] `encode_bf16_planes` stored."""
    bits = (planes[:, 0].astype(np.uint16) << 8) | planes[:, 1]
    return decode_bf16(bits)


def encode_fp8(x: torch.Tensor | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float8_e4m3fn bits as uint8 [..., H] and float32 scales [...], one per row of H values.

    scale = amax / 448 maps each row's largest value onto e4m3's largest, so every element keeps
    3 mantissa bits: |x - decoded| <= |x| / 16 + scale * 2**-10 (the second term for values that
    fall into e4m3's subnormal range, below scale * 2**-6).
    """
    values = torch.as_tensor(x).detach().to("cpu", torch.float32)
    amax = values.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # all-zero rows: 1
    # The clamp only catches the float32 rounding of amax / scale past 448.
    codes = (values / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8).numpy(), scale.squeeze(-1).numpy()


def decode_fp8(codes: np.ndarray, scale: np.ndarray, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """codes [..., H] * scale [...] as `dtype`."""
    values = torch.from_numpy(np.ascontiguousarray(codes)).view(torch.float8_e4m3fn).float()
    return (values * torch.from_numpy(np.ascontiguousarray(scale)).unsqueeze(-1)).to(dtype)


# e2m1's magnitudes, in the order of their 3-bit codes; bit 3 is the sign.
_FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_FP4_MIDPOINTS = (_FP4_GRID[1:] + _FP4_GRID[:-1]) / 2  # exact in float32
_FP4_CODES = torch.cat([_FP4_GRID, -_FP4_GRID]).numpy()
# Both values of each byte, [256, 2]: one gather decodes a byte (low nibble first).
_FP4_PAIRS = np.stack([_FP4_CODES[np.arange(256) & 15], _FP4_CODES[np.arange(256) >> 4]], axis=1)
# The same pairs as bf16 bits (int16): e2m1's values are exact in bf16.
_FP4_PAIRS_BF16 = torch.from_numpy(_FP4_PAIRS).to(torch.bfloat16).view(torch.int16).numpy()
_BF16_ONE = 0x3F80
_FP4_ROWS_AT_ONCE = 1 << 22  # values encoded per step: bounds the int32 temporaries to 16 MB


def encode_fp4(x: torch.Tensor | np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """e2m1 codes, two per byte (even index in the low nibble), uint8 [..., H / 2], and one scale
    per block of `block` consecutive values along H as bf16 bits, uint16 [..., H / block].

    scale = amax_block / 6, rounded UP to a bf16 (so every |x| / scale <= 6 and nothing is
    clamped; an all-zero block gets 1); each x / scale is rounded to the nearest of 0, 0.5, 1,
    1.5, 2, 3, 4, 6 (and negatives). The grid's spacing is 0.5 up to 2 and at most a quarter of
    the value above, so |x - decoded| <= max(scale, |x|) / 4. Finite inputs only.
    """
    # Encoded where x lies (a GPU does the rounding much faster), returned on the CPU.
    values = torch.as_tensor(x).detach().float()
    *lead, h = values.shape
    if h % 2 or block < 1 or h % block:
        raise ValueError(f"fp4 needs an even H divisible by the block of {block}, got H={h}")
    flat = values.reshape(-1, h)
    codes = np.empty((len(flat), h // 2), np.uint8)
    scales = np.empty((len(flat), h // block), np.uint16)
    step = max(1, _FP4_ROWS_AT_ONCE // h)
    for start in range(0, len(flat), step):
        rows = slice(start, start + step)
        codes[rows], scales[rows] = _encode_fp4_rows(flat[rows], block)
    return codes.reshape(*lead, h // 2), scales.reshape(*lead, h // block)


def _encode_fp4_rows(values: torch.Tensor, block: int) -> tuple[np.ndarray, np.ndarray]:
    """encode_fp4 of a [R, H] float32 tensor."""
    blocks = values.reshape(len(values), -1, block)
    scale_bits = _fp4_scale_bits(blocks.abs().amax(dim=-1))
    scaled = blocks / _bf16_bits_to_float(scale_bits).unsqueeze(-1)
    magnitude = torch.bucketize(scaled.abs(), _FP4_MIDPOINTS.to(scaled.device), out_int32=True)
    # A value that rounds to 0 gets +0, never -0: one code for zero compresses better.
    nibbles = (magnitude | (((scaled < 0) & (magnitude > 0)).int() << 3)).reshape(len(values), -1, 2)
    packed = (nibbles[..., 0] | (nibbles[..., 1] << 4)).to("cpu", torch.uint8)
    return packed.numpy(), scale_bits.to("cpu", torch.int32).numpy().astype(np.uint16)


def _fp4_scale_bits(amax: torch.Tensor) -> torch.Tensor:
    """bf16 bits (int32) of amax / 6 rounded up, so that 6 * scale >= amax; 1 where amax is 0."""
    bits = (amax / FP4_MAX).view(torch.int32)
    up = (bits >> 16) + ((bits & 0xFFFF) != 0).int()  # positive floats: a larger pattern is larger
    # amax / 6 was itself rounded to nearest in float32; where it fell short, one bf16 step more.
    # (6 * a bf16 is exact in float32, so the comparison is exact.)
    up = up + (_bf16_bits_to_float(up) * FP4_MAX < amax).int()
    return torch.where(amax > 0, up, torch.full_like(up, _BF16_ONE))


def _bf16_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32)


def decode_fp4(codes: np.ndarray, scale_bits: np.ndarray, block: int = 32,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [..., H] tensor, as `dtype`, that `encode_fp4` stored as codes [..., H / 2] and
    scale_bits [..., H / block]: e2m1 value * scale, exact in float32 before the cast to dtype.

    To bfloat16 (what the trainer reads) the product is formed in bf16 directly: an e2m1 value and
    a bf16 scale are both bf16, their product is exact in float32 and torch rounds it to bf16 once,
    so the result is the same bits as the float32 path cast, at half the memory traffic (about
    10x faster on Kimi-width rows)."""
    codes = np.ascontiguousarray(codes)
    *lead, half = codes.shape
    h = 2 * half
    scale_bits = np.ascontiguousarray(scale_bits)
    # np.take: several times faster than fancy indexing or a torch gather of int64 indices.
    if dtype == torch.bfloat16:
        values = torch.from_numpy(np.take(_FP4_PAIRS_BF16, codes, axis=0)).view(torch.bfloat16)
        scale = torch.from_numpy(scale_bits.view(np.int16)).view(torch.bfloat16)
        return (values.reshape(*lead, h // block, block) * scale.unsqueeze(-1)).reshape(*lead, h)
    values = torch.from_numpy(np.take(_FP4_PAIRS, codes, axis=0)).reshape(*lead, h // block, block)
    scale = _bf16_bits_to_float(torch.from_numpy(scale_bits.astype(np.int32)))
    return (values * scale.unsqueeze(-1)).reshape(*lead, h).to(dtype)


# Logits computed at once by encode_topk: [rows, V] float32 of 256 MB, whatever V.
_TOPK_LOGITS_AT_ONCE = 1 << 26
FLOAT16_MIN = -65504.0


def verifier_topk(final: torch.Tensor, head: torch.Tensor, k: int, max_logits: int = _TOPK_LOGITS_AT_ONCE
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's k most likely next tokens at each row of final [M, H], descending, on head's
    device: (ids int64 [M, k], log-probabilities float32 [M, k]), logprobs = log_softmax(final.float()
    @ head.T) over the full vocabulary of head [V, H] (the lm_head), computed in float32 a block of
    rows at a time (at most max_logits logits: never an [M, V] tensor). The writer stores these
    (encode_topk); the trainer computes them on the fly from final states (train/topk_ce.py)."""
    weight = head.detach().float()  # a no-op for a float32 head
    ids = torch.empty(len(final), k, dtype=torch.int64, device=weight.device)
    logprobs = torch.empty(len(final), k, dtype=torch.float32, device=weight.device)
    step = max(1, max_logits // len(weight))
    with torch.no_grad():
        for start in range(0, len(final), step):
            rows = final[start:start + step].to(weight.device, torch.float32)
            top = torch.log_softmax(rows @ weight.T, dim=-1).topk(k, dim=-1)  # sorted: descending
            ids[start:start + step] = top.indices
            logprobs[start:start + step] = top.values
    return ids, logprobs


def encode_topk(final: torch.Tensor, head: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """verifier_topk as the store keeps it: (ids int32 [M, k], log-probabilities float16 [M, k]).
    The ids are exact; the log-probabilities are the float32 values rounded to float16 (relative
    error <= 2**-11), any below -65504 clamped to it so that a stored row stays finite."""
    ids, logprobs = verifier_topk(final, head, k)
    return (ids.to("cpu", torch.int32).numpy(),
            logprobs.clamp(min=FLOAT16_MIN).to("cpu", torch.float16).numpy())


def target_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """bool [T]: the rows of a sample whose final state a training loss reads, row j where
    j + 1 < T and loss_mask[j + 1] (the next token is an assistant token)."""
    mask = torch.as_tensor(loss_mask).to(torch.bool)
    rows = torch.zeros_like(mask)
    rows[:-1] = mask[1:]
    return rows
