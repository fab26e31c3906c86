"""The connector's decisions, as pure functions: settings, hash caching and return, residency
diffs, registration. LMCache's real ``ChunkedTokenDatabase`` where hashing is involved."""

from __future__ import annotations

import pytest

from agentserving.core.hashing import ChunkHasher
from agentserving.core.schemas import PodRole, Tier
from agentserving.engine.memory_api import backend_names
from agentserving.engine.vllm.hashes import (
    ChunkHashCache,
    finished_hashes,
    install_recorder,
    prompt_tokens,
    wire_hash,
)
from agentserving.engine.vllm.services import pod_registration, residency_changes
from agentserving.engine.vllm.settings import ConnectorConfigError, parse_settings, pod_role
from agentserving.kvindex.ingest.lmcache_controller import render_key


def test_settings_from_extra_config_over_env():
    s = parse_settings({"memory_port_start": "7100", "hash_scheme": "lmcache-ascend",
                        "chunk_hashes": "false"},
                       {"POD_NAME": "p-0", "POD_IP": "10.0.0.7",
                        "AGENTSERVING_KVINDEX_URL": "http://kvi:8300/"})
    assert (s.pod_name, s.public_host, s.kvindex_url) == ("p-0", "10.0.0.7", "http://kvi:8300")
    assert s.memory_port_start == 7100 and s.worker_port(2) == 7103
    assert s.worker_urls(2) == ["http://127.0.0.1:7101", "http://127.0.0.1:7102"]
    assert s.hash_scheme == "lmcache-ascend" and s.chunk_hashes is False and s.memory_api
    assert s.layerwise_load is True  # vLLM-CPU's reloads layer by layer unless told
    assert parse_settings({"layerwise_load": "false"}, {}).layerwise_load is False
    assert parse_settings({"layerwise_load": False}, {}).layerwise_load is False
    assert parse_settings({"kvindex_url": None}, {"AGENTSERVING_KVINDEX_URL": "http://x"}
                          ).kvindex_url is None  # explicit null turns reporting off


@pytest.mark.parametrize("extra,key", [
    ({"memory_port_start": 70000}, "memory_port_start"),
    ({"memory_port_start": "abc"}, "memory_port_start"),
    ({"hash_scheme": "md5"}, "hash_scheme"),
    ({"kvindex_url": "kvi:8300"}, "kvindex_url"),
    ({"memory_api": "maybe"}, "memory_api"),
    ({"report_interval_s": 0}, "report_interval_s"),
    ({"layerwise_load": "sometimes"}, "layerwise_load"),
])
def test_bad_settings_name_the_key(extra, key):
    with pytest.raises(ConnectorConfigError) as err:
        parse_settings(extra, {})
    assert err.value.key == key and f"kv_connector_extra_config.{key}" in str(err.value)


def test_wire_hash_matches_the_kvindex_controller_adapter():
    for v in (0, 1, -1, 2**63 - 1, -(2**63), 0x6ED9A448787A198F, 2**200 + 5):
        assert wire_hash(v) == render_key(v)
    assert wire_hash(-0x6ED9A448787A198F) == "-6ed9a448787a198f"  # seed 000's form
    assert wire_hash(b"\x00" * 31 + b"\x01") == "1"


def test_cache_pops_once_and_is_bounded():
    cache = ChunkHashCache(max_requests=2)
    cache.put("a", [1])
    cache.put("b", [2])
    cache.put("c", [3])  # "a" dropped: bounded
    assert cache.pop("a") is None and cache.pop("b") == [2] and cache.pop("b") is None
    assert (cache.hits, cache.misses, len(cache)) == (1, 2, 1)


def test_finished_hashes_prefers_cache_and_recomputes_only_on_miss():
    calls = []

    def recompute():
        calls.append(1)
        return [5, -5]

    assert finished_hashes([1, 2], recompute) == ["1", "2"] and not calls
    assert finished_hashes(None, recompute) == ["5", "-5"] and calls == [1]
    assert finished_hashes(None, None) is None


class _Req:
    def __init__(self, prompt, all_tokens=None):
        self.prompt_token_ids, self.all_token_ids = prompt, all_tokens


