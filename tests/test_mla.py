"""Tests of model/rope.py, model/mla.py and model/ttt_attention.py: RoPE against vLLM and transformers,
the TTT attention kernels."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.mla import MLAConfig, MLAttention, RMSNorm
from model.ttt_attention import (
    FLASH_LENGTH_MULTIPLE,
    MAX_BLOCK,
    MIN_BLOCK,
    TILE_BYTES,
    TTTCache,
    attention_block_size,
    attention_reference,
    attention_ttt,
    causal_attention_with_lse,
    flash_available,
    sample_spans,
    ttt_mask,
)
from model.rope import RopeSpec, RotaryEmbedding, yarn_get_mscale

# kimi-tiny's rope (conf/verifier/kimi_tiny.yaml) and Kimi-K2's (conf/verifier/kimi_k2.yaml).
TINY_ROPE = dict(rope_type="yarn", rope_theta=50000.0, factor=4.0, original_max_position_embeddings=1024,
                 beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
K2_ROPE = dict(rope_type="yarn", rope_theta=50000.0, factor=64.0, original_max_position_embeddings=4096,
               beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
# mscale != mscale_all_dim makes the cos/sin factor differ from 1.
ODD_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.0)


@pytest.mark.parametrize("rope", [TINY_ROPE, K2_ROPE, ODD_ROPE], ids=["tiny", "k2", "odd"])
def test_rope_equals_vllm_deepseek_rotary(rope: dict) -> None:
    """Bit-for-bit vLLM's DeepseekScalingRotaryEmbedding (what serves the draft), interleaved."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import DeepseekScalingRotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        theirs = DeepseekScalingRotaryEmbedding(
            64, 64, rope["original_max_position_embeddings"], rope["rope_theta"], False, rope["factor"],
            torch.float32, beta_fast=rope["beta_fast"], beta_slow=rope["beta_slow"], mscale=rope["mscale"],
            mscale_all_dim=rope["mscale_all_dim"])
    ours = RotaryEmbedding(RopeSpec.from_hf(rope, 64, interleaved=True))
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, rope["original_max_position_embeddings"] * int(rope["factor"]), (257,), generator=g)
    q, k = torch.randn(257, 4, 64, generator=g), torch.randn(257, 1, 64, generator=g)
    q_ref, k_ref = theirs.forward_native(pos, q.clone(), k.clone())
    torch.testing.assert_close(ours(q[None], pos[None])[0], q_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours(k[None], pos[None])[0], k_ref, rtol=0, atol=1e-6)


