"""Triton versions of the kernels in :mod:`.reference`.

Each kernel body is a plain function wrapped twice: ``triton.jit`` (compiled, for CUDA/ROCm
tensors) and ``triton.runtime.interpreter.InterpretedFunction`` (Triton's interpreter, for CPU
tensors — the same thing ``TRITON_INTERPRET=1`` selects globally, but chosen per call by the
tensors' device, so the interpreted and the compiled variants can run in one process). The
interpreter is a correctness path, not a performance path: it costs about 1 ms per program.

Index arithmetic is done in int64 (block ids times strides overflow int32 on large caches);
every ``tl.arange`` is a power of two, masked to the real extent.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

MAX_TILE = 4096  # elements per program tile (tokens x heads*head_dim)
# ``tl.max``/``tl.sum``/``tl.zeros`` are themselves @jit helpers, which an explicitly built
# InterpretedFunction cannot call (only TRITON_INTERPRET=1 at import rewrites them); so reduce
# with the combine functions ``tl.max``/``tl.sum`` use, which both the compiler and the
# interpreter (numpy fast path) accept.
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


def _paged_copy(k_ptr, v_ptr, s_ptr, table_ptr, tokens, block_size, head_dim, row_elems,
                ksl, ksb, kst, ksh, ksd, vsl, vsb, vst, vsh, vsd, ssl, sskv, sst, ssh, ssd,
                TO_STAGE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program (i, layer) moves block ``table[i]`` of ``layer``, K and V, to/from staging."""
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    bid = tl.load(table_ptr + i).to(tl.int64)
    valid = bid >= 0
    bsafe = tl.maximum(bid, 0)
    first_tok = i.to(tl.int64) * block_size
    limit = tl.minimum(tokens - first_tok, block_size)  # last block may be partial
    k_base = layer * ksl + bsafe * ksb
    v_base = layer * vsl + bsafe * vsb
    s_base = layer * ssl
    for e0 in range(0, row_elems, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        emask = e < row_elems
        h = (e // head_dim).to(tl.int64)
        d = (e % head_dim).to(tl.int64)
        k_col = h * ksh + d * ksd
        v_col = h * vsh + d * vsd
        s_col = h * ssh + d * ssd
        for t0 in range(0, block_size, BLOCK_T):
            t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
            m = (t < limit)[:, None] & emask[None, :]
            k_off = k_base + t[:, None] * kst + k_col[None, :]
            v_off = v_base + t[:, None] * vst + v_col[None, :]
            s_off = s_base + (first_tok + t)[:, None] * sst + s_col[None, :]
            if TO_STAGE:
                kx = tl.load(k_ptr + k_off, mask=m & valid, other=0)
                vx = tl.load(v_ptr + v_off, mask=m & valid, other=0)
                tl.store(s_ptr + s_off, kx, mask=m)
                tl.store(s_ptr + s_off + sskv, vx, mask=m)
            else:
                kx = tl.load(s_ptr + s_off, mask=m)
                vx = tl.load(s_ptr + s_off + sskv, mask=m)
                tl.store(k_ptr + k_off, kx, mask=m & valid)
                tl.store(v_ptr + v_off, vx, mask=m & valid)


def _prefill_mask(out_ptr, chunk, cached, stride_r, stride_c,
                  ADDITIVE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program r writes rows [r*BLOCK_R, ...) of the [chunk, cached+chunk] mask."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    width = cached + chunk
    for c0 in range(0, width, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = (rows < chunk)[:, None] & (cols < width)[None, :]
        allowed = cols[None, :] <= rows[:, None] + cached
        off = rows.to(tl.int64)[:, None] * stride_r + cols.to(tl.int64)[None, :] * stride_c
        if ADDITIVE:
            val = tl.where(allowed, 0.0, float("-inf")).to(out_ptr.dtype.element_ty)
        else:
            val = allowed.to(tl.uint8)
        tl.store(out_ptr + off, val, mask=m)


def _offset_causal_attn(q_ptr, k_ptr, v_ptr, o_ptr, chunk, cached, head_dim, group, scale,
                        sqh, sqm, sqd, skh, skn, skd, svh, svn, svd, soh, som, sod,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        PRECISION: tl.constexpr):
    """Flash-style attention; the offset-causal predicate ``col <= row + cached`` is computed
    per tile in registers, so no mask exists in memory at any shape. ``PRECISION``: the dots'
    (``ieee`` for float32 inputs: on a GPU ``tl.dot`` otherwise rounds them to TF32, 1e-3 off
    the reference, as an H100 showed; ``tf32`` for half inputs, already coarser than it)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    kvh = (h // group).to(tl.int64)
    h = h.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    rmask = rows < chunk
    dmask = dims < head_dim
    q = tl.load(q_ptr + h * sqh + rows.to(tl.int64)[:, None] * sqm + dims[None, :] * sqd,
                mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    # keys past the last row's position are masked for every row of this tile: stop there
    end = tl.minimum(cached + chunk, cached + (pid_m + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < cached + chunk
        kt = tl.load(k_ptr + kvh * skh + cols.to(tl.int64)[None, :] * skn + dims[:, None] * skd,
                     mask=cmask[None, :] & dmask[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale
        allowed = (cols[None, :] <= rows[:, None] + cached) & cmask[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        vt = tl.load(v_ptr + kvh * svh + cols.to(tl.int64)[:, None] * svn + dims[None, :] * svd,
                     mask=cmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + h * soh + rows.to(tl.int64)[:, None] * som + dims[None, :] * sod,
             out.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


_KERNELS = {fn.__name__: (triton.jit(fn), InterpretedFunction(fn))
            for fn in (_paged_copy, _prefill_mask, _offset_causal_attn)}


def _kernel(name: str, device: torch.device):  # type: ignore[no-untyped-def]
    compiled, interpreted = _KERNELS[name]
    return interpreted if device.type == "cpu" else compiled


def _copy(k: torch.Tensor, v: torch.Tensor, staging: torch.Tensor, table: torch.Tensor,
          tokens: int, to_stage: bool) -> None:
    layers, _, bs, heads, dim = k.shape
    row = heads * dim
    block_e = min(triton.next_power_of_2(row), MAX_TILE)
    block_t = max(1, min(triton.next_power_of_2(bs), MAX_TILE // block_e))
    table = table.to(device=k.device, dtype=torch.int64).contiguous()
    grid = (table.numel(), layers)
    _kernel("_paged_copy", k.device)[grid](
        k, v, staging, table, tokens, bs, dim, row,
        *k.stride(), *v.stride(),
        staging.stride(0), staging.stride(1), *staging.stride()[2:],
        TO_STAGE=to_stage, BLOCK_T=block_t, BLOCK_E=block_e)


def gather_blocks(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, tokens: int,
                  out: torch.Tensor) -> torch.Tensor:
    """One launch: every listed block of every layer, K and V, into ``out``."""
    _copy(k, v, out, table, tokens, True)
    return out


def scatter_blocks(staging: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                   tokens: int) -> None:
    """One launch: ``staging`` back into the listed blocks (holes skipped)."""
    _copy(k, v, staging, table, tokens, False)


def prefill_mask(chunk: int, cached: int, *, dtype: torch.dtype = torch.bool,
                 device: torch.device | str | None = None) -> torch.Tensor:
    device = torch.device(device or "cpu")
    width = cached + chunk
    if dtype == torch.bool:
        out = torch.empty((chunk, width), dtype=torch.uint8, device=device)
    else:
        out = torch.empty((chunk, width), dtype=dtype, device=device)
    block_c = min(triton.next_power_of_2(max(width, 1)), 1024)
    block_r = max(1, min(triton.next_power_of_2(chunk), MAX_TILE // block_c))
    grid = (triton.cdiv(chunk, block_r),)
    _kernel("_prefill_mask", device)[grid](
        out, chunk, cached, out.stride(0), out.stride(1),
        ADDITIVE=dtype != torch.bool, BLOCK_R=block_r, BLOCK_C=block_c)
    return out.view(torch.bool) if dtype == torch.bool else out


def offset_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int,
                            scale: float | None = None) -> torch.Tensor:
    heads, chunk, dim = q.shape
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    out = torch.empty_like(q)
    block = 16  # tl.dot needs >= 16 on every side
    block_d = max(16, triton.next_power_of_2(dim))
    grid = (triton.cdiv(chunk, block), heads)
    _kernel("_offset_causal_attn", q.device)[grid](
        q, k, v, out, chunk, cached, dim, heads // k.shape[0], scale,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out
