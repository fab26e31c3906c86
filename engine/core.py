"""The engine core: one step loop over the model, the KV tiers and the hand-off.

``EngineCore`` owns the queue of requests; each ``step()`` asks the scheduling policy for a
``StepPlan`` and executes it:

- the first time a request is scheduled, blocks for its whole timeline (prompt + output
  budget) are reserved in the paged KV pool (``kv.paged``; it waits in the queue while they
  are not free), its prompt's chunk hashes are computed and the longest cached prefix is
  fetched from whichever LMCache tier holds it (``KVStore.fetch_prefix``: verified, not yet
  copied); the copy into the paged blocks runs layer by layer on a background thread while
  the forward pass starts (``kv.layerwise``: layer i waits only for its own KV); only the
  rest of the prompt is computed, in steps split at chunk boundaries;
- when the prompt is done, the first token is sampled (or taken from
  ``forced_output_token_ids``), and every full chunk not reused is stored (deferred to
  ``run_deferred()``, after the first token has been sent);
- ``do_remote_decode`` requests stop there and pin their KV in the hand-off registry;
  ``do_remote_prefill`` requests pull it instead (``services/decode/handoff``): reading the
  local prefix, the pull and the copy into paged blocks all run off the step loop, so the
  requests already decoding keep stepping; a pull joins them once its layers are all in
  its blocks (the copy runs on GIL-releasing torch ops); a failed pull is recomputed locally;
- decoding requests advance one token per step.

It runs in-process too (tests drive ``step()`` directly); ``engine_process`` wraps it with
ZMQ and the HTTP memory API.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from agentserving.core.logging import get_logger
from agentserving.core.schemas import Tier
from agentserving.decode.handoff.pull import RemoteKV
from agentserving.decode.handoff.wire import TransferError, dtype_name, tokens_digest
from agentserving.engine.kv.keys import ChunkKeys
from agentserving.engine.kv.layerwise import LayerLoad, LoadFailed, chunk_copier, tensor_copier
from agentserving.engine.kv.paged import KVBlockPool, PagedKV, all_materialized
from agentserving.engine.kv.store import KVStore
from agentserving.engine.model.runner import ModelRunner, logprobs_of, sample
from agentserving.engine.scheduler.policy import SchedulerContext, SchedulerPolicy
from agentserving.engine.scheduler.request import EngineRequest, RequestState
from agentserving.prefill.policies.executor import pass_end

log = get_logger(__name__)

REMOTE_TIER = "remote"


@dataclasses.dataclass
class TokenOut:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclasses.dataclass
class EngineOutput:
    req_id: str
    tokens: list[TokenOut] = dataclasses.field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None


@dataclasses.dataclass
class EngineCoreStats:
    prefill_tokens_computed: int = 0
    transfer_bytes_received: int = 0
    transfer_failures: int = 0
    transfer_tokens_local: int = 0  # P/D: prompt tokens found here instead of pulled
    requests_finished: int = 0
    kv_load_exposed_seconds: float = 0.0  # KV load time the step loop waited for
    kv_load_seconds: float = 0.0  # all KV load time (exposed or hidden behind compute)
    kv_pool_full_waits: int = 0  # admissions deferred: not enough free KV blocks


@dataclasses.dataclass
class StepRecord:
    """One step's time split and shape (benchmarks read ``EngineCore.step_records``; the
    worker's ``--step-log-dir`` writes them, to check a simulator profile's step prices)."""

    forward_s: float  # model compute, waits excluded
    exposed_kv_s: float  # KV load time on the step's critical path
    prefill_tokens: int
    decode_tokens: int
    cpu_s: float = 0.0  # the step loop thread's CPU seconds (wall minus waiting for a core)
    chunks: tuple[tuple[int, int], ...] = ()  # prefill forwards: (start, tokens)
    decode_context: int = 0  # KV tokens the step's decodes attended to, summed


@dataclasses.dataclass
class HandoffSite:
    """Where decode pods reach this engine's hand-off endpoint."""

    host: str
    port: int
    engine_id: str


