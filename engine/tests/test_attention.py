"""Grid attention: a query position's output is the same bit for bit however its prompt was
chunked on the grid (the engine's scheduling-invariance rests on it), and equal to plain causal
SDPA up to rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentserving.engine.model.attention import GRID, grid_attention, grid_blocks

H, D, L = 4, 32, 700


def _module() -> torch.nn.Module:
    return torch.nn.Module().eval()


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, steps: list[int],
             mask: bool) -> torch.Tensor:
    """Queries fed in ``steps`` as an engine with a KV cache feeds them (keys up to the step's
    end), with an explicit boolean mask as transformers builds it, or None (causal)."""
    outs, s = [], 0
    for n in steps:
        e = s + n
        m = (torch.arange(e)[None, :] <= torch.arange(s, e)[:, None])[None, None] if mask \
            else None
        out, _ = grid_attention(_module(), q[:, :, s:e], k[:, :, :e], v[:, :, :e], m)
        outs.append(out)
        s = e
    return torch.cat(outs, dim=1)


def test_blocks_are_cut_on_the_absolute_grid():
    assert grid_blocks(0, 130) == [(0, GRID), (GRID, 2 * GRID), (2 * GRID, 130)]
    assert grid_blocks(100, 1) == [(100, 101)]
    assert grid_blocks(60, 10) == [(60, 64), (64, 70)]


def test_any_chunking_on_the_grid_gives_the_same_bits():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D) for _ in range(3))
    whole = _chunked(q, k, v, [L], mask=False)
    for steps in ([256, 256, 188], [512, 188], [256] * 2 + [64] * 2 + [60], [640, 60]):
        for mask in (False, True):
            assert torch.equal(_chunked(q, k, v, steps, mask), whole), (steps, mask)
    # off the grid nothing is promised: a row fed alone is another call than its block
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(whole, causal, rtol=1e-5, atol=1e-6)


def test_grouped_query_heads_match_repeated_keys():
    torch.manual_seed(1)
    q = torch.randn(1, 4, 100, D)
    k, v = torch.randn(1, 2, 100, D), torch.randn(1, 2, 100, D)
    got, _ = grid_attention(_module(), q, k, v, None)
    want, _ = grid_attention(_module(), q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                             None)
    assert torch.equal(got, want)
