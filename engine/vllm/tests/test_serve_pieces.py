"""The vLLM engine's pure pieces, without vLLM: the ``vllm serve`` command a worker becomes,
the stream rewriting, request-id mapping and the cache-salt body rewrite. (The real thing runs
in e2e/vllm against a live ``vllm serve``.)"""

from __future__ import annotations

import asyncio
import json
import types
from typing import Any

import pytest
from click.testing import CliRunner

from agentserving.core.cli import main
from agentserving.core.hashing import HashScheme
from agentserving.engine.model.folders import MODEL_CACHE
from agentserving.engine.settings import WorkerSettings
from agentserving.engine.vllm import (
    request_body,
    salting,
    serve_command,
    shm_waits,
    stream_hashes,
    teacher_forcing,
)
from agentserving.engine.vllm.hashes import external_request_id


def _build(**kwargs: Any) -> serve_command.ServeCommand:
    return serve_command.build(WorkerSettings(engine="vllm", vllm_python="/py", **kwargs),
                               environ={})


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_worker_settings_become_vllm_flags_and_lmcache_env(tmp_path: Any) -> None:
    cmd = _build(port=9001, host="0.0.0.0", advertise_host="10.0.0.7", pod_name="p1",
                 memory_port_start=7100, kvindex_url="http://kv:8300", cpu_cache_gib=1.5,
                 disk_cache_dir=tmp_path, disk_cache_gib=3, kv_cache_gib=1.2,
                 kv_block_size=128, prefill_chunk_tokens=1024, max_running_requests=8,
                 max_model_len=4096, enforce_eager=True, kv_transfer_url="lm://kv:65000",
                 role="decode", vllm_args=["--swap-space", "0"])
    argv, env = cmd.argv, cmd.env
    assert argv[:4] == ["/py", "-m", serve_command.LAUNCHER, "serve"]
    assert _flag(argv, "--port") == "9001" and _flag(argv, "--host") == "0.0.0.0"
    assert _flag(argv, "--block-size") == "128"
    assert _flag(argv, "--max-num-batched-tokens") == "1024"
    assert _flag(argv, "--max-num-seqs") == "8" and _flag(argv, "--max-model-len") == "4096"
    assert "--enforce-eager" in argv and argv[-2:] == ["--swap-space", "0"]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--middleware"] == [
        serve_command.FORCING_MIDDLEWARE, *serve_command.MIDDLEWARE]
    ktc = json.loads(_flag(argv, "--kv-transfer-config"))
    assert ktc["kv_connector"] == "AgentServingConnectorV1" and ktc["kv_role"] == "kv_both"
    extra = ktc["kv_connector_extra_config"]
    assert extra["pod_name"] == "p1" and extra["public_host"] == "10.0.0.7"
    assert extra["memory_port_start"] == 7100 and extra["kvindex_url"] == "http://kv:8300"
    assert extra["pod_role"] == "decode" and extra["hash_scheme"] == "lmcache-builtin"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"  # whole GiB, rounded up
    assert env["PYTHONHASHSEED"] == "0"
    assert env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "1.5"
    assert env["LMCACHE_LOCAL_DISK"] == f"file://{tmp_path}/engine-0/"
    assert env["LMCACHE_MAX_LOCAL_DISK_SIZE"] == "3"
    assert "LMCACHE_EXTRA_CONFIG" not in env  # buffered disk I/O: LMCache's default
    direct = _build(disk_cache_dir=tmp_path, disk_cache_gib=3, disk_io="direct").env
    assert json.loads(direct["LMCACHE_EXTRA_CONFIG"]) == {"use_odirect": True}
    assert env["LMCACHE_REMOTE_URL"] == "lm://kv:65000"
    assert env["AGENTSERVING_VLLM_MEMORY_URL"] == "http://127.0.0.1:7100"


