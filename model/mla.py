"""Multi-Latent Attention (DeepSeek-V2/V3) for the EAGLE-3 draft layer, TTT-ready.

Parameter names are DeepSeek's (q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj) so the vLLM checkpoint is a plain rename. The projections
that read the layer input (q_a_proj / q_proj, kv_a_proj_with_mqa) take `input_size`, which is
2H for the EAGLE-3 first layer (cat[embedding, hidden]). The attention over the training-time
test's steps is model/ttt_attention.py's. RMSNorm keeps its input and the fp32 1/rms per row for
the backward, not the fp32 input.

Packed rows: `segment_ids` [B, T] (int, one id per sample in the row; give padding an id no
sample uses) keeps attention inside a sample; positions restart per sample in `positions`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from model.rope import RopeSpec, RotaryEmbedding
from model.ttt_attention import ATTENTION_IMPLS, TTTCache
from model.ulysses import gather_positions, to_heads, to_positions


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm whose backward needs only its input (as given) and the fp32 1/rms per row: autograd
    through the fp32 maths would keep an fp32 copy of x and the normalised x as well. With
    xhat = x / rms(x) and g = dy * weight (fp32): dx = (g - xhat * mean(g * xhat)) / rms(x),
    dweight = sum over rows of dy * xhat (xhat rounded to x's dtype, as the forward multiplies)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)              # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        acc = torch.promote_types(rstd.dtype, dy.dtype)
        xhat = x.to(acc) * rstd
        dx = dw = None
        if ctx.needs_input_grad[1]:
            rows = dy.reshape(-1, dy.shape[-1]).to(acc)
            dw = (rows * xhat.to(x.dtype).reshape(rows.shape).to(acc)).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            g = dy.to(acc) * weight.to(acc)
            dx = ((g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd).to(x.dtype)
        return dx, dw, None


class RMSNorm(nn.Module):
    """RMSNorm in fp32, cast back before the weight (vLLM's and DeepSeek's order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


@dataclass(frozen=True)
class MLAConfig:
    input_size: int              # width of the layer input (2H in the EAGLE-3 first layer)
    hidden_size: int             # o_proj output width (H)
    num_heads: int
    q_lora_rank: int | None      # None: a single q_proj instead of q_a_proj/q_a_layernorm/q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope: RopeSpec

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim



class MLAttention(nn.Module):
    """DeepSeek MLA with the TTT cache API.

    forward(x, positions, cache=None, segment_ids=None) -> (out [B, T, H], cache):
    with cache None this is step 0 (K0/V0 are computed and returned as a new cache); with a
    cache from the previous step, this step's keys join it as diagonal keys.
    """

    def __init__(self, cfg: MLAConfig, attention: str = "ttt") -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.num_heads
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.input_size, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.input_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        # One shared (MQA) rope key per position rides along with the compressed KV latent.
        self.kv_a_proj_with_mqa = nn.Linear(cfg.input_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope)
        self.scale = cfg.rope.softmax_scale(cfg.qk_head_dim)
        self.attention = attention
        self._attend = ATTENTION_IMPLS[attention]

    def project(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: [B, T, input_size], positions: [B, T] -> q, k: [B, T, heads, qk_head_dim], v: [B, T, heads, v_head_dim]."""
        cfg = self.cfg
        B, T = x.shape[:2]
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, cfg.num_heads, cfg.qk_head_dim)                 # per head: [nope | rope]
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)

        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)   # per head: [k_nope | v]

        q_pe = self.rotary(q_pe, positions)                              # [B, T, heads, rope]
        k_pe = self.rotary(k_pe[:, :, None, :], positions)               # [B, T, 1, rope]
        q = torch.cat((q_nope, q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe.expand(B, T, cfg.num_heads, cfg.qk_rope_head_dim)), dim=-1)
        # v on its own storage: the TTT cache keeps it for the later steps and the backward, and
        # as a view of kv it would keep k_nope's half of kv alive too.
        return q, k, v.contiguous()

    # Sequence parallelism (model/ulysses.py): the group whose ranks split each row; None: off.
    sequence_group: torch.distributed.ProcessGroup | None = None

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        cache: TTTCache | None = None,
        segment_ids: Tensor | None = None,
    ) -> tuple[Tensor, TTTCache]:
        """With a sequence_group, x, positions and segment_ids are this rank's positions of each
        row; the attention runs over the whole row for this rank's heads, and the cache holds the
        whole row's keys of those heads."""
        q, k, v = self.project(x, positions)
        group = self.sequence_group
        if group is not None:
            q, k, v = to_heads((q, k, v), group)                        # [B, T, heads/SP, d]
            segment_ids = None if segment_ids is None else gather_positions(segment_ids, group)
        cache = TTTCache(k, v) if cache is None else cache.extend(k, v)
        out = self._attend(q, cache, self.scale, segment_ids)           # [B, T, heads, dv]
        if group is not None:
            out = to_positions(out, group)                              # [B, T/SP, heads, dv]
        return self.o_proj(out.flatten(-2)), cache

