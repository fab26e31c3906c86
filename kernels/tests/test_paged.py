"""Paged gather/scatter: Triton equals the PyTorch reference bit for bit; the reference equals
plain per-block indexing; block-size views never copy."""

from __future__ import annotations

import random

import pytest
import torch

from agentserving.kernels import (
    HOLE,
    block_view,
    coarsen_block_table,
    gather_blocks,
    refine_block_table,
    scatter_blocks,
    split_stacked,
)
from agentserving.kernels import reference as ref

from .conftest import DTYPES


def rand_cache(shape: tuple[int, ...], dtype: torch.dtype, seed: int,
               device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def rand_case(seed: int) -> dict:
    """Random layers/blocks/block size/heads/dim, a table with at least one hole (when longer
    than one), ids in random order, and a token count ending inside the last block."""
    rng = random.Random(seed)
    layers, nb = rng.randint(1, 2), rng.randint(4, 7)
    bs, heads, dim = rng.choice([4, 6, 8]), rng.randint(1, 3), rng.choice([4, 6])
    n = rng.randint(2, 4)
    ids = rng.sample(range(nb), n)
    ids[rng.randrange(n - 1)] = HOLE  # a hole, never the last (that one is checked alone)
    tokens = (n - 1) * bs + rng.randint(1, bs)
    return {"shape": (layers, 2, nb, bs, heads, dim), "table": torch.tensor(ids),
            "tokens": tokens}


def naive_gather(k: torch.Tensor, v: torch.Tensor, ids: list[int], tokens: int) -> torch.Tensor:
    """The definition, by plain indexing, one block at a time."""
    bs = k.shape[-3]
    parts = []
    for kv in (k, v):
        rows = [torch.zeros_like(kv[:, 0]) if b < 0 else kv[:, b] for b in ids]
        parts.append(torch.cat(rows, dim=1)[:, :tokens])
    assert parts[0].shape[1] == tokens and tokens > (len(ids) - 1) * bs
    return torch.stack(parts, dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_gather_triton_equals_reference(device: str, dtype: torch.dtype, seed: int) -> None:
    case = rand_case(seed)
    k, v = split_stacked(rand_cache(case["shape"], dtype, seed, device))
    want = gather_blocks(k, v, case["table"], tokens=case["tokens"], impl="reference")
    got = gather_blocks(k, v, case["table"], tokens=case["tokens"], impl="triton")
    assert got.shape == (k.shape[0], 2, case["tokens"], *k.shape[3:])
    assert got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(want.cpu(), naive_gather(k.cpu(), v.cpu(), case["table"].tolist(),
                                                case["tokens"]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [2, 3])
def test_scatter_triton_equals_reference(device: str, dtype: torch.dtype, seed: int) -> None:
    case = rand_case(seed)
    base = rand_cache(case["shape"], dtype, seed, device)
    staging = rand_cache((case["shape"][0], 2, case["tokens"], *case["shape"][4:]), dtype,
                         seed + 100, device)
    want, got = base.clone(), base.clone()
    scatter_blocks(staging, *split_stacked(want), case["table"], tokens=case["tokens"],
                   impl="reference")
    scatter_blocks(staging, *split_stacked(got), case["table"], tokens=case["tokens"],
                   impl="triton")
    assert not torch.equal(want, base)  # it wrote something
    assert torch.equal(got, want)
    # round trip: what was scattered gathers back, holes as zeros
    back = gather_blocks(*split_stacked(got), case["table"], tokens=case["tokens"])
    holes = (case["table"] < 0).repeat_interleave(case["shape"][3])[:case["tokens"]].to(device)
    assert torch.equal(back[:, :, ~holes], staging[:, :, ~holes])
    assert not back[:, :, holes].any()
    # blocks outside the table are untouched
    listed = set(case["table"].tolist())
    for b in range(case["shape"][2]):
        if b not in listed:
            assert torch.equal(got[:, :, b], base[:, :, b])


def test_partial_last_block_touches_only_its_tokens(device: str) -> None:
    cache = rand_cache((1, 2, 3, 8, 2, 4), torch.float16, 7, device)
    table = torch.tensor([2, 0])
    for impl in ("reference", "triton"):
        staged = gather_blocks(*split_stacked(cache), table, tokens=11, impl=impl)
        assert staged.shape[2] == 11
        assert torch.equal(staged[0, 0, 8:], cache[0, 0, 0, :3])
        assert torch.equal(staged[0, 1, :8], cache[0, 1, 2])
        out = cache.clone()
        scatter_blocks(torch.zeros_like(staged), *split_stacked(out), table, tokens=11, impl=impl)
        assert not out[0, :, 0, :3].any() and not out[0, :, 2].any()
        assert torch.equal(out[0, :, 0, 3:], cache[0, :, 0, 3:])  # past the end: kept
        assert torch.equal(out[0, :, 1], cache[0, :, 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_block_one_layer_separate_tensors(device: str, dtype: torch.dtype) -> None:
    k = rand_cache((5, 4, 2, 6), dtype, 11, device)  # per-layer [blocks, bs, heads, dim]
    v = rand_cache((5, 4, 2, 6), dtype, 12, device)
    table = torch.tensor([3], dtype=torch.int32)
    want = gather_blocks(k, v, table, impl="reference")
    got = gather_blocks(k, v, table, impl="triton")
    assert got.shape == (2, 4, 2, 6)
    assert torch.equal(got, want) and torch.equal(got[0], k[3]) and torch.equal(got[1], v[3])
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    scatter_blocks(got, k2, v2, table, impl="triton")
    assert torch.equal(k2[3], k[3]) and torch.equal(v2[3], v[3]) and not k2[:3].any()


def test_all_holes_gathers_zeros(device: str) -> None:
    cache = rand_cache((2, 2, 3, 4, 1, 4), torch.float32, 13, device)
    table = torch.tensor([HOLE, HOLE])
    for impl in ("reference", "triton"):
        staged = gather_blocks(*split_stacked(cache), table, impl=impl)
        assert staged.shape == (2, 2, 8, 1, 4) and not staged.any()
        out = cache.clone()
        scatter_blocks(torch.ones_like(staged), *split_stacked(out), table, impl=impl)
        assert torch.equal(out, cache)


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_size_views_without_copy(device: str, dtype: torch.dtype) -> None:
    """A 4-token kernel view over 8-token physical pages (the seed: 64 over 128)."""
    pages = rand_cache((2, 2, 5, 8, 2, 4), dtype, 21, device)
    fine = block_view(pages, 4)
    assert fine.shape == (2, 2, 10, 4, 2, 4)
    assert fine.data_ptr() == pages.data_ptr() and fine._base is pages  # a view, not a copy
    assert torch.equal(block_view(fine, 8), pages)
    assert block_view(fine, 8).data_ptr() == pages.data_ptr()
    table = torch.tensor([3, HOLE, 0, 4])
    fine_table = refine_block_table(table, 2)
    assert fine_table.tolist() == [6, 7, -1, -1, 0, 1, 8, 9]
    assert coarsen_block_table(fine_table, 2).tolist() == table.tolist()
    tokens = 3 * 8 + 3  # ends inside the first half of the last page
    want = gather_blocks(*split_stacked(pages), table, tokens=tokens, impl="reference")
    for impl in ("reference", "triton"):
        got = gather_blocks(*split_stacked(fine), fine_table[:7], tokens=tokens, impl=impl)
        assert torch.equal(got, want)
    # scatter through the fine view lands in the physical pages
    out = pages.clone()
    scatter_blocks(want.neg(), *split_stacked(block_view(out, 4)), fine_table[:7], tokens=tokens,
                   impl="triton")
    assert torch.equal(out[:, :, 3], pages[:, :, 3].neg())
    assert torch.equal(out[:, :, 4, :3], pages[:, :, 4, :3].neg())
    assert torch.equal(out[:, :, 4, 3:], pages[:, :, 4, 3:])


def test_block_view_refuses_to_copy() -> None:
    # tokens not adjacent inside a page: a finer view would need a copy, so it must raise
    cache = torch.zeros(8, 3, 2, 4).transpose(0, 1)  # [blocks=3, page=8, heads, dim]
    with pytest.raises(RuntimeError):
        block_view(cache, 4)
    with pytest.raises(ValueError):
        block_view(torch.zeros(3, 8, 2, 4), 3)
    with pytest.raises(ValueError):
        coarsen_block_table(torch.tensor([1, 2]), 2)  # 1 is not the start of a page


def test_strided_staging_in_lmcache_layout(device: str) -> None:
    """Staging straight into an LMCache KV_2LTD object ``[2, layers, tokens, heads*dim]``."""
    cache = rand_cache((3, 2, 4, 4, 2, 4), torch.bfloat16, 31, device)
    table = torch.tensor([1, 3, 0])
    want = gather_blocks(*split_stacked(cache), table, impl="reference")
    for impl in ("reference", "triton"):
        obj = torch.zeros(2, 3, 12, 8, dtype=torch.bfloat16, device=device)
        gather_blocks(*split_stacked(cache), table, out=obj.view(2, 3, 12, 2, 4).transpose(0, 1),
                      impl=impl)
        assert torch.equal(obj, want.transpose(0, 1).reshape(2, 3, 12, 8))


def test_per_block_copies_equal_one_staged_copy() -> None:
    cache = rand_cache((2, 2, 6, 4, 2, 4), torch.float16, 41, "cpu")
    table = torch.tensor([5, HOLE, 2])
    k, v = split_stacked(cache)
    want = gather_blocks(k, v, table, tokens=10)
    for split in (False, True):
        got = ref.per_block_gather(k, v, table, 10, torch.full_like(want, 7), split_kv=split)
        assert torch.equal(got, want)
    full = torch.tensor([5, 1, 2])
    assert torch.equal(ref.per_block_gather_stacked(cache, full, torch.empty(2, 2, 12, 2, 4,
                                                                             dtype=cache.dtype)),
                       gather_blocks(k, v, full))


def test_validation() -> None:
    k, v = split_stacked(torch.zeros(1, 2, 4, 4, 1, 2))
    staging = torch.zeros(1, 2, 8, 1, 2)
    with pytest.raises(ValueError, match="repeats"):
        scatter_blocks(staging, k, v, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="out of range"):
        gather_blocks(k, v, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="tokens"):
        gather_blocks(k, v, torch.tensor([0, 1]), tokens=4)  # would leave block 1 empty
    with pytest.raises(ValueError, match="int32/int64"):
        gather_blocks(k, v, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="does not fit"):
        gather_blocks(k, v, torch.tensor([0]), out=torch.zeros(1, 2, 3, 1, 2))


def test_scatter_unique_flag_skips_only_the_repeat_check():
    """``unique=True`` (allocator-built tables) writes the same bytes; the default still
    refuses a repeated id."""
    from agentserving.kernels import scatter_blocks

    k = torch.zeros(3, 6, 4, 2, 8)
    v = torch.zeros_like(k)
    staging = torch.randn(3, 2, 12, 2, 8)
    table = torch.tensor([4, 1, 5])
    k2, v2 = k.clone(), v.clone()
    scatter_blocks(staging, k, v, table)
    scatter_blocks(staging, k2, v2, table, unique=True)
    assert torch.equal(k, k2) and torch.equal(v, v2) and k.abs().sum() > 0
    with pytest.raises(ValueError):
        scatter_blocks(staging, k, v, torch.tensor([4, 4, 5]))


def test_scatter_of_a_consecutive_table_matches_per_block_writes():
    """The reference's slice-copy fast path (consecutive ids, no hole) writes what per-block
    indexing writes, and leaves every other block alone."""
    from agentserving.kernels import scatter_blocks

    k = torch.randn(2, 9, 4, 3, 8)
    v = torch.randn_like(k)
    staging = torch.randn(2, 2, 14, 3, 8)  # 3 full blocks + 2 tokens of a fourth
    table = torch.tensor([3, 4, 5, 6])
    want_k, want_v = k.clone(), v.clone()
    for i, b in enumerate(table.tolist()):
        n = min(4, 14 - 4 * i)
        want_k[:, b, :n] = staging[:, 0, 4 * i:4 * i + n]
        want_v[:, b, :n] = staging[:, 1, 4 * i:4 * i + n]
    scatter_blocks(staging, k, v, table, tokens=14, unique=True)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