def test_rope_and_softmax_scale_match_transformers_deepseek_v3() -> None:
    """transformers de-interleaves before rotating: compare q.k scores, and the mscale^2 scale."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb_interleave,
    )

    config = DeepseekV3Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128,
                              kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                              max_position_embeddings=4096, rope_interleave=True, rope_parameters=dict(TINY_ROPE))
    spec = RopeSpec.from_hf(TINY_ROPE, 64, interleaved=True)
    assert spec.softmax_scale(128) == pytest.approx(DeepseekV3Attention(config, layer_idx=0).scaling, rel=1e-12)
    assert spec.softmax_scale(128) == pytest.approx(128 ** -0.5 * yarn_get_mscale(4.0, 1.0) ** 2)

    g = torch.Generator().manual_seed(1)
    T = 64
    pos = torch.randint(0, 4096, (1, T), generator=g)
    q, k = torch.randn(1, 4, T, 64, generator=g), torch.randn(1, 1, T, 64, generator=g)   # HF: [B, h, T, d]
    cos, sin = DeepseekV3RotaryEmbedding(config)(q, pos)
    q_hf, k_hf = apply_rotary_pos_emb_interleave(q, k, cos, sin)
    rope = RotaryEmbedding(spec)
    q_ours = rope(q.transpose(1, 2), pos).transpose(1, 2)                                  # ours: [B, T, h, d]
    k_ours = rope(k.transpose(1, 2), pos).transpose(1, 2)
    torch.testing.assert_close(q_ours @ k_ours.transpose(-1, -2), q_hf @ k_hf.transpose(-1, -2), rtol=1e-5, atol=2e-4)


def test_rope_rejects_what_it_cannot_match() -> None:
    with pytest.raises(ValueError):
        RopeSpec.from_hf(dict(TINY_ROPE, attention_factor=1.0), 64, True)
    with pytest.raises(ValueError):
        RopeSpec.from_hf(dict(rope_type="longrope", rope_theta=1e4), 64, True)


# ---- TTT attention ------------------------------------------------------------------------
def _cache(B: int, T: int, h: int, dqk: int, dv: int, steps: int, g: torch.Generator) -> tuple[torch.Tensor, TTTCache]:
    q = torch.randn(B, T, h, dqk, generator=g, dtype=torch.float64).float().requires_grad_()
    mk = lambda d: torch.randn(B, T, h, d, generator=g).requires_grad_()  # noqa: E731
    cache = TTTCache(mk(dqk), mk(dv))
    for _ in range(steps - 1):
        cache = cache.extend(mk(dqk), mk(dv))
    return q, cache


def _packed_segments(B: int, T: int) -> torch.Tensor:
    """Row 0: one sample; row 1: three samples and padding (id 99)."""
    seg = torch.zeros(B, T, dtype=torch.long)
    seg[1, 5:11], seg[1, 11:T - 3], seg[1, T - 3:] = 1, 2, 99
    return seg


# Keys are concatenated step by step: [k0 at positions 0..T-1 | step-1 keys at 0..T-1 | ...].
# Written out by hand for T=3: step 0 causal (within a sample), later steps only the query's own position.
_MASK_T3_2STEPS = [[1, 0, 0, 1, 0, 0],
                   [1, 1, 0, 0, 1, 0],
                   [1, 1, 1, 0, 0, 1]]
_MASK_T3_3STEPS = [[1, 0, 0, 1, 0, 0, 1, 0, 0],
                   [1, 1, 0, 0, 1, 0, 0, 1, 0],
                   [1, 1, 1, 0, 0, 1, 0, 0, 1]]
# Segments [0, 0, 1]: position 2 starts a new sample and no longer sees positions 0 and 1.
_MASK_T3_2STEPS_PACKED = [[1, 0, 0, 1, 0, 0],
                          [1, 1, 0, 0, 1, 0],
                          [0, 0, 1, 0, 0, 1]]
# Segments [0, 1, 1]: position 1 starts the second sample.
_MASK_T3_2STEPS_PACKED_LATE = [[1, 0, 0, 1, 0, 0],
                               [0, 1, 0, 0, 1, 0],
                               [0, 1, 1, 0, 0, 1]]


def _literal(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def test_ttt_mask_equals_hand_written_masks() -> None:
    cpu = torch.device("cpu")
    for steps, want in ((1, _literal(_MASK_T3_2STEPS)[:, :3]), (2, _literal(_MASK_T3_2STEPS)),
                        (3, _literal(_MASK_T3_3STEPS))):
        mask = ttt_mask(3, steps, None, 2, cpu)
        assert mask.dtype == torch.bool and mask.shape == (2, 1, 3, 3 * steps)
        assert torch.equal(mask[0, 0], want) and torch.equal(mask[1, 0], want), steps
    # Packed rows: row 0 one sample, row 1 two, row 2 two split elsewhere.
    seg = torch.tensor([[0, 0, 0], [0, 0, 1], [4, 7, 7]])
    mask = ttt_mask(3, 2, seg, 3, cpu)
    assert mask.shape == (3, 1, 3, 6)
    assert torch.equal(mask[0, 0], _literal(_MASK_T3_2STEPS))
    assert torch.equal(mask[1, 0], _literal(_MASK_T3_2STEPS_PACKED))
    assert torch.equal(mask[2, 0], _literal(_MASK_T3_2STEPS_PACKED_LATE))


def _attention_by_loop(q: torch.Tensor, cache: TTTCache, scale: float, seg: torch.Tensor) -> torch.Tensor:
    """Per query: softmax over exactly the step-0 keys at or before it in its own sample, and each
    later step's key at its own position; nothing shared with ttt_mask."""
    B, T, h, _ = q.shape
    out = torch.zeros(B, T, h, cache.v0.shape[-1], dtype=torch.float64)
    for b, t, head in itertools.product(range(B), range(T), range(h)):
        ks = [cache.k0[b, s, head] for s in range(t + 1) if seg[b, s] == seg[b, t]]
        vs = [cache.v0[b, s, head] for s in range(t + 1) if seg[b, s] == seg[b, t]]
        ks += [k[b, t, head] for k in cache.diag_k]
        vs += [v[b, t, head] for v in cache.diag_v]
        scores = torch.stack([(q[b, t, head].double() * k.double()).sum() for k in ks]) * scale
        weights = torch.exp(scores - scores.max())
        out[b, t, head] = (weights[:, None] * torch.stack(vs).double()).sum(0) / weights.sum()
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["one-sample", "packed"])
def test_ttt_attention_attends_exactly_the_intended_keys(packed: bool) -> None:
    g = torch.Generator().manual_seed(11)
    B, T, h, steps = 2, 7, 2, 3
    seg = torch.tensor([[0] * 7, [0, 0, 1, 1, 1, 5, 5]]) if packed else torch.zeros(B, T, dtype=torch.long)
    with torch.no_grad():
        q, cache = _cache(B, T, h, 4, 3, steps, g)
        want = _attention_by_loop(q, cache, 0.6, seg).float()
        for kernel in (attention_reference, attention_ttt):
            got = kernel(q, cache, 0.6, seg if packed else None)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=kernel.__name__)