class EngineCore:
    def __init__(self, runner: ModelRunner, store: KVStore | None, keys: ChunkKeys,
                 policy: SchedulerPolicy, *, chunk_size: int, max_running: int,
                 max_model_len: int, handoff: Any = None, handoff_site: HandoffSite | None = None,
                 pull_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.time, pool: KVBlockPool | None = None,
                 layerwise_load: bool = True) -> None:
        self.runner = runner
        self.store = store
        self.keys = keys
        self.policy = policy
        self.chunk_size = chunk_size
        self.max_running = max_running
        self.max_model_len = max_model_len
        self.handoff = handoff
        self.handoff_site = handoff_site
        self.pull_timeout_s = pull_timeout_s
        self.clock = clock
        bundle = runner.bundle
        block = 64 if chunk_size % 64 == 0 else chunk_size
        self.pool = pool or KVBlockPool.for_bytes(
            1 << 30, num_layers=bundle.num_layers, block_size=block,
            num_kv_heads=bundle.num_kv_heads, head_dim=bundle.head_dim, dtype=bundle.dtype)
        if chunk_size % self.pool.block_size:
            raise ValueError(f"KV block size {self.pool.block_size} must divide the chunk "
                             f"size {chunk_size}")
        self.layerwise_load = layerwise_load
        self._pull_opener = concurrent.futures.ThreadPoolExecutor(2, "kv-pull-open")
        self._loads: list[LayerLoad] = []  # layer-wise copies that may still be running
        self._step_exposed = 0.0
        self._step_chunks: list[tuple[int, int]] = []  # this step's prefill forwards
        self.record_steps = False  # benchmarks: keep a StepRecord per step
        self.step_records: list[StepRecord] = []
        self.eos_token_id = bundle.tokenizer.eos_token_id
        self.waiting: collections.deque[EngineRequest] = collections.deque()
        self.running: list[EngineRequest] = []
        self.pulling: list[EngineRequest] = []
        self._by_id: dict[str, EngineRequest] = {}
        self._deferred: list[Callable[[], None]] = []
        self.stats = EngineCoreStats()
        # Tests: keep every request's sampled-from logits (req_id -> list of fp32 tensors).
        self.capture_logits = False
        self.captured_logits: dict[str, list[torch.Tensor]] = {}

    def close(self) -> None:
        """Let background KV work stop before the tiers it reads from are closed."""
        self._pull_opener.shutdown(wait=True, cancel_futures=True)
        for load in self._loads:  # a pull's copy may wait on the network: not forever
            load.join(5.0)
        self._loads = []

    # ------------------------------------------------------------------ queue
    def add(self, req: EngineRequest) -> None:
        if req.req_id in self._by_id:
            raise ValueError(f"duplicate request id {req.req_id}")
        self._by_id[req.req_id] = req
        if req.wants_remote_prefill:
            self._start_pull(req)
        else:
            self.waiting.append(req)

    def abort(self, req_id: str) -> bool:
        req = self._by_id.pop(req_id, None)
        if req is None:
            return False
        req.aborted = True
        for queue in (self.waiting, self.running, self.pulling):
            if req in queue:
                queue.remove(req)
        self._drop_cache(req)
        if req.prepared is not None:
            req.prepared[0].release()
            req.prepared = None
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pulling or self._deferred)

    def has_ready_work(self) -> bool:
        """A step would do something now (not just wait for a pull still on the wire): the
        engine process spins on this and only polls slowly while a pull is in flight."""
        return bool(self.waiting or self.running or self._deferred) or any(
            self._pull_ready(r) for r in self.pulling)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.pulling)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------------ step
    def step(self) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        self._promote_pulls(outputs)
        ctx = SchedulerContext(chunk_size=self.chunk_size, max_running=self.max_running,
                               now=self.clock(), lookup_tiers=self._lookup_tiers,
                               prefetch=self._prefetch_hint)
        plan = self.policy.schedule(list(self.waiting), list(self.running), ctx)
        t0 = time.perf_counter()
        c0 = time.thread_time() if self.record_steps else 0.0
        self._step_exposed = 0.0
        self._step_chunks = []
        for work in plan.prefill:
            if not work.request.aborted:
                self._prefill(work.request, work.num_tokens, outputs)
        chunks = self._step_chunks
        prefill_tokens = sum(n for _, n in chunks)
        decoded = context = 0
        for req in plan.decode:
            if not req.aborted and req.state is RequestState.DECODING:
                context += req.num_prompt_tokens + len(req.output_token_ids)
                self._decode(req, outputs)
                decoded += 1
        self._prepare_head()
        seconds = time.perf_counter() - t0
        self.stats.kv_load_exposed_seconds += self._step_exposed
        if self.record_steps and not plan.empty:
            self.step_records.append(StepRecord(
                seconds - self._step_exposed, self._step_exposed, prefill_tokens, decoded,
                time.thread_time() - c0, tuple(chunks), context))
        observe = getattr(self.policy, "observe_step", None)
        if observe is not None and not plan.empty:  # e.g. a step-time model fitted online
            observe(plan, seconds)
        return outputs

    def run_deferred(self) -> None:
        """Work that must not delay a first token: storing the prompt's new chunks."""
        work, self._deferred = self._deferred, []
        for fn in work:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a failed store only costs a future cache miss
                log.exception("deferred_work_failed")

    # ------------------------------------------------------------------ prefill
    def _hashes(self, req: EngineRequest) -> None:
        hasher = self.keys.hasher(req.cache_salt)
        raw = hasher.raw_hashes(req.prompt_token_ids)
        req.chunk_ints = [self.keys.to_int(h) for h in raw]
        req.chunk_hashes = [self.keys.wire_of_int(v) for v in req.chunk_ints]

    def _timeline_tokens(self, req: EngineRequest) -> int:
        """KV slots a request can ever fill: its prompt plus its output budget."""
        n = req.num_prompt_tokens
        return min(n + req.output_budget, max(self.max_model_len, n))

    def _reserve(self, req: EngineRequest, outputs: list[EngineOutput]) -> PagedKV | None:
        """Blocks for the request's whole timeline, or None (it waits; or, if it could never
        fit the pool, it is failed with an error naming the setting)."""
        need = self._timeline_tokens(req)
        kv = self.pool.reserve(need)
        if kv is None:
            self.stats.kv_pool_full_waits += 1
            if self.pool.blocks_for(need) > self.pool.num_blocks:
                msg = (f"the request needs {need} KV slots; this engine's KV pool holds "
                       f"{self.pool.num_blocks * self.pool.block_size} (raise --kv-cache-gib)")
                for queue in (self.waiting, self.pulling):
                    if req in queue:
                        queue.remove(req)
                self._by_id.pop(req.req_id, None)
                req.state = RequestState.FINISHED
                outputs.append(EngineOutput(req.req_id, finished=True, finish_reason="error",
                                            error=msg))
        return kv

    def _admit(self, req: EngineRequest, outputs: list[EngineOutput]) -> bool:
        """First scheduling: reserve KV blocks, hash the prompt, start loading the longest
        cached prefix (layer by layer, behind the forward pass) — unless that was done
        already while the request waited at the head of the queue (``_prepare_head``)."""
        prepared, req.prepared = req.prepared, None
        if prepared is None:
            kv = self._reserve(req, outputs)
            if kv is None:
                return False
            length, source = self._load_prefix(req, kv)
        else:
            kv, length, source = prepared
        self.waiting.remove(req)
        self.running.append(req)
        req.scheduled_time = self.clock()
        req.state = RequestState.PREFILLING
        req.num_computed = length
        req.cache = self.runner.paged_cache(kv, length, source)
        return True

    def _load_prefix(self, req: EngineRequest, kv: PagedKV) -> tuple[int, Any]:
        """Hash the prompt, fetch its longest cached prefix and start copying it into ``kv``;
        returns (tokens reused, the per-layer wait for the forward pass or None)."""
        self._hashes(req)
        req.reused_tokens = 0
        req.tokens_by_tier = {}
        # Reuse at most the chunks before the one holding the last prompt token: that token's
        # logits are needed, so at least one token is always computed.
        max_chunks = (req.num_prompt_tokens - 1) // self.chunk_size
        if self.store is None or max_chunks <= 0:
            return 0, None
        ints = req.chunk_ints[:max_chunks]
        source = None
        if self.layerwise_load:
            fetched = self.store.fetch_prefix(ints)
            if fetched.num_tokens:
                load = self._start_layer_load(
                    kv, chunk_copier(fetched.objs, kv, self.chunk_size), fetched.release)
                source = load.wait
            else:
                fetched.release()
        else:  # the non-overlapped path: every layer is copied before the forward
            fetched = self.store.fetch_prefix(ints, paged=kv)
            self.stats.kv_load_seconds += fetched.seconds
        req.load_seconds = fetched.seconds
        self._step_exposed += fetched.seconds  # on the step loop's critical path
        req.reused_tokens = fetched.num_tokens
        for tier, n in fetched.tokens_by_tier.items():
            req.add_tier_tokens(tier, n)
        return fetched.num_tokens, source

    def _prepare_head(self) -> None:
        """Start the head of the queue's prefix load now, when it is next in line (a slot is
        free and its blocks are): its layers then copy behind this step's end and the next
        step's compute instead of in front of its own forward pass."""
        if not (self.layerwise_load and self.store is not None and self.waiting):
            return
        req = self.waiting[0]
        if req.prepared is not None or len(self.running) >= self.max_running \
                or req.num_prompt_tokens <= self.chunk_size:
            return
        kv = self.pool.reserve(self._timeline_tokens(req))
        if kv is None:
            return
        length, source = self._load_prefix(req, kv)
        req.prepared = (kv, length, source)

    def _start_layer_load(self, kv: PagedKV, copy_layer: Callable[[int], None],
                          release: Callable[[], None] | None = None) -> LayerLoad:
        """Copy KV into ``kv`` layer by layer on a thread; the blocks stay reserved until the
        copy has stopped, even if the request ends first."""
        kv.retain()
        stats = self.stats

        def on_exit() -> None:
            if release is not None:
                release()
            kv.release()

        def on_wait(load: LayerLoad, layer: int, waited: float) -> None:
            self._step_exposed += waited
            if layer == load.num_layers - 1:
                stats.kv_load_seconds += load.seconds

        load = LayerLoad(self.runner.bundle.num_layers, copy_layer, on_exit=on_exit,
                         on_wait=on_wait)
        self._loads = [x for x in self._loads if not x.done()] + [load]
        return load

    def _drop_cache(self, req: EngineRequest) -> None:
        """Give the request's KV blocks back (a pending store or hand-off may still hold
        them; they are freed when the last holder lets go)."""
        cache, req.cache = req.cache, None
        kv = getattr(cache, "paged_kv", None)
        if kv is not None and kv.alive:
            kv.release()

    def _recompute(self, req: EngineRequest, exc: Exception) -> None:
        """A layer-wise load failed mid-forward: start the prompt over, computing all of it."""
        log.warning("kv_load_failed_recomputing", req_id=req.req_id, error=str(exc))
        kv = req.cache.paged_kv
        req.cache = self.runner.paged_cache(kv, 0, None)
        req.num_computed = 0
        req.reused_tokens = 0
        req.tokens_by_tier = {}

    def _prefill(self, req: EngineRequest, budget: int, outputs: list[EngineOutput]) -> None:
        if req.state is RequestState.WAITING:
            if len(self.running) >= self.max_running:
                return
            if not self._admit(req, outputs):
                return
        start = req.num_computed
        end = pass_end(start, req.num_prompt_tokens, budget, self.chunk_size)
        t0 = time.perf_counter()
        try:
            logits = self.runner.forward(req.prompt_token_ids[start:end], req.cache, start)
        except LoadFailed as exc:
            self._recompute(req, exc)
            return
        req.prefill_seconds += time.perf_counter() - t0
        req.num_computed = end
        self._step_chunks.append((start, end - start))
        self.stats.prefill_tokens_computed += end - start
        if end < req.num_prompt_tokens:
            return
        # -- the prompt is done
        self._defer_store(req)
        first = self._choose(req, logits, 0)
        req.output_token_ids.append(first.token_id)
        req.first_token_time = self.clock()
        if req.wants_remote_decode:
            params = self._pin_for_decode(req, first)
            self._finish(req, outputs, [first], "length", kv_transfer_params=params)
            return
        req.state = RequestState.DECODING
        reason = self._stop_reason(req, first.token_id)
        if reason:
            self._finish(req, outputs, [first], reason)
        else:
            outputs.append(EngineOutput(req.req_id, [first], meta=self._first_meta(req)))

    def _defer_store(self, req: EngineRequest) -> None:
        if self.store is None:
            return
        skip = req.reused_tokens // self.chunk_size
        if len(req.chunk_ints) <= skip:
            return
        kv = req.cache.paged_kv.retain()  # the blocks outlive the request until stored
        tokens = list(req.prompt_token_ids)
        salt = req.cache_salt
        store = self.store

        def _store() -> None:
            try:
                req.stored_chunks = store.store(tokens, None, skip, salt, paged=kv)
            finally:
                kv.release()

        self._deferred.append(_store)

    # ------------------------------------------------------------------ decode
    def _decode(self, req: EngineRequest, outputs: list[EngineOutput]) -> None:
        if req.remote is not None and len(req.output_token_ids) == 0:
            self._decode_first_remote(req, outputs)
            return
        last = req.output_token_ids[-1]
        pos = req.num_prompt_tokens + len(req.output_token_ids) - 1
        t0 = time.perf_counter()
        logits = self.runner.forward([last], req.cache, pos)
        req.decode_seconds += time.perf_counter() - t0
        tok = self._choose(req, logits, len(req.output_token_ids))
        req.output_token_ids.append(tok.token_id)
        reason = self._stop_reason(req, tok.token_id)
        if reason:
            self._finish(req, outputs, [tok], reason)
        else:
            outputs.append(EngineOutput(req.req_id, [tok]))

    def _choose(self, req: EngineRequest, logits: torch.Tensor, index: int) -> TokenOut:
        if self.capture_logits:
            self.captured_logits.setdefault(req.req_id, []).append(logits.clone())
        sp = req.sampling
        if sp.forced_output_token_ids is not None:
            token = sp.forced_output_token_ids[index]
        else:
            token = sample(logits, temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed,
                           position=index)
        if sp.logprobs is None:
            return TokenOut(token)
        lp, top = logprobs_of(logits, token, sp.logprobs)
        return TokenOut(token, lp, top)

    def _stop_reason(self, req: EngineRequest, token: int) -> str | None:
        sp = req.sampling
        if sp.forced_output_token_ids is None and not sp.ignore_eos and (
                token == self.eos_token_id or token in sp.stop_token_ids):
            return "stop"
        if len(req.output_token_ids) >= req.output_budget:
            return "length"
        if req.num_prompt_tokens + len(req.output_token_ids) >= self.max_model_len:
            return "length"
        return None

    def _first_meta(self, req: EngineRequest) -> dict[str, Any]:
        return {
            "prompt_tokens": req.num_prompt_tokens,
            "cached_tokens": req.cached_tokens(),
            "cached_tokens_by_tier": dict(req.tokens_by_tier),
            "queue_seconds": (req.scheduled_time or req.arrival_time) - req.arrival_time,
            "load_seconds": req.load_seconds,
            "prefill_seconds": req.prefill_seconds,
            "prefill_tokens": req.num_prompt_tokens - req.cached_tokens(),
        }

    def _finish(self, req: EngineRequest, outputs: list[EngineOutput], tokens: list[TokenOut],
                reason: str, kv_transfer_params: dict[str, Any] | None = None) -> None:
        req.state = RequestState.FINISHED
        params = dict(kv_transfer_params or {})
        params["chunk_hashes"] = list(req.chunk_hashes)
        meta = self._first_meta(req) if len(req.output_token_ids) <= len(tokens) else {}
        meta.update(decode_seconds=req.decode_seconds, completion_tokens=len(req.output_token_ids))
        if req.remote is not None:
            meta.update(transfer_bytes=req.remote.bytes_received,
                        transfer_seconds=req.remote.seconds)
            params.update(kv_source="remote", transfer_bytes=req.remote.bytes_received,
                          transfer_seconds=round(req.remote.seconds, 6),
                          transfer_start_token=req.remote.start_token)
        outputs.append(EngineOutput(req.req_id, tokens, finished=True, finish_reason=reason,
                                    meta=meta, kv_transfer_params=params))
        if req in self.running:
            self.running.remove(req)
        self._by_id.pop(req.req_id, None)
        self.stats.requests_finished += 1
        cache = req.cache
        if cache is not None and req.remote is not None and self.store is not None:
            self._store_remote(req, cache)
        self._drop_cache(req)

    # ------------------------------------------------------------------ P/D: prefill side
    def _pin_for_decode(self, req: EngineRequest, first: TokenOut) -> dict[str, Any]:
        if self.handoff is None or self.handoff_site is None:
            raise RuntimeError("this engine cannot serve KV hand-offs")
        total = req.num_prompt_tokens
        # Copies (one gather launch per layer), not views of the blocks: the registry hands
        # out slices of what it holds and cannot say when a stream is done, so views could
        # outlive the blocks' reservation and stream another request's KV.
        layers = req.cache.paged_kv.layers(total, copy=True)
        b = self.runner.bundle
        header = {
            "model": b.name, "num_tokens": total, "num_layers": b.num_layers,
            "num_kv_heads": b.num_kv_heads, "head_dim": b.head_dim,
            "dtype": dtype_name(b.dtype), "tokens_digest": tokens_digest(req.prompt_token_ids),
            "chunk_hashes": list(req.chunk_hashes), "first_token_id": first.token_id,
            "first_logprob": first.logprob, "first_top_logprobs": first.top_logprobs,
        }
        transfer_id = self.handoff.register(header, layers)
        site = self.handoff_site
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_host": site.host, "remote_port": site.port,
                "remote_engine_id": site.engine_id, "transfer_id": transfer_id,
                "num_tokens": total}

    # ------------------------------------------------------------------ P/D: decode side
    def _start_pull(self, req: EngineRequest) -> None:
        """Queue a ``do_remote_prefill`` request; its local prefix is read and its pull opened
        on a worker thread (``_open_pull``), never on the step loop."""
        req.arrival_time = req.arrival_time or self.clock()
        self._hashes(req)
        req.state = RequestState.PULLING
        self.pulling.append(req)
        req.pull_open = self._pull_opener.submit(self._open_pull, req)

    def _open_pull(self, req: EngineRequest) -> Any:
        """(worker thread) Read the local prefix, then start pulling the rest."""
        b = self.runner.bundle
        prefix = self._local_prefix(req)
        n_local = req.reused_tokens // self.chunk_size
        return RemoteKV(req.kv_transfer_params or {}, req.prompt_token_ids,
                        num_layers=b.num_layers, num_kv_heads=b.num_kv_heads,
                        head_dim=b.head_dim, dtype=b.dtype, timeout_s=self.pull_timeout_s,
                        prefix=prefix, prefix_chunk_hashes=req.chunk_hashes[:n_local]).start()

    def _local_prefix(self, req: EngineRequest) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The prompt's leading full chunks this engine already holds (a session's previous
        turn, kept after its pull): only the rest is pulled from the prefill pod. Every full
        chunk counts — the prefill pod sent the first token, nothing is computed here."""
        req.reused_tokens = 0
        req.tokens_by_tier = {}
        if self.store is None or not req.chunk_ints:
            return None
        t0 = time.perf_counter()
        res = self.store.load_prefix(req.chunk_ints)
        req.load_seconds = time.perf_counter() - t0
        if not res.num_tokens or res.layers is None:
            return None
        req.reused_tokens = res.num_tokens
        for tier, n in res.tokens_by_tier.items():
            req.add_tier_tokens(tier, n)
        return list(res.layers)

    def _pull_ready(self, req: EngineRequest) -> bool:
        """Something for the step loop to do about this pull now."""
        opening = req.pull_open
        if opening is not None:
            return opening.done()
        if req.remote is None:
            return False
        if req.kv_load is None:
            return req.remote.header_ready()
        return req.kv_load.done()  # its layers are still arriving: nothing to step yet

    def _promote_pulls(self, outputs: list[EngineOutput] | None = None) -> None:
        """Pulls whose hand-off header arrived get KV blocks and a thread copying each layer
        into them as it arrives; a pull joins the running requests only once all of it is in
        its blocks, so no step ever waits on the network or on the copy (not even on an idle
        engine: a step blocked on a pull's last layers would hold back every pull promoted
        after it)."""
        for req in list(self.pulling):
            opening = req.pull_open
            if opening is not None:
                if not opening.done():
                    continue
                req.pull_open = None
                try:
                    req.remote = opening.result()
                except Exception as exc:  # noqa: BLE001 - TransferError, or a failed prefix read
                    self.pulling.remove(req)
                    self._fall_back(req, exc if isinstance(exc, TransferError)
                                    else TransferError(repr(exc)))
                    continue
            if not req.remote.header_ready():
                continue
            if req.kv_load is None:
                try:
                    req.remote.wait_header()
                except TransferError as exc:
                    self.pulling.remove(req)
                    self._fall_back(req, exc)
                    continue
                kv = self._reserve(req, outputs if outputs is not None else [])
                if kv is None:
                    continue
                remote = req.remote
                req.kv_load = self._start_layer_load(kv, tensor_copier(remote.layer, kv))
                req.cache = self.runner.paged_cache(kv, req.num_prompt_tokens, req.kv_load.wait)
            if not req.kv_load.done():
                continue
            if len(self.running) >= self.max_running:
                break
            self.pulling.remove(req)
            req.scheduled_time = self.clock()
            req.num_computed = req.num_prompt_tokens
            req.state = RequestState.DECODING
            self.running.append(req)

    def _decode_first_remote(self, req: EngineRequest, outputs: list[EngineOutput]) -> None:
        header = req.remote.header
        first_id = int(header["first_token_id"])
        forced = req.sampling.forced_output_token_ids
        if forced is not None:
            first_id = forced[0]
        first = TokenOut(first_id)
        if req.sampling.logprobs is not None and header.get("first_logprob") is not None:
            top = [tuple(x) for x in header.get("first_top_logprobs") or []]
            first = TokenOut(first_id, header["first_logprob"], top[: req.sampling.logprobs])
        try:
            t0 = time.perf_counter()
            req.output_token_ids.append(first_id)
            if self._stop_reason(req, first_id):
                req.remote.layers()  # verify every layer before answering
                second = None
            else:
                logits = self.runner.forward([first_id], req.cache, req.num_prompt_tokens)
                second = self._choose(req, logits, 1)
            req.decode_seconds += time.perf_counter() - t0
        except (TransferError, LoadFailed) as exc:
            req.output_token_ids.clear()
            self.running.remove(req)
            self._fall_back(req, exc)
            return
        self.stats.transfer_bytes_received += req.remote.bytes_received
        self.stats.transfer_tokens_local += req.reused_tokens
        req.add_tier_tokens(REMOTE_TIER, req.num_prompt_tokens - req.reused_tokens)
        req.first_token_time = self.clock()
        tokens = [first]
        reason = self._stop_reason(req, first_id)
        if second is not None:
            req.output_token_ids.append(second.token_id)
            tokens.append(second)
            reason = self._stop_reason(req, second.token_id)
        if reason:
            self._finish(req, outputs, tokens, reason)
        else:
            outputs.append(EngineOutput(req.req_id, tokens, meta=self._first_meta(req)))

    def _fall_back(self, req: EngineRequest, exc: Exception, queued: bool = True) -> None:
        """The hand-off failed: compute the prompt here instead (same output, slower)."""
        log.warning("kv_pull_failed_recomputing", req_id=req.req_id, error=str(exc))
        self.stats.transfer_failures += 1
        if req.remote is not None:
            self.stats.transfer_bytes_received += req.remote.bytes_received
        req.remote = None
        req.kv_load = None
        req.pull_open = None
        req.kv_transfer_params = {k: v for k, v in (req.kv_transfer_params or {}).items()
                                  if k != "do_remote_prefill"}
        self._drop_cache(req)
        req.num_computed = 0
        req.tokens_by_tier = {}
        req.reused_tokens = 0
        req.load_seconds = 0.0
        req.state = RequestState.WAITING
        self.waiting.appendleft(req)

    def _store_remote(self, req: EngineRequest, cache: Any) -> None:
        """Keep a pulled prompt's full chunks here too, for this session's next turn (the
        chunks that were found here already are not stored again)."""
        store = self.store
        assert store is not None
        if not all_materialized(cache) and req.kv_load is not None and req.kv_load.done():
            # finished on token one: no forward touched the layers, but they are all in
            try:
                for layer in cache.layers:
                    layer.materialize()
            except LoadFailed:
                return
        if not all_materialized(cache):
            return
        tokens, salt = list(req.prompt_token_ids), req.cache_salt
        skip = req.reused_tokens // self.chunk_size
        if len(tokens) // self.chunk_size <= skip:
            return
        kv = cache.paged_kv.retain()

        def _store() -> None:
            try:
                store.store(tokens, None, skip, salt, paged=kv)
            finally:
                kv.release()

        self._deferred.append(_store)

    # ------------------------------------------------------------------ policy helpers
    def _lookup_tiers(self, req: EngineRequest) -> list[Tier]:
        if self.store is None:
            return []
        if not req.chunk_ints:
            self._hashes(req)
        return self.store.lookup(req.chunk_ints)

    def _prefetch_hint(self, hashes: list[str]) -> None:
        if self.store is not None and hashes:
            self.store.prefetch(hashes, None)
