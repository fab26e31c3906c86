"""Run by test_connector_vllm.py in a child process (vLLM's import changes process-wide state:
it stays out of the pytest process). Builds ``AgentServingConnectorV1`` the way vLLM does and
drives it with vLLM's real ``Request`` objects; prints one JSON report.

argv: <vllm env dir> <work dir> <memory port start> <kvindex url>
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    import faulthandler

    from testkit.vllm_env import enter_vllm_env, write_tiny_llama

    faulthandler.dump_traceback_later(150, exit=True)  # a hang shows where, then exits
    env_dir, work, port_start, kvindex = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4]
    enter_vllm_env(env_dir)
    model_dir = write_tiny_llama(work / "tiny-llama", max_positions=2048)
    chunk = 16
    (work / "lmcache.yaml").write_text(f"chunk_size: {chunk}\nlocal_cpu: true\n"
                                       "max_local_cpu_size: 0.01\nsave_unfull_chunk: false\n"
                                       "enable_async_loading: true\n")
    os.environ["LMCACHE_CONFIG_FILE"] = str(work / "lmcache.yaml")

    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request, RequestStatus

    ktc = KVTransferConfig(
        kv_connector="AgentServingConnectorV1",
        kv_connector_module_path="agentserving.engine.vllm.connector", kv_role="kv_both",
        kv_connector_extra_config={"memory_port_start": port_start, "memory_host": "127.0.0.1",
                                   "public_host": "127.0.0.1", "pod_name": "vllm-probe-0",
                                   "kvindex_url": kvindex, "report_interval_s": 0.1})
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                 dtype="float32", max_model_len=1024),
        cache_config=CacheConfig(block_size=16),
        scheduler_config=SchedulerConfig(max_model_len=1024, is_encoder_decoder=False,
                                         disable_hybrid_kv_cache_manager=True),
        device_config=DeviceConfig(device="cpu"), kv_transfer_config=ktc)
    report: dict = {}
    cls = KVConnectorFactory.get_connector_class(ktc)
    report["class"] = f"{cls.__module__}.{cls.__name__}"
    report["is_lmcache_dynamic"] = issubclass(cls, LMCacheConnectorV1Dynamic)
    report["is_base_v1"] = issubclass(cls, KVConnectorBase_V1)
    conn = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER,
        KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[]))
    try:
        impl = conn._lmcache_engine
        report["lookup_client"] = type(impl.lookup_client).__name__
        db = conn._as_recorder.inner if conn._as_recorder is not None else None
        report["recorder_installed"] = conn._as_recorder is not None

        def request(rid: str, tokens: list[int]) -> Request:
            return Request(rid, tokens, SamplingParams(max_tokens=1), None)

        tokens = list(range(3 * chunk + 5))
        lmcache_own = [f"{h:x}" for _, _, h in db.process_tokens(tokens, make_key=False)]
        report["lmcache_hashes"] = lmcache_own
        # with vLLM loaded LMCache starts its chain from vLLM's NONE_HASH (PYTHONHASHSEED):
        # the index's lmcache-builtin hasher reproduces the pod's hashes given that start
        import lmcache.v1.token_database as tdb

        from agentserving.core.hashing import ChunkHasher

        report["none_hash"] = tdb.NONE_HASH
        report["core_hashes"] = ChunkHasher("lmcache-builtin", chunk,
                                            none_hash=tdb.NONE_HASH).hashes(tokens)

        # lookup path: vLLM asks LMCache how much it holds; the hashes are kept
        r1 = request("req-lookup", tokens)
        report["matched"] = list(conn.get_num_new_matched_tokens(r1, 0))
        report["cached_after_lookup"] = len(conn._as_hashes)
        r1.status = RequestStatus.FINISHED_STOPPED
        free, params = conn.request_finished(r1, [])
        report["lookup_finished"] = {"delay_free": free, "params": params}
        report["cache_hits"] = conn._as_hashes.hits

        # no lookup (a kv_producer pool skips it): recomputed from the prompt
        r2 = request("req-nolookup", tokens)
        r2.status = RequestStatus.FINISHED_LENGTH_CAPPED
        free, params = conn.request_finished(r2, [])
        report["recompute_finished"] = {"delay_free": free, "params": params}
        report["cache_misses"] = conn._as_hashes.misses

        # an aborted request after lookup: cache emptied, no leak
        r3 = request("req-abort", tokens[:40])
        conn.get_num_new_matched_tokens(r3, 0)
        r3.status = RequestStatus.FINISHED_ABORTED
        report["abort_finished"] = conn.request_finished(r3, [])[1]
        report["cache_left"] = len(conn._as_hashes)

        # reuse metrics: prompt tokens of each request once, and vLLM's own prefix-cache hit
        # (the device tier) as the scheduler hands it to the connector
        r4 = request("req-device", tokens)
        conn.get_num_new_matched_tokens(r4, 32)
        conn.get_num_new_matched_tokens(r4, 32)  # asked again while waiting: counted once
        # the worker's load record reaches the scheduler as vLLM's worker metadata: through
        # vLLM's own update_connector_output (late) and the early path, both summed
        from vllm.v1.outputs import KVConnectorOutput

        from agentserving.engine.vllm.load_log import LoadRecord, LoadsMeta

        conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=LoadsMeta(
            {"req-device": LoadRecord({"cpu": 16}, 0.02, 0.0)})))
        conn.agentserving_take_loads(LoadsMeta(
            {"req-device": LoadRecord({"disk": 5}, 0.03, 0.025),
             "req-unknown": LoadRecord({"cpu": 99}, 1.0, 0.0)}))
        r4.status = RequestStatus.FINISHED_ABORTED
        report["device_finished"] = conn.request_finished(r4, [])[1]

        # the scheduler's services: forwarding memory API up, the pod registered
        import httpx

        deadline = time.monotonic() + 30
        pods: list = []
        while time.monotonic() < deadline:
            pods = httpx.get(f"{kvindex}/v1/pods", timeout=5).json()["pods"]
            if pods:
                break
            time.sleep(0.1)
        report["pods"] = [{k: p[k] for k in ("pod", "role", "memory_api_url", "model",
                                              "chunk_size")} for p in pods]
        r = httpx.post(f"http://127.0.0.1:{port_start}/memory/evict",
                       json={"chunk_hashes": ["abc"], "locations": ["tape"]}, timeout=5)
        report["forwarding_bad_location"] = [r.status_code, r.json()["error"].get("param")]
        report["scheduler_metrics"] = httpx.get(f"http://127.0.0.1:{port_start}/metrics",
                                                timeout=5).text
    finally:
        # Our services stop first; then LMCache's own shutdown, whose async lookup client can
        # block forever in zmq term() when a lookup was sent to a worker that never existed
        # (LMCache 0.5.6, seen here only: no worker process). Not waited for past 20 s.
        import threading

        closer = threading.Thread(target=conn.shutdown, daemon=True)
        closer.start()
        deadline = time.monotonic() + 60
        while conn._as_scheduler is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        report["services_stopped"] = conn._as_scheduler is None
        closer.join(20)
    report["pods_after_shutdown"] = [p["pod"] for p in
                                     httpx.get(f"{kvindex}/v1/pods", timeout=5).json()["pods"]]
    report["worker"] = worker_side(port_start, work)
    print("PROBE-REPORT " + json.dumps(report), flush=True)
    # LMCache's ZMQ threads may outlive the connector's shutdown; the report is out
    os._exit(0)


def worker_side(port_start: int, work: Path) -> dict:
    """The worker role's glue (``_maybe_start_worker_services`` / ``shutdown``) over a real
    LMCache engine: vLLM's worker-side ``LMCacheConnectorV1Impl`` needs CUDA to build one, so
    the connector is given LMCache's engine the way the impl would hold it."""
    import dataclasses
    import importlib.util
    from types import SimpleNamespace

    import httpx
    import torch

    from agentserving.engine.vllm.connector import AgentServingConnectorV1
    from agentserving.engine.vllm.load_log import LoadLog
    from agentserving.engine.vllm.settings import parse_settings
    from agentserving.engine.vllm.step_times import StepClock

    spec = importlib.util.spec_from_file_location("probe_conftest",
                                                  Path(__file__).with_name("conftest.py"))
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    engine = helpers.build_engine(work / "disk", worker_id=0, world_size=1)
    tokens = list(range(2 * helpers.CHUNK))
    engine.store(torch.tensor(tokens), kv=helpers.random_kv(len(tokens), seed=3))
    conn = AgentServingConnectorV1.__new__(AgentServingConnectorV1)
    conn._as_settings = parse_settings({"memory_port_start": port_start,
                                        "memory_host": "127.0.0.1"}, {})
    conn._as_worker = conn._as_scheduler = None
    conn._as_steps = StepClock()  # the worker role's step clock, served by the rank's API
    conn._as_loads = LoadLog()
    conn._lmcache_engine = SimpleNamespace(lmcache_engine=None, shutdown=lambda: None)
    out: dict = {}
    conn._maybe_start_worker_services()  # no engine yet (before register_kv_caches): nothing
    out["started_without_engine"] = conn._as_worker is not None
    conn._lmcache_engine.lmcache_engine = engine
    conn._maybe_start_worker_services()
    url = f"http://127.0.0.1:{port_start + 1}"
    deadline = time.monotonic() + 30
    while True:
        try:
            out["chunks"] = httpx.get(f"{url}/memory/chunks", timeout=5).json()["chunks"]
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    out["expected"] = [f"{h:x}" for _, _, h in
                       engine.token_database.process_tokens(tokens, make_key=False)]
    # rank 0 counts LMCache's loads by tier: a retrieve as vLLM's load makes one
    # and per request, for the scheduler (vLLM's worker metadata of the step)
    engine.retrieve(torch.tensor(tokens), out=torch.zeros_like(helpers.random_kv(len(tokens), 4)),
                    req_id="req-dram")
    out["worker_metrics"] = httpx.get(f"{url}/metrics", timeout=5).text
    meta = conn.build_connector_worker_meta()
    out["dram_meta"] = {rid: dataclasses.asdict(rec) for rid, rec in meta.loads.items()}
    out["meta_after_take"] = conn.build_connector_worker_meta()
    # one step that loaded KV, timed at the connector's calls, as the rank's API serves it
    conn._as_steps.begin(loads=1)
    with conn._as_steps.timed():
        time.sleep(0.01)
    conn._as_steps.end()
    out["steps"] = httpx.get(f"{url}/memory/steps", timeout=5).json()
    deadline = time.monotonic() + 30  # LMCache writes its disk tier behind the store
    while len(httpx.get(f"{url}/memory/chunks", timeout=5).json()["chunks"].get("disk", [])) \
            < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    r = httpx.post(f"{url}/memory/evict", json={"chunk_hashes": out["expected"],
                                                "locations": ["LocalCPUBackend"]}, timeout=5)
    out["evicted"] = r.json()["num_evicted"]
    # read back from disk alone: its time is the load's disk-read time
    engine.retrieve(torch.tensor(tokens), out=torch.zeros_like(helpers.random_kv(len(tokens), 4)),
                    req_id="req-disk", vllm_cached_tokens=helpers.CHUNK + 3)
    meta = conn.build_connector_worker_meta()
    out["disk_meta"] = {rid: dataclasses.asdict(rec) for rid, rec in meta.loads.items()}
    conn.shutdown()
    try:
        httpx.get(f"{url}/healthz", timeout=2)
        out["served_after_shutdown"] = True
    except httpx.HTTPError:
        out["served_after_shutdown"] = False
    return out  # the engine is not closed: the probe exits with os._exit


if __name__ == "__main__":
    main()
