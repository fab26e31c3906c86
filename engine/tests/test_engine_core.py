"""The engine core over real LMCache tiers: reused KV is bit-identical to a recompute
(greedy tokens and the logits they were chosen from), from DRAM and from disk; corrupt disk
chunks are recomputed; teacher forcing; chunk hashes; salts; FCFS scheduling."""

from __future__ import annotations

import os
import threading
import time

import torch

from agentserving.core.hashing import ChunkHasher
from agentserving.engine.scheduler.policy import FcfsPolicy
from agentserving.engine.scheduler.registry import make_policy
from testkit.worker import prompt, request, run

N = 1100  # 4 full chunks + 76 tokens


def _identical(a: dict, b: dict) -> None:
    assert a["tokens"] == b["tokens"]
    assert len(a["logits"]) == len(b["logits"]) == len(a["tokens"])
    for x, y in zip(a["logits"], b["logits"], strict=True):
        assert torch.equal(x, y)  # bit for bit, not allclose


def test_reuse_from_dram_and_disk_is_bit_identical_to_recompute(engine_factory):
    ids = prompt(N, seed=1)
    reference = run(engine_factory(), request("ref", ids))  # a fresh engine: full recompute
    assert reference["first"]["cached_tokens"] == 0
    parts = engine_factory()
    cold = run(parts, request("cold", ids))
    _identical(reference, cold)
    warm = run(parts, request("warm", ids))
    assert warm["first"]["cached_tokens_by_tier"] == {"cpu": 1024}
    assert warm["first"]["prefill_tokens"] == N - 1024
    _identical(reference, warm)
    assert parts.store.wait_disk_writes()
    hashes = cold["final"].kv_transfer_params["chunk_hashes"]
    parts.store.evict(hashes, parts.store.resolve_locations(["cpu"]))
    from_disk = run(parts, request("disk", ids))
    assert from_disk["first"]["cached_tokens_by_tier"] == {"disk": 1024}
    _identical(reference, from_disk)


def test_next_turn_reuses_the_previous_prompt_and_matches_recompute(engine_factory):
    turn1 = prompt(700, seed=2)
    parts = engine_factory()
    first = run(parts, request("t1", turn1, max_tokens=5))
    turn2 = turn1 + first["tokens"] + prompt(300, seed=3)
    again = run(parts, request("t2", turn2, max_tokens=5))
    assert again["first"]["cached_tokens"] == 512  # the previous prompt's full chunks
    _identical(run(engine_factory(), request("fresh", turn2, max_tokens=5)), again)


def test_corrupt_disk_chunk_is_recomputed_not_served(engine_factory):
    ids = prompt(N, seed=4)
    reference = run(engine_factory(), request("ref", ids))
    parts = engine_factory()
    hashes = run(parts, request("a", ids))["final"].kv_transfer_params["chunk_hashes"]
    assert parts.store.wait_disk_writes()
    parts.store.evict(hashes, parts.store.resolve_locations(["cpu"]))
    path = parts.store.disk_path(hashes[2])
    data = bytearray(open(path, "rb").read())
    data[12345] ^= 0x01  # one flipped bit
    open(path, "wb").write(data)
    os.remove(parts.store.disk_path(hashes[3]))
    got = run(parts, request("b", ids))
    assert got["first"]["cached_tokens_by_tier"] == {"disk": 512}  # chunks 0-1 only
    _identical(reference, got)
    assert parts.store.stats.corrupt_chunks == 1
    # the recomputed chunks were stored again: the next turn reuses everything
    third = run(parts, request("c", ids))
    assert third["first"]["cached_tokens"] == 1024
    _identical(reference, third)


