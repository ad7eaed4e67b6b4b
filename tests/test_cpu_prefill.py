"""Tests of dump/cpu_prefill.py: vLLM's CPU MLA prefill attention on torch's fused kernel."""
from __future__ import annotations

import pytest
import torch

from dump.cpu_prefill import agrees_with, backend_class, fused_ragged_sdpa, vllm_ragged_sdpa


def _installed(worker) -> bool:
    from dump.cpu_prefill import backend_class, fused_ragged_sdpa

    return backend_class()._ragged_sdpa is fused_ragged_sdpa


@pytest.mark.parametrize("causal", [True, False])
def test_the_fused_prefill_equals_vllms_on_mla_shapes(causal: bool) -> None:
    """Kimi's MLA prefill heads (query-key 192, value 128), three requests of unequal lengths, the
    last a chunk of 40 queries against 100 keys: vLLM's dense method's output and log-sum-exp."""
    g = torch.Generator().manual_seed(3)
    heads, dqk, dv = 4, 192, 128
    q_cu, kv_cu = torch.tensor([0, 17, 317, 357]), torch.tensor([0, 17, 317, 417])
    q = torch.randn(357, heads, dqk, generator=g)
    k = torch.randn(417, heads, dqk, generator=g)
    v = torch.randn(417, heads, dv, generator=g)
    holder = type("Holder", (), {"scale": dqk ** -0.5})()
    want_out, want_lse = vllm_ragged_sdpa()(holder, q, k, v, q_cu, kv_cu, causal, True)
    got_out, got_lse = fused_ragged_sdpa(holder, q, k, v, q_cu, kv_cu, causal, True)
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=2e-5)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=2e-5)
    only_out = fused_ragged_sdpa(holder, q, k, v, q_cu, kv_cu, causal, False)
    assert torch.equal(only_out, got_out)


def test_the_probe_refuses_a_method_that_disagrees() -> None:
    def off_by_a_bit(self, q, k, v, q_cu, kv_cu, causal, return_lse):
        out, lse = vllm_ragged_sdpa()(self, q, k, v, q_cu, kv_cu, causal, True)
        return (out + 1e-3, lse) if return_lse else out + 1e-3

    assert agrees_with(vllm_ragged_sdpa())
    assert not agrees_with(off_by_a_bit)


def test_every_engine_worker_runs_the_fused_prefill(verifier_llm) -> None:
    """dump.engine.make_llm installs it in each worker of the engines it starts."""
    assert backend_class() is not None
    assert all(verifier_llm.collective_rpc(_installed))