def _assert_equals_reference(kernel, q: torch.Tensor, cache, leaves: list[torch.Tensor], upstream: torch.Tensor,
                             segment_ids: torch.Tensor | None) -> None:
    """`kernel`'s output and the gradients of every leaf equal the explicit-mask reference's."""
    outs, grads = [], []
    for fn in (attention_reference, kernel):
        out = fn(q, cache, 0.37, segment_ids)
        outs.append(out)
        grads.append(torch.autograd.grad((out * upstream).sum(), leaves))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.parametrize("packed", [False, True], ids=["one-sample", "packed"])
def test_ttt_attention_equals_reference_with_gradients(steps: int, packed: bool) -> None:
    g = torch.Generator().manual_seed(steps)
    B, T, h, dqk, dv = 2, 24, 3, 16, 8
    segment_ids = _packed_segments(B, T) if packed else None
    q, cache = _cache(B, T, h, dqk, dv, steps, g)
    leaves = [q, cache.k0, cache.v0, *cache.diag_k, *cache.diag_v]
    upstream = torch.randn(B, T, h, dv, generator=g)

    _assert_equals_reference(attention_ttt, q, cache, leaves, upstream, segment_ids)


@pytest.mark.parametrize("block", [1, 5, 8, 64])
@pytest.mark.parametrize("steps", [1, 3])
def test_ttt_attention_in_blocks_equals_reference_with_gradients(block: int, steps: int) -> None:
    """Query blocks that split the row and the packed samples: forward and every gradient (q, K0,
    V0 and each diagonal key and value) equal the explicit-mask reference's."""
    g = torch.Generator().manual_seed(10 + steps)
    B, T, h, dqk, dv = 2, 24, 3, 16, 8
    q, cache = _cache(B, T, h, dqk, dv, steps, g)
    leaves = [q, *cache.tensors()]
    upstream = torch.randn(B, T, h, dv, generator=g)
    seg = _packed_segments(B, T)
    _assert_equals_reference(lambda *a: attention_ttt(*a, block_size=block), q, cache, leaves, upstream, seg)