def test_chunk_hashes_are_the_prompts_chain(engine_factory):
    parts = engine_factory()
    ids = prompt(600, seed=5)
    out = run(parts, request("h", ids))
    assert out["final"].kv_transfer_params["chunk_hashes"] == ChunkHasher("blake3", 256) \
        .hashes(ids)
    salted = run(parts, request("s", ids))  # same prompt, unsalted: reuses
    assert salted["first"]["cached_tokens"] == 512
    req = request("t", ids)
    req.cache_salt = "tenant-b"
    other = run(parts, req)
    assert other["first"]["cached_tokens"] == 0  # another tenant never sees those chunks
    assert other["final"].kv_transfer_params["chunk_hashes"] == ChunkHasher(
        "blake3", 256, cache_salt="tenant-b").hashes(ids)


def test_forced_output_tokens_are_emitted_exactly(engine_factory):
    parts = engine_factory()
    ids = prompt(300, seed=6)
    forced = [2, 500, 501, 2, 777]  # EOS inside: teacher forcing does not stop on it
    out = run(parts, request("f", ids, forced_output_token_ids=tuple(forced), max_tokens=1))
    assert out["tokens"] == forced
    assert out["final"].finish_reason == "length"
    assert len(out["logits"]) == len(forced)  # their KV was computed step by step


def test_odd_policy_budgets_are_aligned_to_chunks(engine_factory):
    ids = prompt(N, seed=7)
    reference = run(engine_factory(), request("ref", ids))
    parts = engine_factory()
    parts.core.policy = FcfsPolicy(chunk_tokens=300)  # not a chunk multiple: rounded down
    _identical(reference, run(parts, request("odd", ids)))
    _identical(reference, run(parts, request("odd2", ids)))


def test_fcfs_interleaves_decodes_and_queues_beyond_max_running(engine_factory):
    parts = engine_factory(max_running_requests=2)
    core = parts.core
    for i in range(3):
        core.add(request(f"r{i}", prompt(260, seed=10 + i), max_tokens=4))
    seen_running = 0
    finished = []
    while core.has_work():
        for o in core.step():
            if o.finished:
                finished.append(o.req_id)
        core.run_deferred()
        seen_running = max(seen_running, core.num_running)
    assert seen_running == 2 and finished[-1] == "r2"
    assert sorted(finished) == ["r0", "r1", "r2"]
    assert make_policy("fcfs", 512).name == "fcfs"
    assert isinstance(make_policy("agentserving.engine.scheduler.policy:FcfsPolicy", 256),
                      FcfsPolicy)


def test_decode_steps_interleave_decode_only_steps_between_prefill_chunks(engine_factory):
    """fcfs?decode_steps=3 on the real engine: while one request decodes, a prefilling one gets
    a chunk every third step, and both still come out identical to running alone."""
    alone = run(engine_factory(), request("b", prompt(1100, seed=31), max_tokens=3))
    parts = engine_factory()
    core = parts.core
    core.policy = make_policy("fcfs?decode_steps=3", 256)
    core.add(request("a", prompt(300, seed=30), max_tokens=12))
    while not any(r.output_token_ids for r in core.running):  # "a" is decoding
        core.step()
        core.run_deferred()
    core.add(request("b", prompt(1100, seed=31), max_tokens=3))
    kinds, b_tokens = [], []
    while core.has_work():
        b = next((r for r in [*core.running, *core.waiting] if r.req_id == "b"), None)
        before = b.num_computed if b is not None else 0
        decoding = any(r.req_id == "a" for r in core.running)
        outs = core.step()
        core.run_deferred()
        b_tokens += [t.token_id for o in outs if o.req_id == "b" for t in o.tokens]
        if decoding and b is not None:
            kinds.append("P" if b.num_computed > before else "D")
    assert "PDDP" in "".join(kinds), kinds  # a chunk, two decode-only steps, a chunk
    assert "PP" not in "".join(kinds) and "PD" in "".join(kinds)
    assert b_tokens == alone["tokens"]
    with __import__("pytest").raises(ValueError):
        make_policy("fcfs?decode_steps=0", 256)


def test_seeded_sampling_is_reproducible_with_reuse(engine_factory):
    parts = engine_factory()
    ids = prompt(600, seed=8)
    a = run(parts, request("a", ids, temperature=0.9, top_p=0.95, seed=42, max_tokens=8))
    b = run(parts, request("b", ids, temperature=0.9, top_p=0.95, seed=42, max_tokens=8))
    assert b["first"]["cached_tokens"] == 512 and a["tokens"] == b["tokens"]


