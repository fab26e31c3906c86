"""The chunked-prefill mask at its valid shape [C, D+C], and offset-causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentserving.kernels import offset_causal_attention, prefill_mask
from agentserving.kernels import reference as ref

CASES = [(1, 0), (5, 0), (5, 7), (16, 48), (3, 130)]  # (chunk C, cached D)


@pytest.mark.parametrize("chunk,cached", CASES)
def test_reference_is_full_mask_sliced(chunk: int, cached: int) -> None:
    max_len = cached + chunk + 37
    mask = prefill_mask(chunk, cached)
    full = ref.full_prefill_mask(chunk, cached, max_len)
    assert mask.shape == (chunk, cached + chunk) and mask.dtype == torch.bool
    assert torch.equal(mask, full[:, :cached + chunk])
    assert not full[:, cached + chunk:].any()
    assert mask[:, :cached].all()  # the whole cached prefix is visible to every row
    assert torch.equal(mask[:, cached:], torch.ones(chunk, chunk, dtype=torch.bool).tril())
    additive = prefill_mask(chunk, cached, dtype=torch.float16)
    assert torch.equal(additive == 0, mask) and torch.isinf(additive[~mask]).all()
    assert torch.equal(additive, ref.full_prefill_mask(chunk, cached, max_len,
                                                       dtype=torch.float16)[:, :cached + chunk])


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk,cached", CASES)
def test_triton_mask_equals_reference(device: str, dtype: torch.dtype, chunk: int,
                                      cached: int) -> None:
    want = prefill_mask(chunk, cached, dtype=dtype, device=device, impl="reference")
    got = prefill_mask(chunk, cached, dtype=dtype, device=device, impl="triton")
    assert got.shape == (chunk, cached + chunk) and got.dtype == dtype
    assert torch.equal(got, want)


def _allocated_bytes(fn) -> int:  # type: ignore[no-untyped-def]
    """Bytes the torch CPU allocator handed out while ``fn`` ran (profiler, all ops)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    return sum(max(e.cpu_memory_usage, 0) for e in prof.events())


def test_mask_memory_is_valid_shape_only() -> None:
    chunk, cached, max_len = 256, 16_128, 131_072
    mask = prefill_mask(chunk, cached)
    valid_bytes = chunk * (cached + chunk)
    assert mask.untyped_storage().nbytes() == valid_bytes
    used = _allocated_bytes(lambda: prefill_mask(chunk, cached))
    full_bytes = chunk * max_len
    # the mask itself plus small int64 aranges (profiler events may count a temporary twice);
    # the [C, max_len] mask would be 8x the valid one here
    assert valid_bytes <= used <= 1.25 * valid_bytes
    assert used < full_bytes / 7
    # the old way, for contrast (and to show the measurement sees a big allocation)
    assert _allocated_bytes(lambda: ref.full_prefill_mask(chunk, cached, max_len)) >= full_bytes


def _attn_inputs(heads: int, kv_heads: int, chunk: int, cached: int, dim: int,
                 dtype: torch.dtype, device: str, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, chunk, dim, generator=g).to(dtype).to(device)
    k = torch.randn(kv_heads, cached + chunk, dim, generator=g).to(dtype).to(device)
    v = torch.randn(kv_heads, cached + chunk, dim, generator=g).to(dtype).to(device)
    return q, k, v


@pytest.mark.parametrize("chunk,cached", [(5, 0), (16, 48), (20, 30)])
def test_reference_attention_matches_full_mask_path(chunk: int, cached: int) -> None:
    q, k, v = _attn_inputs(4, 2, chunk, cached, 8, torch.float32, "cpu")
    got = offset_causal_attention(q, k, v, cached)
    full = ref.full_prefill_mask(chunk, cached, cached + chunk + 64)[:, :cached + chunk]
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0),
                                          attn_mask=full)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if cached == 0:  # no prefix: plain causal attention
        plain = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 0),
                                               v.repeat_interleave(2, 0), is_causal=True)
        torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3),
                                       (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("chunk,cached,dim", [(5, 0, 8), (20, 30, 12)])
def test_triton_attention_close_to_reference(device: str, dtype: torch.dtype, tol: float,
                                             chunk: int, cached: int, dim: int) -> None:
    """Not bit for bit (flash-style sums in another order): within dtype tolerance."""
    q, k, v = _attn_inputs(4, 2, chunk, cached, dim, dtype, device, seed=chunk)
    want = offset_causal_attention(q, k, v, cached, impl="reference")
    got = offset_causal_attention(q, k, v, cached, impl="triton")
    assert got.shape == q.shape and got.dtype == dtype and torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # top-left causal alignment (SDPA's is_causal over [C, D+C]) is the bug an offset-causal
    # kernel exists to avoid: it differs whenever there is a cached prefix
    top_left = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 0),
                                              v.float().repeat_interleave(2, 0), is_causal=True)
    assert torch.allclose(got.float(), top_left, atol=tol) == (cached == 0)


def test_attention_rejects_shape_mismatch() -> None:
    q, k, v = _attn_inputs(4, 2, 5, 3, 8, torch.float32, "cpu")
    with pytest.raises(ValueError):
        offset_causal_attention(q, k, v, 4)
    with pytest.raises(ValueError):
        offset_causal_attention(q[:3], k, v, 3)
