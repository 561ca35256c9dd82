"""The CPU decode path's pieces against their references: the CPU flash kernel in ``attention.segment`` gives the
einsum path's output and log-sum-exp."""

from __future__ import annotations

import pytest
import torch

from flashguard.kv import attention


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("lq,keys,causal", [(1, 7, False), (1, 300, False), (5, 300, False), (40, 40, True)])
def test_segment_on_the_cpu_is_the_einsum_reference(dtype, tol, lq, keys, causal):
    g = torch.Generator().manual_seed(lq + keys)
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for shape in ((3, 3, lq, 64), (3, keys, 64), (3, keys, 64)))
    o, lse = attention.segment(q, k, v, 0.125, causal=causal)
    mask = torch.ones(lq, keys, dtype=torch.bool).tril_(keys - lq) if causal else None
    o_ref, lse_ref = attention._partial(q.float(), k.float(), v.float(), 0.125, mask)
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.float(), lse_ref.float(), rtol=tol, atol=tol)