def test_ttt_attention_gradcheck_float64() -> None:
    g = torch.Generator().manual_seed(5)
    mk = lambda d: torch.randn(2, 7, 2, d, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    tensors = (mk(3), mk(3), mk(2), mk(3), mk(3), mk(2), mk(2))      # q, K0, V0, K1, K2, V1, V2
    seg = torch.tensor([[0] * 7, [0, 0, 0, 1, 1, 9, 9]])

    def fn(q, *cache):
        return attention_ttt(q, TTTCache.from_tensors(cache), 0.7, seg, block_size=3)

    assert fn(*tensors).dtype == torch.float64
    assert torch.autograd.gradcheck(fn, tensors, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_ttt_attention_saves_no_fp32_copy_of_a_row() -> None:
    """bf16 in (the training dtype): the backward keeps q, the cache's keys and values and the
    output in bf16, and only the log-sum-exp [B, T, heads] in fp32; the gradients, in bf16, follow
    the fp32 reference."""
    g = torch.Generator().manual_seed(6)
    B, T, h, dqk, dv, steps = 1, 40, 2, 16, 8, 3
    q32, cache32 = _cache(B, T, h, dqk, dv, steps, g)
    leaves = [t.detach().bfloat16().requires_grad_() for t in (q32, *cache32.tensors())]
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attention_ttt(leaves[0], TTTCache.from_tensors(tuple(leaves[1:])), 0.3, block_size=16)
    assert out.dtype == torch.bfloat16
    fp32 = [t for t in saved.values() if t.dtype == torch.float32]
    assert [tuple(t.shape) for t in fp32] == [(B, T, h)]                        # the merged lse
    # bf16: q and the steps' keys, the steps' values and the output; fp32: lse
    assert sum(t.untyped_storage().nbytes() for t in saved.values()) == (
        2 * B * T * h * (steps + 1) * (dqk + dv) + 4 * B * T * h)
    upstream = torch.randn(B, T, h, dv, generator=g)
    grads = torch.autograd.grad((out.float() * upstream).sum(), leaves)
    assert all(t.dtype == torch.bfloat16 for t in grads)
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = attention_reference(ref_leaves[0], TTTCache.from_tensors(tuple(ref_leaves[1:])), 0.3)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-2)
    for a, b in zip(grads, torch.autograd.grad((ref * upstream).sum(), ref_leaves)):
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2)


def test_sample_spans_are_the_runs_of_equal_segment_ids() -> None:
    seg = _packed_segments(2, 24)
    assert sample_spans(seg, 2, 24) == [(0, 0, 24), (1, 0, 5), (1, 5, 11), (1, 11, 21), (1, 21, 24)]
    assert sample_spans(None, 2, 7) == [(0, 0, 7), (1, 0, 7)]


@pytest.mark.parametrize("steps", [1, 3])
def test_fused_cpu_kernel_equals_the_blocked_one_with_gradients(steps: int) -> None:
    """attention_ttt on torch's fused CPU kernel (no block_size, fp32 on the CPU) against the
    plain-PyTorch query blocks, packed samples and padding: output and every gradient. Head sizes
    as MLA's, values narrower than keys."""
    g = torch.Generator().manual_seed(20 + steps)
    B, T, h, dqk, dv = 2, 24, 3, 16, 8
    q, cache = _cache(B, T, h, dqk, dv, steps, g)
    assert flash_available(q)
    leaves = [q, *cache.tensors()]
    upstream = torch.randn(B, T, h, dv, generator=g)
    seg = _packed_segments(B, T)
    results = []
    for kernel in (lambda *a: attention_ttt(*a), lambda *a: attention_ttt(*a, block_size=5)):
        out = kernel(q, cache, 0.41, seg)
        results.append((out, *torch.autograd.grad((out * upstream).sum(), leaves)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_fused_cpu_kernel_in_bf16_saves_what_the_blocked_one_saves() -> None:
    """bf16 in (the training dtype): the fused path keeps the same tensors for the backward as the
    blocked one (q, keys, values and output in bf16, one fp32 lse [B, T, heads]), and its output
    and gradients follow the fp32 reference within bf16 rounding."""
    g = torch.Generator().manual_seed(7)
    B, T, h, dqk, dv, steps = 1, 40, 2, 16, 8, 3
    q32, cache32 = _cache(B, T, h, dqk, dv, steps, g)
    leaves = [t.detach().bfloat16().requires_grad_() for t in (q32, *cache32.tensors())]
    seg = _packed_segments(2, T)[1:]
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attention_ttt(leaves[0], TTTCache.from_tensors(tuple(leaves[1:])), 0.3, seg)
    assert out.dtype == torch.bfloat16
    assert [tuple(t.shape) for t in saved.values() if t.dtype == torch.float32] == [(B, T, h)]
    assert sum(t.untyped_storage().nbytes() for t in saved.values()) == (
        2 * B * T * h * (steps + 1) * (dqk + dv) + 4 * B * T * h)
    upstream = torch.randn(B, T, h, dv, generator=g)
    grads = torch.autograd.grad((out.float() * upstream).sum(), leaves)
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = attention_reference(ref_leaves[0], TTTCache.from_tensors(tuple(ref_leaves[1:])), 0.3, seg)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-2)
    for a, b in zip(grads, torch.autograd.grad((ref * upstream).sum(), ref_leaves)):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2)


