"""Every prefill policy drives the reference engine (real tiny Llama, real LMCache tiers) to
the same greedy tokens and logits as the engine's own ``fcfs``, bit for bit; the shadow's
prefetch moves disk-resident chunks to DRAM before admission."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

from agentserving.core.schemas import Tier  # noqa: E402
from agentserving.engine.builder import build_engine  # noqa: E402
from agentserving.engine.model.loader import load_model  # noqa: E402
from agentserving.engine.settings import WorkerSettings  # noqa: E402
from testkit.worker import prompt, request  # noqa: E402

torch.set_num_threads(1)

POLICIES = ["fcfs", "fcfs-nochunk", "fcfs-chunk", "longcap-dynamic?chunk_align=128",
            "longcap-dynamic?step_tokens=1024&min_chunk=256&long_cap=0.25",
            "shadow?lookahead=3&kv_capacity_tokens=4096"]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def _build(tmp: Path, tiny, policy: str):
    s = WorkerSettings(cpu_cache_gib=0.25, disk_cache_dir=tmp / "disk", disk_cache_gib=0.5,
                       pod_name=tmp.name, scheduler_policy=policy, prefill_chunk_tokens=256,
                       max_running_requests=4)
    parts = build_engine(s, bundle=tiny)
    parts.core.capture_logits = True
    return parts


def _drive(parts, reqs) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    core = parts.core
    for r in reqs:
        core.add(r)
    tokens: dict[str, list[int]] = {r.req_id: [] for r in reqs}
    steps = 0
    while core.has_work():
        for out in core.step():
            tokens[out.req_id] += [t.token_id for t in out.tokens]
        core.run_deferred()
        steps += 1
        assert steps < 500
    return {rid: (t, core.captured_logits.pop(rid)) for rid, t in tokens.items()}


WORKLOAD = [(1100, 1, 4), (300, 2, 3), (700, 3, 4), (90, 4, 2)]


def test_every_policy_gives_fcfs_tokens_bit_for_bit(tmp_path, tiny):
    results = {}
    for i, name in enumerate(POLICIES):
        parts = _build(tmp_path / f"p{i}", tiny, name)
        try:
            assert parts.core.policy.name.startswith(name.split("?")[0][:4])
            reqs = [request(f"r{j}", prompt(n, seed=s), max_tokens=m)
                    for j, (n, s, m) in enumerate(WORKLOAD)]
            results[name] = _drive(parts, reqs)
        finally:
            parts.close()
    ref = results["fcfs"]
    for name, got in results.items():
        for rid, (toks, logits) in ref.items():
            assert got[rid][0] == toks, (name, rid)
            assert all(torch.equal(a, b) for a, b in zip(got[rid][1], logits, strict=True))


def test_shadow_prefetches_disk_chunks_and_output_matches_recompute(tmp_path, tiny):
    ids = prompt(1100, seed=9)
    ref_parts = _build(tmp_path / "ref", tiny, "fcfs")
    try:
        ref = _drive(ref_parts, [request("ref", ids, max_tokens=3)])["ref"]
    finally:
        ref_parts.close()
    parts = _build(tmp_path / "sh", tiny, "shadow?base=fcfs-chunk&lookahead=3")
    try:
        first = _drive(parts, [request("a", ids, max_tokens=3)])
        assert first["a"][0] == ref[0]
        store = parts.store
        assert store.wait_disk_writes()
        req_a = request("blocker", prompt(1500, seed=10), max_tokens=1)
        again = request("again", ids, max_tokens=3)
        # evict the first turn's chunks from DRAM: only the disk copy is left
        core = parts.core
        core._hashes(again)
        store.evict(again.chunk_hashes, store.resolve_locations(["cpu"]))
        assert set(store.lookup(again.chunk_ints)) == {Tier.DISK}
        # a short turn between them: the engine itself starts loading the *head* of the
        # queue while it waits (``_prepare_head``), so "again" must not be the head: it is
        # admitted in the same step as "small", which only the shadow sees coming
        small = request("small", prompt(100, seed=11), max_tokens=1)
        out = _drive(parts, [req_a, small, again])
        log = parts.core.policy.prefetch_log
        assert ("again", 4) in log  # all four full chunks were on disk, asked for once
        assert out["again"][0] == ref[0]
        assert all(torch.equal(x, y) for x, y in zip(out["again"][1], ref[1], strict=True))
    finally:
        parts.close()
