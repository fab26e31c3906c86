"""LayerStager: double buffering, order, and contents equal to a one-layer gather."""

from __future__ import annotations

import pytest
import torch

from agentserving.kernels import HOLE, LayerStager, gather_blocks, split_stacked


def make(device: str = "cpu", layers: int = 4):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(layers, 2, 6, 4, 2, 4, generator=g).to(device)
    return (*split_stacked(cache), torch.tensor([4, HOLE, 1]), 10)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_layers_stage_ahead_into_two_alternating_buffers(impl: str) -> None:
    k, v, table, tokens = make()
    seen, ptrs = [], []
    with LayerStager(k, v, table, tokens=tokens, impl=impl) as stager:
        for layer, kv in stager:
            assert kv.shape == (2, tokens, 2, 4) and layer == len(seen)
            seen.append(kv.clone())
            ptrs.append(kv.data_ptr())
    want = gather_blocks(k, v, table, tokens=tokens)
    assert len(seen) == k.shape[0]
    for layer, kv in enumerate(seen):
        assert torch.equal(kv, want[layer])
    assert len(set(ptrs)) == 2 and ptrs[0] == ptrs[2] and ptrs[1] == ptrs[3]
    log = stager.log
    for layer in range(k.shape[0] - 1):  # layer+1 was staging before layer was handed out
        assert log.index(("stage", layer + 1)) < log.index(("get", layer))
    assert log.count(("stage", 0)) == 1 and ("stage", k.shape[0]) not in log


def test_layers_must_be_taken_in_order() -> None:
    k, v, table, tokens = make()
    with LayerStager(k, v, table, tokens=tokens) as stager:
        stager.get(0)
        with pytest.raises(ValueError, match="in order"):
            stager.get(2)
        assert torch.equal(stager.get(1), gather_blocks(k[1], v[1], table, tokens=tokens))


def test_stager_needs_all_layers() -> None:
    k, v, table, tokens = make()
    with pytest.raises(ValueError):
        LayerStager(k[0], v[0], table, tokens=tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: device staging not exercised")
def test_host_cache_to_device_buffers() -> None:
    k, v, table, tokens = make()
    want = gather_blocks(k, v, table, tokens=tokens)
    with LayerStager(k, v, table, tokens=tokens, target="cuda") as stager:
        got = [kv.cpu() for _, kv in stager]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_contiguous_run_is_found_and_a_hole_breaks_it() -> None:
    from agentserving.kernels.layout import contiguous_run

    assert contiguous_run(torch.tensor([3, 4, 5])) == 3
    assert contiguous_run(torch.tensor([3, 5])) is None
    assert contiguous_run(torch.tensor([HOLE, 0])) is None
    assert contiguous_run(torch.tensor([2], dtype=torch.int32)) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: device staging not exercised")
@pytest.mark.parametrize("table", [[4, HOLE, 1], [1, 2, 3]], ids=["gathered", "contiguous"])
def test_host_slots_are_not_rewritten_under_a_queued_copy(table: list[int]) -> None:
    """The CPU stages far ahead of a busy device: every layer must still arrive intact."""
    layers = 12
    g = torch.Generator().manual_seed(9)
    cache = torch.randn(layers, 2, 6, 64, 8, 64, generator=g).pin_memory()
    k, v = split_stacked(cache)
    table_t, tokens = torch.tensor(table), 64 * len(table) - 5
    want = gather_blocks(k, v, table_t, tokens=tokens)
    got = []
    with LayerStager(k, v, table_t, tokens=tokens, target="cuda") as stager:
        for _, kv in stager:
            torch.cuda._sleep(2_000_000)  # the consumer's layer keeps the device busy
            got.append(kv.clone())        # enqueued, not waited for: the CPU runs ahead
    torch.cuda.synchronize()
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