class _FlashLengths(TorchDispatchMode):
    """The sequence lengths the fused CPU kernel is called with, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "_scaled_dot_product_flash_attention_for_cpu" in str(func):
            self.lengths.append(args[0].shape[2])         # q [1, heads, n, width]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_kernel_in_bf16_meets_lengths_on_a_grid(dtype: torch.dtype) -> None:
    """In bf16 every packed sample reaches the fused kernel padded at its end to a multiple of
    FLASH_LENGTH_MULTIPLE positions (the kernel keeps state per length, and samples come in every
    length), forward and backward; fp32 runs each at its own length. The bf16 results still follow
    the fp32 reference (test above), padding and all."""
    g = torch.Generator().manual_seed(8)
    B, T, h, dqk, dv, steps = 2, 24, 2, 16, 8, 2
    q32, cache32 = _cache(B, T, h, dqk, dv, steps, g)
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q32, *cache32.tensors())]
    seg = _packed_segments(B, T)
    with _FlashLengths() as seen:
        out = attention_ttt(leaves[0], TTTCache.from_tensors(tuple(leaves[1:])), 0.3, seg)
        torch.autograd.grad(out.float().sum(), leaves)
    spans = [end - start for _, start, end in sample_spans(seg, B, T)]       # 24; 5, 6, 10, 3
    want = [FLASH_LENGTH_MULTIPLE] * len(spans) if dtype == torch.bfloat16 else spans
    assert seen.lengths == want + want                                        # forward, backward


class _ShapeRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_ttt_attention_builds_no_stacked_keys_or_3d_mask() -> None:
    """Every intermediate of attention_ttt stays within one step's [B, h, T, T] scores."""
    g = torch.Generator().manual_seed(0)
    B, T, h, dqk, dv, steps = 1, 40, 2, 16, 8, 4
    q, cache = _cache(B, T, h, dqk, dv, steps, g)
    with _ShapeRecorder() as rec:
        out = attention_ttt(q, cache, 0.3, _packed_segments(2, T)[1:])
        out.sum().backward()
    sizes = [torch.Size(s).numel() for s in rec.shapes]
    assert max(sizes) <= B * h * T * T
    assert not any(steps * T in s or (steps - 1) * T in s for s in rec.shapes)   # no (k+1)T key axis


