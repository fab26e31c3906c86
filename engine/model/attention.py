"""Attention on a fixed grid of query blocks, so that a token's result does not depend on how
its prompt was chunked.

The engine promises that a turn's tokens and logits are the same bit for bit whatever its
scheduler did: one 2,048-token prefill step or eight of 256, KV restored from a tier or
recomputed. PyTorch's CPU attention kernel does not keep that promise by itself: it blocks the
keys by the call's own lengths (one block of 256 keys for a 256-token chunk, one of 512 for a
512-token chunk), and the online softmax over differently sized blocks rounds differently (up
to 2e-7 on AMD EPYC with AVX-512; on some CPUs the kernels happened to agree). The linear
layers are row-independent for the chunk sizes the scheduler uses; attention is where the rows
meet.

So attention is computed per block of ``GRID`` query positions aligned to absolute positions
(0-63, 64-127, ...), each block against exactly the keys up to its own end: the same call, on
the same numbers, whichever chunk the block arrived in. Scheduler budgets are multiples of the
KV chunk (256), so chunk boundaries fall on the grid; a decode step is a one-row block. Costs
``chunk / GRID`` kernel calls per layer and step instead of one, and no slower for it:
``python -m bench attention`` (the tiny model, a 4,096-token prompt in 2,048-token steps and 16
decode steps, best of 3, one thread) measured grid / SDPA = 0.87 twice on this 2-core machine
(the smaller key blocks skip most of the causal mask's dead work).

Registered with transformers' ``AttentionInterface`` under ``ATTENTION_NAME``; the loader
selects it for every model it loads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

ATTENTION_NAME = "agentserving_grid"
GRID = 64  # query positions per block; divides every chunk size the engine aligns to


def grid_blocks(q_start: int, q_len: int, grid: int = GRID) -> list[tuple[int, int]]:
    """(first, end) absolute query positions of each block of ``q_start .. q_start+q_len``:
    cut at multiples of ``grid``."""
    out, a = [], q_start
    end = q_start + q_len
    while a < end:
        b = min(end, (a // grid + 1) * grid)
        out.append((a, b))
        a = b
    return out


def grid_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor | None,
                   dropout: float = 0.0, scaling: float | None = None,
                   **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query ``[B, H, q, D]``, key/value ``[B, KVH, kv, D]``
    with the cache's keys first (the queries are the last ``q`` positions), a boolean or
    additive mask ``[B, 1, q, kv]`` or None (causal). Returns ``[B, q, H, D]``."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    q_len, kv_len = query.shape[2], key.shape[2]
    q_start = kv_len - q_len
    outs = []
    for a, b in grid_blocks(q_start, q_len):
        i0, i1 = a - q_start, b - q_start
        if attention_mask is not None:
            mask = attention_mask[:, :, i0:i1, :b]
        else:
            rows = torch.arange(a, b).unsqueeze(1)
            mask = torch.arange(b).unsqueeze(0) <= rows
        outs.append(F.scaled_dot_product_attention(
            query[:, :, i0:i1], key[:, :, :b], value[:, :, :b], attn_mask=mask,
            dropout_p=dropout if module.training else 0.0, scale=scaling))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make ``ATTENTION_NAME`` a transformers attention implementation; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, grid_attention)
    return ATTENTION_NAME
