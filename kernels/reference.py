"""PyTorch reference implementations: the definition of what every other implementation must
produce, bit for bit for the data-movement kernels.

They are also the CPU path (the default there) and the NPU path (torch-npu dispatches these
same ops to its own kernels). Inputs are the canonical forms of :mod:`.layout`; the public,
validating entry points are in :mod:`.dispatch`.
"""

from __future__ import annotations

import math

import torch


def gather_blocks(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, tokens: int,
                  out: torch.Tensor) -> torch.Tensor:
    """Paged (K, V) ``[L, NB, BS, H, D]`` -> staging ``out[L, 2, tokens, H, D]``.

    One ``index_select`` per K and V (all layers, all blocks at once); holes read as zeros.
    """
    idx = table.to(torch.int64).clamp(min=0)
    hole = (table < 0).view(1, -1, 1, 1, 1)
    # on the CPU skip the zero-fill pass when there is no hole (elsewhere: no host sync)
    fill = table.device.type != "cpu" or bool(hole.any())
    n, bs = table.numel(), k.shape[2]
    for kv, src in enumerate((k, v)):
        dst = out[:, kv]
        if tokens == n * bs:  # select straight into the staging buffer (strided is fine)
            blocks = torch.index_select(src, 1, idx,
                                        out=dst.view(dst.shape[0], n, bs, *dst.shape[2:]))
        else:
            blocks = src.index_select(1, idx)  # [L, n, BS, H, D]
        if fill:
            blocks.masked_fill_(hole, 0)
        if tokens != n * bs:
            dst.copy_(blocks.flatten(1, 2)[:, :tokens])
    return out


def scatter_blocks(staging: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                   tokens: int) -> None:
    """Staging ``[L, 2, tokens, H, D]`` -> paged (K, V); holes are skipped."""
    bs = k.shape[2]
    n = table.numel()
    full = tokens // bs  # blocks written whole; a remainder lands in block ``full``
    table = table.to(torch.int64)
    ids = table[:full]
    keep = ids >= 0
    # no hole (the engine's case): one index_copy_ per K/V, no masked intermediate copy; a
    # run of consecutive ids (an allocator's usual table) is one plain slice copy
    whole = bool(keep.all()) if full else False
    run = whole and (full == 1 or bool((ids[1:] - ids[:-1] == 1).all()))
    first = int(ids[0]) if run else 0
    for kv, dst in enumerate((k, v)):
        src = staging[:, kv]
        if full:
            blocks = src[:, :full * bs].unflatten(1, (full, bs))
            if run:
                dst[:, first:first + full].copy_(blocks)
            elif whole:
                dst.index_copy_(1, ids, blocks)
            else:
                dst[:, ids[keep]] = blocks[:, keep]
        rest = tokens - full * bs
        if rest and full < n and int(table[full]) >= 0:
            dst[:, int(table[full]), :rest] = src[:, full * bs:]


def per_block_gather(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, tokens: int,
                     out: torch.Tensor, *, split_kv: bool = False) -> torch.Tensor:
    """The slow shape the seed measured: one small copy per (layer, block) — or per (layer,
    block, K/V) with ``split_kv``. Same result as :func:`gather_blocks`; for benchmarks."""
    bs = k.shape[2]
    ids = table.tolist()
    for layer in range(k.shape[0]):
        for i, bid in enumerate(ids):
            n = min(bs, tokens - i * bs)
            dst = out[layer, :, i * bs:i * bs + n]
            if bid < 0:
                dst.zero_()
            elif split_kv:
                dst[0].copy_(k[layer, bid, :n])
                dst[1].copy_(v[layer, bid, :n])
            else:
                dst.copy_(torch.stack((k[layer, bid, :n], v[layer, bid, :n])))
    return out


def per_block_gather_stacked(cache: torch.Tensor, table: torch.Tensor, out: torch.Tensor,
                             ) -> torch.Tensor:
    """One copy per (layer, block) moving K and V together, from a stacked
    ``[L, 2, NB, BS, H, D]`` cache whose K/V of a block are one strided region. Full blocks,
    no holes (benchmark helper)."""
    bs = cache.shape[3]
    ids = table.tolist()
    for layer in range(cache.shape[0]):
        for i, bid in enumerate(ids):
            out[layer, :, i * bs:(i + 1) * bs].copy_(cache[layer, :, bid])
    return out


def prefill_mask(chunk: int, cached: int, *, dtype: torch.dtype = torch.bool,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """The chunked-prefill attention mask at its valid shape ``[chunk, cached + chunk]``.

    Query row ``r`` (absolute position ``cached + r``) may attend key column ``c`` iff
    ``c <= cached + r``. ``torch.bool``: True = attend. A floating dtype: additive mask,
    ``0`` = attend, ``-inf`` = masked.
    """
    rows = torch.arange(chunk, device=device).unsqueeze(1)
    cols = torch.arange(cached + chunk, device=device).unsqueeze(0)
    allowed = cols <= rows + cached
    if dtype == torch.bool:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.full((), -math.inf, dtype=dtype, device=device))


def full_prefill_mask(chunk: int, cached: int, max_len: int, *, dtype: torch.dtype = torch.bool,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """What the seed's original path built: the same predicate at ``[chunk, max_len]`` (columns
    past ``cached + chunk`` masked). Kept only to show the valid-shape mask equals its slice,
    and for the memory comparison in the benchmark."""
    if max_len < cached + chunk:
        raise ValueError(f"max_len {max_len} < cached + chunk {cached + chunk}")
    rows = torch.arange(chunk, device=device).unsqueeze(1)
    cols = torch.arange(max_len, device=device).unsqueeze(0)
    allowed = (cols <= rows + cached) & (cols < cached + chunk)
    if dtype == torch.bool:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.full((), -math.inf, dtype=dtype, device=device))


def offset_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int,
                            scale: float | None = None) -> torch.Tensor:
    """Attention of a prefill chunk over its cached prefix plus itself.

    ``q``: ``[heads, chunk, dim]``; ``k``, ``v``: ``[kv_heads, cached + chunk, dim]`` (grouped
    query attention when ``kv_heads < heads``). Computed in fp32 with the valid-shape mask
    ``[chunk, cached + chunk]`` (never ``max_len``); returns ``q.dtype``.
    """
    heads, chunk, dim = q.shape
    kv_heads = k.shape[0]
    if heads % kv_heads or k.shape[1] != cached + chunk or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"cached {cached} do not fit")
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    group = heads // kv_heads
    kf = k.float().repeat_interleave(group, 0)
    vf = v.float().repeat_interleave(group, 0)
    scores = (q.float() @ kf.transpose(1, 2)) * scale
    scores = scores.masked_fill(~prefill_mask(chunk, cached, device=q.device), -math.inf)
    return (torch.softmax(scores, dim=-1) @ vf).to(q.dtype)