class _Pull:
    """A hand-off in flight, as the step loop sees it: its layers arrive when ``arrive()``."""

    def __init__(self, header: bool, done: bool, num_layers: int = 4, tokens: int = 300
                 ) -> None:
        self.header, self.finished = header, done
        self._arrived = threading.Event()
        if done:
            self._arrived.set()
        self.kv = torch.randn(num_layers, 2, 1, 4, tokens, 64)

    def arrive(self) -> None:
        self.finished = True
        self._arrived.set()

    def header_ready(self) -> bool:
        return self.header

    def done(self) -> bool:
        return self.finished

    def wait_header(self) -> dict:
        return {}

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._arrived.wait(60)
        return self.kv[i, 0], self.kv[i, 1]


def _promote_until(core, req, deadline_s: float = 60.0) -> None:
    """Step the promotion until ``req`` runs (its layer copy finishes on a thread)."""
    deadline = time.monotonic() + deadline_s
    while req not in core.running and time.monotonic() < deadline:
        core._promote_pulls()
        time.sleep(0.01)


def test_a_pull_joins_busy_decoding_only_once_it_has_fully_arrived(engine_factory):
    core = engine_factory().core
    pulled = request("pulled", prompt(300, seed=9))
    pulled.remote = _Pull(header=False, done=False)
    core.pulling.append(pulled)
    assert core.has_work() and not core.has_ready_work()  # nothing to do but wait
    pulled.remote.header = True
    assert core.has_ready_work()
    busy = request("busy", prompt(10, seed=8))
    core.running.append(busy)  # another request is decoding
    core._promote_pulls()
    assert core.pulling == [pulled] and core.running == [busy]  # layers still on the wire
    pulled.remote.arrive()
    _promote_until(core, pulled)  # copied into its KV blocks off the step loop, then joins
    assert core.pulling == [] and core.running == [busy, pulled]
    k, v = core.runner.cache_layers(pulled.cache)[3]
    assert torch.equal(k, pulled.remote.kv[3, 0]) and torch.equal(v, pulled.remote.kv[3, 1])
    # an idle engine waits for the whole pull too (a step blocked on the network would hold
    # back every pull behind it), and does not spin meanwhile: nothing is ready to step
    core.running.clear()
    early = request("early", prompt(300, seed=10))
    early.remote = _Pull(header=True, done=False)
    core.pulling.append(early)
    core._promote_pulls()
    assert core.running == [] and core.pulling == [early] and early.kv_load is not None
    assert not core.has_ready_work()
    early.remote.arrive()
    _promote_until(core, early)
    assert core.running == [early] and core.pulling == []
    k, v = core.runner.cache_layers(early.cache)[1]
    assert torch.equal(k, early.remote.kv[1, 0]) and torch.equal(v, early.remote.kv[1, 1])


def test_a_finished_layer_load_is_freed_without_waiting_for_a_full_gc(engine_factory):
    """A layer-wise load holds what it copies from (LMCache objects, a pull's received
    frames). A reference cycle through it kept every finished load until a full collection,
    which on a busy decode pod came every ~10 minutes: its RSS climbed by the frames held."""
    import gc
    import weakref

    ids = prompt(N, seed=41)
    parts = engine_factory()
    run(parts, request("cold", ids))
    warm = run(parts, request("warm", ids))
    assert warm["first"]["cached_tokens"] == 1024  # the prefix came through a layer load
    assert parts.core._loads  # the last load stays listed until the next one starts
    gc.collect()
    gc.disable()
    try:
        load = weakref.ref(parts.core._loads[-1])
        assert load() is not None and load().done()
        parts.core._loads = []  # what the next load's start does with a finished one
        del warm
        assert load() is None, gc.get_referrers(load())
    finally:
        gc.enable()