# ---- block-wise causal attention with log-sum-exp --------------------------------------------
def _materialised_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                     segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager implementation the block-wise kernel replaced: full [B, h, T, T] fp32 scores and
    probabilities, differentiated by autograd. out [B, T, h, dv], lse [B, T, h]."""
    B, T = q.shape[:2]
    visible = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    if segment_ids is not None:
        visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :])
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale     # [B, h, T, T]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                       # [B, h, T]
    probs = torch.exp(scores - lse[..., None])
    return torch.einsum("bhts,bshd->bthd", probs, v.float()), lse.transpose(1, 2)


def _qkv(B: int, T: int, h: int, dqk: int, dv: int, g: torch.Generator,
         dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(B, T, h, d, generator=g, dtype=dtype).requires_grad_() for d in (dqk, dqk, dv))


def _three_rows(T: int) -> torch.Tensor:
    """Rows 0-1 as _packed_segments (row 1 ends in a padding segment); row 2 all padding (id -1, as
    collate_rows pads a batch), row 3 a one-token sample between padding."""
    seg = torch.cat((_packed_segments(2, T), torch.full((2, T), -1)))
    seg[3, T // 2] = 7
    return seg


def _out_lse_and_grads(fn, q, k, v, seg, r_out, r_lse) -> list[torch.Tensor]:
    """out, lse and the gradients of q, k, v of a loss that reads both outputs."""
    out, lse = fn(q, k, v, 0.37, seg)
    loss = (out * r_out).sum() + (lse * r_lse).sum()
    return [out, lse, *torch.autograd.grad(loss, (q, k, v))]


@pytest.mark.parametrize("T,block", [(24, 5), (24, 8), (24, 24), (24, 64), (37, 1), (37, 7), (37, None),
                                     (300, None), (300, 64)])
@pytest.mark.parametrize("segments", ["none", "packed+padding"])
def test_blockwise_attention_equals_materialised(T: int, block: int | None, segments: str) -> None:
    """Forward and the gradients through out AND lse (attention_ttt merges by lse), for blocks
    that do and do not divide T; T 300 with the default block runs two blocks (256 + 44)."""
    g = torch.Generator().manual_seed(T)
    seg = _three_rows(T) if segments != "none" else None
    B = 4 if seg is not None else 2
    q, k, v = _qkv(B, T, 3, 16, 8, g)
    r_out, r_lse = torch.randn(B, T, 3, 8, generator=g), torch.randn(B, T, 3, generator=g)
    ours = _out_lse_and_grads(lambda *a: causal_attention_with_lse(*a, block_size=block), q, k, v, seg, r_out, r_lse)
    ref = _out_lse_and_grads(_materialised_attention_with_lse, q, k, v, seg, r_out, r_lse)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ours, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
        assert torch.isfinite(a).all(), name


def _all_packed(T: int) -> torch.Tensor:
    """Two rows, each several samples then padding: no row is one sample, so query blocks past the
    first samples skip keys (what `_first_keys` finds)."""
    seg = torch.full((2, T), -1)
    seg[0, :7], seg[0, 7:T // 2], seg[0, T // 2:T - 4] = 0, 1, 2
    seg[1, :T // 3], seg[1, T // 3:T - 2] = 5, 6
    return seg


@pytest.mark.parametrize("T,block", [(40, 4), (40, 9), (64, 16)])
def test_blockwise_attention_skips_earlier_samples_exactly(T: int, block: int) -> None:
    from model.ttt_attention import query_blocks

    seg = _all_packed(T)
    blocks = query_blocks(T, block, seg)
    firsts = [lo for _, _, lo in blocks]
    assert max(firsts) > 0 and firsts == sorted(firsts)                 # later blocks start later
    for start, _, lo in blocks:             # the earliest sample start in the block's rows
        assert lo == min(int((seg[b] == seg[b, start]).nonzero().min()) for b in range(2))
    g = torch.Generator().manual_seed(T + block)
    q, k, v = _qkv(2, T, 3, 16, 8, g)
    r_out, r_lse = torch.randn(2, T, 3, 8, generator=g), torch.randn(2, T, 3, generator=g)
    ours = _out_lse_and_grads(lambda *a: causal_attention_with_lse(*a, block_size=block), q, k, v, seg, r_out, r_lse)
    ref = _out_lse_and_grads(_materialised_attention_with_lse, q, k, v, seg, r_out, r_lse)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)


def test_blockwise_attention_on_padding_rows_is_finite_and_local() -> None:
    """An all-padding row and padding segments attend the padding before them (the diagonal is
    always visible): finite, and the padding leaves the samples' outputs and gradients alone."""
    g = torch.Generator().manual_seed(5)
    T = 20
    seg = _three_rows(T)
    q, k, v = _qkv(4, T, 2, 8, 4, g)
    out, lse = causal_attention_with_lse(q, k, v, 0.5, seg, block_size=6)
    dq, dk, dv = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v), retain_graph=True)
    for t in (out, lse, dq, dk, dv):
        assert torch.isfinite(t).all()
    # Row 2 is padding throughout: its first position sees only itself.
    torch.testing.assert_close(out[2, 0], v[2, 0].detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(lse[2, 0], (q[2, 0] * k[2, 0]).sum(-1).detach() * 0.5, rtol=0, atol=1e-5)
    # Row 3's one-token sample sees only itself; its key gets gradient only from its own query.
    t = T // 2
    torch.testing.assert_close(out[3, t], v[3, t].detach(), rtol=0, atol=1e-6)
    pad = seg[3] != 7
    kept = torch.autograd.grad(lse[3, t].sum(), k)[0]
    assert kept[3, pad].abs().max() == 0 and kept[3, t].abs().max() > 0


def test_blockwise_attention_gradcheck_float64() -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = _qkv(2, 7, 2, 3, 2, g, torch.float64)
    seg = torch.tensor([[0] * 7, [0, 0, 0, 1, 1, 9, 9]])
    fn = lambda q, k, v: causal_attention_with_lse(q, k, v, 0.7, seg, block_size=3)  # noqa: E731
    assert fn(q, k, v)[0].dtype == torch.float64
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_blockwise_attention_keeps_the_inputs_dtypes() -> None:
    """bf16 in (the training dtype): fp32 out and lse, bf16 gradients, close to the fp32 run."""
    g = torch.Generator().manual_seed(4)
    q, k, v = _qkv(1, 40, 2, 16, 8, g, torch.bfloat16)
    out, lse = causal_attention_with_lse(q, k, v, 0.25, block_size=16)
    assert out.dtype == lse.dtype == torch.float32
    grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    assert all(t.dtype == torch.bfloat16 for t in grads)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out32, lse32 = _materialised_attention_with_lse(q32, k32, v32, 0.25)
    torch.testing.assert_close(out, out32, rtol=0, atol=1e-5)
    grads32 = torch.autograd.grad(out32.sum() + lse32.sum(), (q32, k32, v32))
    for a, b in zip(grads, grads32):
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2)