def test_prompt_tokens_falls_back_to_all():
    assert prompt_tokens(_Req([1, 2], [1, 2, 3])) == [1, 2]
    assert prompt_tokens(_Req(None, [4])) == [4]
    assert prompt_tokens(_Req(None, None)) == []


def _lmcache_db(chunk: int = 16):
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.token_database import ChunkedTokenDatabase

    cfg = LMCacheEngineConfig.from_dict({"chunk_size": chunk, "save_unfull_chunk": False})
    md = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.float32, kv_shape=(1, 2, chunk, 1, 4),
                         chunk_size=chunk)
    return ChunkedTokenDatabase(cfg, md)


class _Wrapper:  # LMCache's decorator clients keep the real one here
    def __init__(self, inner):
        self.actual_lookup_client = inner


class _Client:
    def __init__(self, db):
        self.token_database = db


def test_recorder_keeps_lookup_hashes_without_changing_them():
    db = _lmcache_db()
    client = _Client(db)
    cache = ChunkHashCache()
    rec = install_recorder(_Wrapper(_Wrapper(client)), cache)
    assert rec is not None and client.token_database is rec
    assert install_recorder(_Wrapper(client), cache) is rec  # installed once
    tokens = list(range(40))
    plain = list(db.process_tokens(tokens, make_key=False))
    with rec.recording("req-1"):
        seen = list(client.token_database.process_tokens(tokens, make_key=False))
    assert seen == plain  # LMCache sees exactly what its database yields
    # outside a lookup, or when keys are made (store / retrieve), nothing is recorded
    list(client.token_database.process_tokens(tokens, make_key=False))
    with rec.recording("req-2"):
        list(client.token_database.process_tokens(tokens, make_key=True))
    assert cache.pop("req-2") is None
    got = cache.pop("req-1")
    assert got == [h for _, _, h in plain]
    assert [wire_hash(h) for h in got] == ChunkHasher("lmcache-builtin", 16).hashes(tokens)
    assert rec.chunk_size == 16  # every other attribute is the real database's
    assert install_recorder(object(), cache) is None


def test_residency_changes_per_tier():
    stored, removed = residency_changes({"cpu": {"a", "b"}, "disk": {"a"}},
                                        {"cpu": ["b", "c"], "disk": []})
    assert stored == {"cpu": ["c"]} and removed == {"cpu": ["a"], "disk": ["a"]}
    assert residency_changes({}, {}) == ({}, {})


def test_backend_names_accept_tiers_and_backends():
    avail = ["LocalCPUBackend", "LocalDiskBackend"]
    assert backend_names(None, avail) == avail
    assert backend_names(["disk", "LocalCPUBackend"], avail) == ["LocalDiskBackend",
                                                                 "LocalCPUBackend"]
    with pytest.raises(KeyError):
        backend_names(["disk"], ["LocalCPUBackend"])


def test_registration_and_roles():
    s = parse_settings({"public_host": "10.1.2.3", "api_port": 8000}, {"POD_NAME": "p"})
    reg = pod_registration(s, role=pod_role("kv_producer"), model="m", chunk_size=256,
                           capacity={Tier.CPU: 10}, world_size=2)
    assert reg.memory_api_url == "http://10.1.2.3:6999" and reg.api_url == "http://10.1.2.3:8000"
    assert reg.role == PodRole.PREFILL and reg.labels["engine_processes"] == "2"
    assert pod_role("kv_consumer") == PodRole.DECODE and pod_role(None) == PodRole.BOTH


def test_pins_never_keep_a_full_length_request_out_of_the_pool():
    from agentserving.engine.vllm.device_kv import device_pin_bound

    # 96 blocks of 64 tokens, 4,096-token requests (64 blocks): a 0.75 share (72) would leave 24
    assert device_pin_bound(96, 0.75, 64, 4096) == 32
    assert device_pin_bound(1000, 0.5, 16, 4096) == 500  # a large pool: the share binds
    assert device_pin_bound(40, 0.75, 64, 4096) == 0  # no room beside one longest request: no pins
    assert device_pin_bound(100, 0.75, 64, 0) == 75  # no length known: the share alone