def test_the_connector_reads_what_the_command_writes() -> None:
    from agentserving.engine.vllm.settings import parse_settings

    cmd = _build(pod_name="p9", role="prefill", heartbeat_interval_s=2.5)
    extra = json.loads(_flag(cmd.argv, "--kv-transfer-config"))["kv_connector_extra_config"]
    s = parse_settings(extra, {})
    assert (s.pod_name, s.pod_role.value, s.heartbeat_interval_s) == ("p9", "prefill", 2.5)
    assert s.hash_scheme is HashScheme.LMCACHE_BUILTIN
    assert s.layerwise_load is True  # the worker's --kv-layerwise-load default
    off = _build(kv_layerwise_load=False).argv
    off_extra = json.loads(_flag(off, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert off_extra["layerwise_load"] is False
    assert parse_settings(off_extra, {}).layerwise_load is False


def test_plain_vllm_has_no_connector_and_sized_device_kv() -> None:
    cmd = _build(vllm_kv_connector="none", kv_cache_blocks=64, pod_name="p2",
                 kv_events_endpoint="tcp://127.0.0.1:5557")
    assert "--kv-transfer-config" not in cmd.argv
    assert [cmd.argv[i + 1] for i, a in enumerate(cmd.argv) if a == "--middleware"] == [
        serve_command.FORCING_MIDDLEWARE]  # teacher forcing alone
    assert not any(k.startswith("LMCACHE_") for k in cmd.env)
    assert "AGENTSERVING_VLLM_MEMORY_URL" not in cmd.env
    assert _flag(cmd.argv, "--num-gpu-blocks-override") == "64"
    events = json.loads(_flag(cmd.argv, "--kv-events-config"))
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": "tcp://127.0.0.1:5557", "topic": "p2"}
    assert "--scheduler-cls" not in cmd.argv  # fcfs: vLLM's own scheduler


def test_vllms_own_scheduling_runs_with_its_prefix_cache_a_managed_tier() -> None:
    cmd = _build(pod_name="p3")  # scheduler_policy fcfs, the LMCache connector
    assert _flag(cmd.argv, "--scheduler-cls") == serve_command.DEVICE_KV_SCHEDULER_CLS
    assert serve_command.POLICY_ENV not in cmd.env


def test_a_prefill_policy_runs_inside_vllms_scheduler() -> None:
    cmd = _build(scheduler_policy="longcap-dynamic?long_cap=0.5", chunk_align=128)
    assert _flag(cmd.argv, "--scheduler-cls") == serve_command.SCHEDULER_CLS
    assert cmd.env[serve_command.POLICY_ENV] == "longcap-dynamic?long_cap=0.5&chunk_align=128"
    from agentserving.prefill import vllm_plugin

    assert serve_command.POLICY_ENV == vllm_plugin.POLICY_ENV
    from agentserving.engine.vllm import schedulers

    assert serve_command.SCHEDULER_CLS == f"{schedulers.__name__}.PolicyScheduler"
    assert serve_command.DEVICE_KV_SCHEDULER_CLS == f"{schedulers.__name__}.DeviceKvScheduler"


@pytest.mark.parametrize("policy, lookahead", [
    ("shadow", 5), ("longcap-dynamic?lookahead=3&robust=0.5", 3), ("fcfs-chunk?lookahead=2", 2)])
def test_the_shadow_scheduler_runs_inside_vllms_scheduler_too(policy: str,
                                                               lookahead: int) -> None:
    cmd = _build(scheduler_policy=policy)
    assert _flag(cmd.argv, "--scheduler-cls") == serve_command.SCHEDULER_CLS
    assert cmd.env[serve_command.POLICY_ENV] == policy
    from agentserving.prefill import vllm_plugin
    from agentserving.prefill.shadow import ShadowScheduler

    built = vllm_plugin.policy_from_spec(policy)
    assert isinstance(built, ShadowScheduler)
    assert built.lookahead == lookahead


@pytest.mark.parametrize("kwargs, flag", [
    ({"scheduler_policy": "lottery"}, "--scheduler-policy"),
    ({"scheduler_policy": "longcap-dynamic?long_cpa=0.5"}, "--scheduler-policy"),
    ({"scheduler_policy": "shadow?lookahead=0&prefetch_window=2"}, "--scheduler-policy"),
    ({"chunk_align": 128}, "--chunk-align"),
    ({"vllm_kv_connector": "none", "kv_transfer_url": "lm://x:1"}, "--kv-transfer-url"),
    ({"engine_processes": 2}, "--engine-processes"),
    ({"hash_scheme": "blake3"}, "--hash-scheme"),
    ({"kv_block_size": 48, "chunk_size": 96, "prefill_chunk_tokens": 96}, "--kv-block-size"),
    ({"kv_transfer_url": "http://x:1"}, "--kv-transfer-url"),
])
def test_what_vllm_cannot_honour_is_refused_naming_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(serve_command.VllmConfigError, match=flag):
        _build(**kwargs)


def test_the_worker_cli_refuses_before_starting_anything() -> None:
    result = CliRunner().invoke(main, ["worker", "--engine", "vllm", "--engine-processes",
                                       "2"])
    assert result.exit_code == 2 and "--engine-processes" in result.output


def test_a_disk_tier_that_cannot_be_read_with_o_direct_is_refused_naming_the_flag(
        tmp_path: Any) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = CliRunner().invoke(main, ["worker", "--engine", "vllm", "--disk-cache-dir",
                                       str(blocker / "disk"), "--disk-io", "direct"])
    assert result.exit_code == 2 and "--disk-io direct" in result.output
    assert "cannot be read with O_DIRECT" in result.output


def test_the_shared_memory_waits_reach_vllms_processes_only_when_set() -> None:
    def env_of(*flags: str) -> dict[str, str]:
        result = CliRunner().invoke(main, ["worker", "--engine", "vllm", *flags,
                                           "--print-command"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["env"]

    assert shm_waits.NAP_ENV not in env_of()  # the launcher picks the host's default
    env = env_of("--vllm-shm-nap-s", "0.002", "--vllm-shm-recheck-ms", "20")
    assert env[shm_waits.NAP_ENV] == "0.002" and env[shm_waits.RECHECK_ENV] == "20"
    result = CliRunner().invoke(main, ["worker", "--engine", "vllm", "--vllm-shm-recheck-ms",
                                       "0"])
    assert result.exit_code == 2 and "--vllm-shm-recheck-ms" in result.output


def test_hash_scheme_default_follows_the_engine() -> None:
    assert WorkerSettings().hash_scheme is HashScheme.BLAKE3
    assert WorkerSettings(engine="vllm").hash_scheme is HashScheme.LMCACHE_BUILTIN
    assert WorkerSettings(engine="vllm", hash_scheme="lmcache-ascend").hash_scheme is \
        HashScheme.LMCACHE_ASCEND
    with pytest.raises(ValueError, match="vllm-sha256 names vLLM's device blocks"):
        WorkerSettings(hash_scheme="vllm-sha256")  # the proxy's lookup scheme, not a chunk's


def test_tiny_maps_to_the_seeded_model_folder() -> None:
    argv = _build(seed=3).argv
    assert argv[4] == str(MODEL_CACHE / "tiny-seed3")


def test_external_request_id_drops_vllms_random_suffix() -> None:
    assert external_request_id("cmpl-abc123-0-1a2b3c4d") == "cmpl-abc123-0"
    assert external_request_id("chatcmpl-xyz-9f8e7d6c") == "chatcmpl-xyz"
    assert external_request_id("plain") == "plain"
    assert stream_hashes.candidate_ids("cmpl-abc123") == ["cmpl-abc123", "cmpl-abc123-0"]


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + \
        b"data: [DONE]\n\n"


def test_stream_rewrite_adds_kv_params_to_the_finishing_and_usage_events() -> None:
    asked: list[str] = []
    params = {"chunk_hashes": ["1f", "2e"],
              "prompt_sources": {"tokens": {"device": 0, "cpu": 2, "computed": 1}}}

    async def run() -> bytes:
        mw = stream_hashes.ChunkHashesMiddleware(app=None, memory_url="http://unused")  # type: ignore[arg-type]

        async def lookup(rid: str) -> dict[str, Any]:
            asked.append(rid)
            return params

        mw._lookup = lookup  # type: ignore[method-assign]
        state: dict[str, Any] = {"stream": True, "params": None, "asked": False}
        rw = stream_hashes.SseRewriter(lambda e: mw._edit(e, state))
        body = _sse({"id": "c1", "choices": [{"text": "a", "finish_reason": None}]},
                    {"id": "c1", "choices": [{"text": "b", "finish_reason": "length"}]},
                    {"id": "c1", "choices": [], "usage": {"prompt_tokens": 3}})
        # split mid-event, as a socket would
        return await rw.feed(body[:37]) + await rw.feed(body[37:]) + rw.flush()

    out = asyncio.run(run())
    events = [json.loads(line[6:]) for line in out.split(b"\n\n")
              if line.startswith(b"data: {")]
    assert "kv_transfer_params" not in events[0]
    assert events[1]["kv_transfer_params"] == params
    assert events[2]["kv_transfer_params"] == params
    assert asked == ["c1"]  # one lookup per stream
    assert out.endswith(b"data: [DONE]\n\n")


def test_salted_body_carries_the_salt_to_lmcache_and_leaves_others_alone() -> None:
    out = salting.salted_body({"prompt": [1], "cache_salt": "t1",
                               "kv_transfer_params": {"x": 1}})
    assert out["kv_transfer_params"] == {"x": 1, salting.SALT_KEY: "t1"}
    assert salting.salted_body({"prompt": [1]}) is None
    assert salting.salted_body({"prompt": [1], "cache_salt": ""}) is None
    assert salting.salted_body({"cache_salt": "t", "kv_transfer_params": "bad"}) is None
    assert salting.salt_of({salting.SALT_KEY: "t1"}) == "t1"
    assert salting.salt_of(None) is None


def test_salt_middleware_rewrites_the_body_and_its_length() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        msg = await receive()
        seen["body"] = json.loads(msg["body"])
        seen["length"] = dict(scope["headers"])[b"content-length"]

    async def run() -> None:
        raw = json.dumps({"prompt": [1, 2], "cache_salt": "tenant-a"}).encode()
        parts = [{"type": "http.request", "body": raw[:10], "more_body": True},
                 {"type": "http.request", "body": raw[10:], "more_body": False}]

        async def receive() -> dict:
            return parts.pop(0)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"content-length", str(len(raw)).encode())]}
        await salting.CacheSaltMiddleware(app)(scope, receive, None)

    asyncio.run(run())
    assert seen["body"]["kv_transfer_params"] == {salting.SALT_KEY: "tenant-a"}
    assert int(seen["length"]) == len(json.dumps(seen["body"]).encode())


def test_a_prefill_pod_flushes_its_remote_writes() -> None:
    import threading
    import types

    from agentserving.engine.vllm.storage import flush_remote_puts

    pending, barriers = {"chunk-1", "chunk-2"}, []
    remote = types.SimpleNamespace(put_tasks=pending, connection=types.SimpleNamespace(
        exists_sync=lambda key: barriers.append((key, set(pending)))))
    storage = types.SimpleNamespace(storage_backends={"LocalCPUBackend": object(),
                                                      "RemoteBackend": remote})
    assert not flush_remote_puts(storage, "k0", 0.05)  # still writing: gives up at the timeout
    assert barriers == []
    threading.Timer(0.05, pending.clear).start()
    assert flush_remote_puts(storage, "k0", 5.0)
    assert barriers == [("k0", set())]  # the round trip comes after the last write
    assert flush_remote_puts(types.SimpleNamespace(storage_backends={}), "k0", 0.01)


def test_cpu_paged_connector_round_trips_vllm_cpus_layout() -> None:
    """vLLM-CPU's per-layer [blocks, heads, block_size, 2*head_size] (K rows, then V rows, per
    block and head) <-> LMCache's KV_2LTD, by slot; tokens vLLM already holds are left alone."""
    import types

    import torch

    from agentserving.engine.vllm.paged_cpu import VLLMCPUPagedConnector

    layers, heads, head, blocks, bs = 2, 2, 4, 6, 8
    conn = VLLMCPUPagedConnector(layers, heads, head)
    cache = [torch.randn(blocks, heads, bs, 2 * head) for _ in range(layers)]
    slots = torch.tensor([3 * bs + i for i in range(bs)] + [1 * bs + i for i in range(bs)])
    obj = types.SimpleNamespace(tensor=torch.empty(tuple(conn.get_shape(16))))
    conn.from_gpu(obj, 0, 16, kvcaches=cache, slot_mapping=slots)
    k_of = cache[1].view(blocks, heads, 2, bs, head)[3, 1, 0, 5]  # layer 1, token 5, head 1, K
    assert torch.equal(obj.tensor[0, 1, 5].view(heads, head)[1], k_of)
    v_of = cache[0].view(blocks, heads, 2, bs, head)[1, 0, 1, 2]  # layer 0, token 10, head 0, V
    assert torch.equal(obj.tensor[1, 0, 10].view(heads, head)[0], v_of)
    fresh = [torch.zeros_like(c) for c in cache]
    conn.kvcaches = None
    conn.to_gpu(obj, 0, 16, kvcaches=fresh, slot_mapping=slots, vllm_cached_tokens=4)
    for old, new in zip(cache, fresh, strict=True):
        o, n = old.view(blocks, heads, 2, bs, head), new.view(blocks, heads, 2, bs, head)
        assert torch.equal(n[3, :, :, 4:], o[3, :, :, 4:]) and torch.equal(n[1], o[1])
        assert not n[3, :, :, :4].any()  # the 4 tokens vLLM held were not written


def test_prompt_sources_read_from_vllms_counters() -> None:
    from agentserving.engine.vllm.prompt_sources import prompt_tokens_by_source

    text = """# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 593.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="tiny",source="local_compute"} 7.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="t",source="external_kv_transfer"} 2816.0
vllm:prompt_tokens_by_source_created{engine="0",model_name="tiny",source="local_compute"} 1.7e+09
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 9297.0
"""
    assert prompt_tokens_by_source(text) == {"local_compute": 600.0,
                                             "external_kv_transfer": 2816.0}


def test_every_pod_honours_teacher_forcing_plain_ones_included() -> None:
    for connector in ("agentserving", "none"):
        argv = _build(vllm_kv_connector=connector).argv
        assert serve_command.FORCING_MIDDLEWARE in argv
        assert argv[argv.index("--logits-processors") + 1] == serve_command.FORCING_LOGITS
    module, _, cls = serve_command.FORCING_LOGITS.partition(":")
    assert module == "agentserving.engine.vllm.forced_logits" and cls == "ForcedOutputProcessor"


def test_smollm2_maps_to_its_converted_folder_in_fp32() -> None:
    argv = _build(model="smollm2").argv
    assert argv[4] == str(MODEL_CACHE / "smollm2")
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert "--dtype" not in _build(model="/models/other").argv


def test_a_forced_output_becomes_the_logits_processors_argument() -> None:
    body = {"prompt": [1, 2], "forced_output_token_ids": [7, 2, 9], "vllm_xargs": {"k": 1}}
    out = teacher_forcing.forced_body(body, vocab_size=100)
    assert "forced_output_token_ids" not in out  # vLLM would drop it with a warning
    assert out["vllm_xargs"] == {"k": 1, "forced_output_token_ids": [7, 2, 9]}
    assert out["ignore_eos"] is True and out["max_tokens"] == 3
    # a P/D prefill leg asks for one token; more than the forced ids is capped at them
    assert teacher_forcing.forced_body({**body, "max_tokens": 1}, 100)["max_tokens"] == 1
    assert teacher_forcing.forced_body({**body, "max_tokens": 50}, 100)["max_tokens"] == 3
    chat = teacher_forcing.forced_body({"messages": [], "forced_output_token_ids": [5],
                                        "max_completion_tokens": 4}, None)
    assert chat["max_completion_tokens"] == 1 and "max_tokens" not in chat
    assert teacher_forcing.forced_body({"prompt": [1]}, 100) is None


@pytest.mark.parametrize("forced, message", [
    ([3, 100], r"forced_output_token_ids\[1\]: token id 100 is not below the vocabulary"),
    ([3, -1], r"forced_output_token_ids\[1\]: not a token id"),
    ([True], r"forced_output_token_ids\[0\]: not a token id"),
    ([], "forced_output_token_ids: a non-empty list"),
    ("7", "forced_output_token_ids: a non-empty list"),
])
def test_forced_ids_the_model_cannot_emit_are_a_400_naming_the_field(forced: Any,
                                                                       message: str) -> None:
    with pytest.raises(request_body.BodyRejected, match=message) as caught:
        teacher_forcing.forced_body({"prompt": [1], "forced_output_token_ids": forced}, 100)
    assert caught.value.param == "forced_output_token_ids"
    sent: list[dict] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("a rejected body must not reach vLLM")

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> None:
        raw = json.dumps({"prompt": [1], "forced_output_token_ids": forced}).encode()

        async def receive() -> dict:
            return {"type": "http.request", "body": raw, "more_body": False}

        vllm_app = types.SimpleNamespace(state=types.SimpleNamespace(
            vllm_config=types.SimpleNamespace(model_config=types.SimpleNamespace(
                get_vocab_size=lambda: 100))))  # what vLLM's API server holds
        await teacher_forcing.TeacherForcingMiddleware(app)(
            {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "app": vllm_app}, receive, send)

    asyncio.run(run())
    assert sent[0]["status"] == 400
    error = json.loads(sent[1]["body"])["error"]
    assert error["param"] == "forced_output_token_ids" and error["code"] == 400


def test_force_next_leaves_only_the_forced_id_and_never_breaks_a_row() -> None:
    import torch

    row = torch.randn(10)
    out = teacher_forcing.force_next((4, 9), [], row.clone())
    assert int(out.argmax()) == 4 and torch.isinf(out).sum() == 9
    assert int(teacher_forcing.force_next((4, 9), [4], row.clone()).argmax()) == 9
    assert torch.equal(teacher_forcing.force_next((4, 9), [4, 9], row.clone()), row)  # past
    assert torch.equal(teacher_forcing.force_next((40,), [], row.clone()), row)  # no such id


def test_a_cpu_tier_too_small_for_lmcache_to_stage_two_prompts_is_refused() -> None:
    two_mib = 2 << 20  # the tiny model's 256-token chunk
    assert serve_command.dram_floor_error(WorkerSettings(max_model_len=8064), two_mib) is None
    why = serve_command.dram_floor_error(
        WorkerSettings(max_model_len=8064, cpu_cache_gib=0.06), two_mib)
    assert why is not None and "holds 30 KV chunks" in why and "need 64" in why
    assert serve_command.dram_floor_error(WorkerSettings(cpu_cache_gib=0.06), two_mib) is None
    # through the worker's command line, the model's own KV size read from its folder
    from agentserving.engine.model.folders import prepare

    prepare("tiny")
    args = ["worker", "--engine", "vllm", "--max-model-len", "8064", "--print-command"]
    refused = CliRunner().invoke(main, [*args, "--cpu-cache-gib", "0.06"])
    assert refused.exit_code == 2 and "--cpu-cache-gib" in refused.output
    assert "0.125 GiB" in refused.output
    assert CliRunner().invoke(main, [*args, "--cpu-cache-gib", "0.13"]).exit_code == 0