def _saved_bytes(fn, T: int) -> int:
    """Bytes of the distinct storages autograd saves for fn's backward at row length T."""
    g = torch.Generator().manual_seed(0)
    q, k, v = _qkv(1, T, 4, 16, 16, g)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(q, k, v, 0.25, torch.zeros(1, T, dtype=torch.long))
    return sum(saved.values())


def test_blockwise_attention_saves_linear_memory() -> None:
    """Doubling T doubles what the block-wise kernel saves (q, k, v, out, lse: exactly those),
    where the materialised one's [B, h, T, T] tensors quadruple."""
    blockwise = lambda *a: causal_attention_with_lse(*a, block_size=64)  # noqa: E731
    ours = [_saved_bytes(blockwise, T) for T in (256, 512)]
    ref = [_saved_bytes(_materialised_attention_with_lse, T) for T in (256, 512)]
    assert ours[1] / ours[0] == pytest.approx(2.0, rel=1e-3)
    assert ref[1] / ref[0] > 3.5
    T, h, d = 512, 4, 16
    assert ours[1] == 4 * (3 * T * h * d + T * h * d + T * h)        # q, k, v, out fp32 + lse


def test_blockwise_attention_tiles_skip_the_masked_triangle() -> None:
    """No intermediate exceeds one [B, h, block, T] tile, and block i only meets keys up to its
    own end: the first block's tile is [B, h, block, block]."""
    g = torch.Generator().manual_seed(1)
    B, T, h, block = 1, 60, 2, 20
    q, k, v = _qkv(B, T, h, 16, 8, g)
    with _ShapeRecorder() as rec:
        out, lse = causal_attention_with_lse(q, k, v, 0.3, block_size=block)
        (out.sum() + lse.sum()).backward()
    assert max(torch.Size(s).numel() for s in rec.shapes) <= B * h * block * T
    assert (B, h, block, block) in rec.shapes and (B, h, block, 2 * block) in rec.shapes


