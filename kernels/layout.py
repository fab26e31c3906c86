"""Paged-KV layouts: the canonical 5-D form the kernels take, block-size views, block tables.

Canonical form (what every gather/scatter implementation is handed):
- ``k``, ``v``: ``[layers, num_blocks, block_size, heads, head_dim]``, any strides. A per-layer
  cache (``[num_blocks, block_size, heads, head_dim]``) is the ``layers == 1`` case
  (``unsqueeze(0)``, a view); a stacked all-layer cache ``[layers, 2, num_blocks, block_size,
  heads, head_dim]`` (K and V side by side, as vLLM keeps it) splits into ``cache[:, 0]`` and
  ``cache[:, 1]``, also views. Nothing here copies KV.
- staging buffer: ``[layers, 2, tokens, heads, head_dim]`` (index 0 = K, 1 = V), any strides;
  freshly allocated ones are contiguous, so one layer's slice ``[2, tokens, heads, head_dim]`` is
  one contiguous region that the consumer (the model's layer i) reads while layer i+1 stages.
- block table: 1-D integer tensor of physical block ids in logical order. A negative entry is a
  hole (a logical block that is not resident): gather writes zeros for it, scatter skips it.
  ``tokens`` may end inside the last block (last partial block); only its first
  ``tokens - (n - 1) * block_size`` token slots are read or written.

Block-size views: the physical page size and the kernel's block size need not match (seed 003
keeps a 64-token kernel view over 128-token Ascend pages). :func:`block_view` re-reads the same
storage with another block size (``Tensor.view``, which never copies and raises if the strides
do not allow it), and :func:`refine_block_table` / :func:`coarsen_block_table` translate the
block table to match.
"""

from __future__ import annotations

import torch

HOLE = -1


def block_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """The same KV storage seen with ``block_size`` tokens per block (no copy).

    ``cache`` is ``[..., num_blocks, page, heads, head_dim]``. Finer (``page % block_size == 0``)
    splits every page into ``page // block_size`` blocks, physical page ``p`` becoming blocks
    ``p*r .. p*r+r-1``; coarser (``block_size % page == 0``) joins runs of consecutive pages.
    Raises ``ValueError`` if the sizes do not divide and ``RuntimeError`` (from ``view``) if the
    strides cannot express it without a copy (e.g. tokens not adjacent within a page).
    """
    if cache.dim() < 4:
        raise ValueError(f"expected [..., blocks, block_size, heads, head_dim], got {cache.shape}")
    *lead, nb, page, heads, dim = cache.shape
    if block_size == page:
        return cache
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if page % block_size == 0:
        return cache.view(*lead, nb * (page // block_size), block_size, heads, dim)
    if block_size % page == 0:
        ratio = block_size // page
        if nb % ratio:
            raise ValueError(f"{nb} pages of {page} do not split into blocks of {block_size}")
        return cache.view(*lead, nb // ratio, block_size, heads, dim)
    raise ValueError(f"block size {block_size} and page size {page} do not divide")


def refine_block_table(table: torch.Tensor, ratio: int) -> torch.Tensor:
    """Block table for a view with ``ratio`` times smaller blocks (holes stay holes)."""
    if ratio < 1:
        raise ValueError(f"ratio must be >= 1, got {ratio}")
    table = table.to(torch.int64)
    sub = torch.arange(ratio, device=table.device, dtype=torch.int64)
    out = (table[:, None] * ratio + sub[None, :]).reshape(-1)
    return torch.where(table.repeat_interleave(ratio) < 0, HOLE, out)


def coarsen_block_table(table: torch.Tensor, ratio: int) -> torch.Tensor:
    """Block table for a view with ``ratio`` times larger blocks.

    Each run of ``ratio`` entries must be the sub-blocks of one page in order (``p*r, p*r+1,
    ...``) or all holes; the last run may be short (the sequence ends inside that page).
    """
    if ratio < 1:
        raise ValueError(f"ratio must be >= 1, got {ratio}")
    ids = table.to(torch.int64).tolist()
    out = []
    for start in range(0, len(ids), ratio):
        run = ids[start:start + ratio]
        if all(b < 0 for b in run):
            out.append(HOLE)
            continue
        page, first = divmod(run[0], ratio)
        if first != 0 or run != list(range(run[0], run[0] + len(run))):
            raise ValueError(f"entries {run} are not one page of {ratio} blocks in order")
        out.append(page)
    return torch.tensor(out, dtype=torch.int64, device=table.device)


def split_stacked(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[layers, 2, blocks, block_size, heads, head_dim]`` -> (K, V) canonical views."""
    if cache.dim() != 6 or cache.shape[1] != 2:
        raise ValueError(f"expected [layers, 2, blocks, block_size, heads, dim], got {cache.shape}")
    return cache[:, 0], cache[:, 1]


def as_layers(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(K, V) as canonical 5-D views, and whether they were one layer (4-D) to begin with."""
    if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
        raise ValueError(f"K {k.shape}/{k.dtype} and V {v.shape}/{v.dtype} differ")
    if k.dim() == 4:
        return k.unsqueeze(0), v.unsqueeze(0), True
    if k.dim() == 5:
        return k, v, False
    raise ValueError(f"expected [blocks, block_size, heads, dim] or with layers, got {k.shape}")


def contiguous_run(table: torch.Tensor) -> int | None:
    """The first block id when ``table`` is one run of consecutive blocks (no hole), else None:
    such a table's tokens are one slice of the cache, which a copy reads without a gather."""
    first = int(table[0])
    want = torch.arange(first, first + table.numel(), dtype=table.dtype, device=table.device)
    return first if first >= 0 and torch.equal(table, want) else None


def check_tokens(table: torch.Tensor, block_size: int, tokens: int | None) -> int:
    """The token count to move: default every slot of every listed block."""
    if table.dim() != 1 or table.numel() == 0:
        raise ValueError(f"block table must be 1-D and non-empty, got {tuple(table.shape)}")
    if table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block table must be int32/int64, got {table.dtype}")
    n = table.numel()
    if tokens is None:
        return n * block_size
    if not (n - 1) * block_size < tokens <= n * block_size:
        raise ValueError(f"{tokens} tokens do not end in the last of {n} blocks of {block_size}")
    return tokens


def check_unique(table: torch.Tensor) -> None:
    """Scatter with a repeated block id would be order-dependent: refuse it."""
    valid = table[table >= 0]
    if valid.numel() != torch.unique(valid).numel():
        raise ValueError("block table repeats a block id; scatter would be order-dependent")


def check_range(table: torch.Tensor, num_blocks: int) -> None:
    if table.numel() and int(table.max()) >= num_blocks:
        raise ValueError(f"block id {int(table.max())} out of range for {num_blocks} blocks")
