"""Prefill -> decode hand-off between two real workers, as vLLM's disaggregated proxy drives
it: the decode output equals a single-pod run; unclaimed pins expire; pulls that cannot be
served are recomputed; a dead engine process takes its worker down."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from testkit.worker import metric_value, prompt, worker_process


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    with worker_process(tmp, "--role", "prefill", "--kv-transfer-timeout", "1.5",
                        "--residency-interval", "0.1", name="prefill-0") as p, \
            worker_process(tmp, "--role", "decode", "--residency-interval", "0.1",
                           name="decode-0") as d:
        yield p, d


def _disaggregated(p, d, body, stream=False):
    first = p.complete(**{**body, "max_tokens": 1, "stream": False,
                          "kv_transfer_params": {"do_remote_decode": True}})
    params = first["kv_transfer_params"]
    if stream:
        return first, d.stream("/v1/completions", **{**body, "kv_transfer_params": params})
    return first, d.complete(**{**body, "kv_transfer_params": params})


def test_decode_output_equals_single_pod_run(pods):
    p, d = pods
    ids = prompt(650, seed=200)  # 2 full chunks + a partial one, all handed over
    body = {"prompt": ids, "max_tokens": 8, "logprobs": 2, "return_token_ids": True}
    single = p.complete(**body)
    first, out = _disaggregated(p, d, body)
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == p.memory_port + 1 and len(params["transfer_id"]) == 32
    assert params["num_tokens"] == 650 and len(params["chunk_hashes"]) == 2
    assert first["choices"][0]["token_ids"] == single["choices"][0]["token_ids"][:1]
    a, b = single["choices"][0], out["choices"][0]
    assert b["token_ids"] == a["token_ids"] and b["text"] == a["text"]
    assert b["logprobs"]["token_logprobs"] == a["logprobs"]["token_logprobs"]
    usage = out["usage"]["prompt_tokens_details"]
    assert usage == {"cached_tokens": 650, "cached_tokens_by_tier": {"remote": 650}}
    kvp = out["kv_transfer_params"]
    assert kvp["chunk_hashes"] == params["chunk_hashes"] and kvp["kv_source"] == "remote"
    assert kvp["transfer_bytes"] >= 650 * 8192  # fp32 K+V of 4 layers x 256 dims per token
    sent = metric_value(p.metrics(), "agentserving_worker_transfer_bytes_total",
                        'direction="sent"')
    time.sleep(0.3)  # stats flush
    received = metric_value(d.metrics(), "agentserving_worker_transfer_bytes_total",
                            'direction="received"')
    assert received >= kvp["transfer_bytes"] and sent >= 0


def test_streamed_decode_equals_single_pod(pods):
    p, d = pods
    ids = prompt(400, seed=201)
    body = {"prompt": ids, "max_tokens": 5}
    single = p.complete(**body)
    _, events = _disaggregated(p, d, body, stream=True)
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text == single["choices"][0]["text"]
    assert events[-2]["kv_transfer_params"]["kv_source"] == "remote"


def _wait_resident(worker, chunk_hashes, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        held = set(httpx.get(worker.memory_url + "/memory/chunks", timeout=10)
                   .json()["chunks"].get("cpu", []))
        if set(chunk_hashes) <= held:
            return
        assert time.monotonic() < deadline, "the decode pod never kept the pulled chunks"
        time.sleep(0.1)


def test_next_turn_pulls_only_the_new_suffix_and_equals_single_pod(pods):
    p, d = pods
    turn1 = prompt(650, seed=210)  # 2 full chunks + a partial one
    body1 = {"prompt": turn1, "max_tokens": 6, "return_token_ids": True}
    _, out1 = _disaggregated(p, d, body1)
    full1 = out1["kv_transfer_params"]["transfer_bytes"]
    assert out1["kv_transfer_params"]["transfer_start_token"] == 0
    kept = out1["kv_transfer_params"]["chunk_hashes"]
    assert len(kept) == 2
    _wait_resident(d, kept)  # the decode pod stored what it pulled, in its own DRAM tier
    time.sleep(0.3)  # stats flush
    skipped_before = metric_value(p.metrics(), "agentserving_worker_transfer_reused_tokens_total",
                                  'side="prefill"')
    local_before = metric_value(d.metrics(), "agentserving_worker_transfer_reused_tokens_total",
                                'side="decode"')

    # turn 2: the whole history plus a tool result, as an agent sends it
    turn2 = turn1 + out1["choices"][0]["token_ids"] + prompt(300, seed=211)  # 956 tokens
    body2 = {"prompt": turn2, "max_tokens": 8, "logprobs": 2, "return_token_ids": True}
    single = p.complete(**body2)
    first, out2 = _disaggregated(p, d, body2)
    a, b = single["choices"][0], out2["choices"][0]
    assert b["token_ids"] == a["token_ids"] and b["text"] == a["text"]
    assert b["logprobs"]["token_logprobs"] == a["logprobs"]["token_logprobs"]
    assert b["logprobs"]["top_logprobs"] == a["logprobs"]["top_logprobs"]
    kvp = out2["kv_transfer_params"]
    assert kvp["kv_source"] == "remote" and kvp["transfer_start_token"] == 512
    assert kvp["chunk_hashes"][:2] == kept
    # only tokens 512..955 crossed the wire: 444 of 956 (fp32 K+V, 4 layers x 256 dims)
    per_token = full1 / 650
    assert 444 * 8192 <= kvp["transfer_bytes"] < 460 * per_token
    assert kvp["transfer_bytes"] < full1
    usage = out2["usage"]["prompt_tokens_details"]
    assert usage == {"cached_tokens": 956,
                     "cached_tokens_by_tier": {"cpu": 512, "remote": 444}}
    time.sleep(0.3)  # stats flush
    assert metric_value(p.metrics(), "agentserving_worker_transfer_reused_tokens_total",
                        'side="prefill"') == skipped_before + 512
    assert metric_value(d.metrics(), "agentserving_worker_transfer_reused_tokens_total",
                        'side="decode"') == local_before + 512
    # and the new third chunk is kept for the turn after
    _wait_resident(d, kvp["chunk_hashes"])


def test_a_turn_done_on_its_first_token_still_keeps_the_pulled_kv(pods):
    """A one-token answer never runs a forward pass on the decode pod; its pulled KV is kept
    all the same, so the session's next turn finds it there (the proxy may send that turn to
    this pod alone)."""
    p, d = pods
    ids = prompt(700, seed=220)
    _, out = _disaggregated(p, d, {"prompt": ids, "max_tokens": 1})
    assert out["usage"]["completion_tokens"] == 1
    _wait_resident(d, out["kv_transfer_params"]["chunk_hashes"])
    again = d.complete(prompt=ids + prompt(50, seed=221), max_tokens=2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 512


def test_unclaimed_pin_expires_and_decode_recomputes(pods):
    p, d = pods
    ids = prompt(500, seed=202)
    body = {"prompt": ids, "max_tokens": 4, "logprobs": 1}
    single = d.complete(**body)  # the decode pod's own single-pod answer, from scratch
    first = p.complete(**{**body, "max_tokens": 1,
                          "kv_transfer_params": {"do_remote_decode": True}})
    deadline = time.monotonic() + 10
    while metric_value(p.metrics(), "agentserving_worker_handoffs_total",
                       'outcome="expired"') < 1:
        assert time.monotonic() < deadline, "pinned KV never released"
        time.sleep(0.2)
    r = httpx.get(f"http://127.0.0.1:{first['kv_transfer_params']['remote_port']}/v1/kv/"
                  f"{first['kv_transfer_params']['transfer_id']}")
    assert r.status_code == 404
    out = d.complete(**{**body, "kv_transfer_params": first["kv_transfer_params"]})
    assert out["choices"][0]["text"] == single["choices"][0]["text"]
    assert out["choices"][0]["logprobs"]["token_logprobs"] == \
        single["choices"][0]["logprobs"]["token_logprobs"]
    assert "remote" not in out["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
    time.sleep(0.3)
    assert metric_value(d.metrics(), "agentserving_worker_transfer_failures_total") >= 1


def test_roles_refuse_the_wrong_half(pods):
    p, d = pods
    r = httpx.post(d.url + "/v1/completions", json={
        "prompt": "x", "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    r = httpx.post(p.url + "/v1/completions", json={
        "prompt": "x", "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "h",
                                              "remote_port": 1, "transfer_id": "t"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"


def test_a_dead_engine_process_takes_the_worker_down(tmp_path):
    with worker_process(tmp_path, name="doomed") as w:
        engines = [c for c in psutil.Process(w.proc.pid).children(recursive=True)
                   if "engine_process" in " ".join(c.cmdline())]
        assert len(engines) == 1
        os.kill(engines[0].pid, signal.SIGKILL)
        assert w.proc.wait(timeout=30) == 1
        assert not psutil.pid_exists(engines[0].pid) or \
            psutil.Process(engines[0].pid).status() == psutil.STATUS_ZOMBIE