def test_default_block_size() -> None:
    """Kimi-K2 (64 heads, T 8192): 128 queries, a 256 MiB tile; never under MIN_BLOCK even when
    one tile row is large (Kimi-K3 at T 46000); short rows: MAX_BLOCK, or all of T."""
    assert attention_block_size(1, 64, 8192) == 128
    assert 1 * 64 * 128 * 8192 * 4 <= TILE_BYTES
    assert attention_block_size(1, 64, 46000) == MIN_BLOCK
    assert attention_block_size(1, 4, 2048) == MAX_BLOCK
    assert attention_block_size(1, 4, 100) == 100
    with pytest.raises(ValueError):
        causal_attention_with_lse(*_qkv(1, 4, 1, 2, 2, torch.Generator()), 1.0, block_size=0)


# ---- RMSNorm ----------------------------------------------------------------------------------
def _rms_norm_by_autograd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's maths as autograd differentiates it (what RMSNorm computed before its own backward)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_autograd_and_saves_only_its_input(dtype: torch.dtype) -> None:
    """Output bit for bit, gradients within rounding of autograd's through the fp32 maths; for the
    backward only x (in its dtype), the weight and the fp32 1/rms per row are kept."""
    g = torch.Generator().manual_seed(8)
    norm = RMSNorm(48, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g) * 0.5 + 1)
    x = (torch.randn(2, 5, 48, generator=g) * 3).to(dtype).requires_grad_()
    upstream = torch.randn(2, 5, 48, generator=g).to(dtype)
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = norm(x)
    assert {(tuple(t.shape), t.dtype) for t in saved.values()} == {((2, 5, 48), dtype), ((48,), dtype),
                                                                   ((2, 5, 1), torch.float32)}
    got = torch.autograd.grad(out, (x, norm.weight), upstream)
    ref_out = _rms_norm_by_autograd(x, norm.weight, 1e-6)
    assert torch.equal(out, ref_out)
    want = torch.autograd.grad(ref_out, (x, norm.weight), upstream)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, **tol)


# ---- the MLA module -----------------------------------------------------------------------
def _mla(q_lora_rank: int | None) -> MLAttention:
    torch.manual_seed(0)
    cfg = MLAConfig(input_size=64, hidden_size=32, num_heads=2, q_lora_rank=q_lora_rank, kv_lora_rank=24,
                    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6, rms_norm_eps=1e-6,
                    rope=RopeSpec.from_hf(TINY_ROPE, 8, interleaved=True))
    mla = MLAttention(cfg)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return mla


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q_lora", "q_proj"])
def test_mla_parameter_names_are_deepseeks(q_lora_rank: int | None) -> None:
    names = {n for n, _ in _mla(q_lora_rank).named_parameters()}
    q_names = {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"} if q_lora_rank else {"q_proj.weight"}
    assert names == q_names | {"kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"}


def test_mla_packed_row_equals_separate_samples() -> None:
    """Three TTT steps over a packed row give each sample what it gets alone."""
    mla = _mla(16)
    g = torch.Generator().manual_seed(3)
    lengths = [7, 5, 9]
    xs = [torch.randn(1, n, 64, generator=g) for n in lengths]
    packed_x = torch.cat(xs, dim=1)
    packed_pos = torch.cat([torch.arange(n) for n in lengths])[None]
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]

    def run(x, pos, seg_ids):
        cache, outs = None, []
        for k in range(3):
            out, cache = mla(x, pos + k, cache, seg_ids)
            outs.append(out)
        return outs

    packed = run(packed_x, packed_pos, seg)
    alone = [run(x, torch.arange(x.shape[1])[None], None) for x in xs]
    for k in range(3):
        torch.testing.assert_close(packed[k], torch.cat([a[k] for a in alone], dim=1), rtol=0, atol=1e-5)


def test_mla_step_keys_rotate_at_their_own_positions() -> None:
    """Shifting every position by the same offset leaves attention unchanged (relative RoPE)."""
    mla = _mla(None)
    x = torch.randn(1, 10, 64)
    pos = torch.arange(10)[None]
    out_a, cache_a = mla(x, pos)
    out_b, cache_b = mla(x, pos + 100)
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=1e-4)
    out_a1, _ = mla(x, pos + 1, cache_a)
    out_b1, _ = mla(x, pos + 101, cache_b)
    torch.testing.assert_close(out_a1, out_b1, rtol=0, atol=1e-4)
