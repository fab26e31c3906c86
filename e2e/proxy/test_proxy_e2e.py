"""The proxy with the official `openai` SDK, in front of real workers and a real kvindex.

One module-scoped fleet (kvindex, two workers that do both roles, one decode worker); the
tests that break things run last: the kvindex stopped (while both prefill pods live: with one,
the proxy has nothing to look up), then a killed worker.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentserving.core.schemas import TENANT_HEADER
from agentserving.proxy.auth import ApiKeys
from testkit.servers import wait_until as wait_for

TURN_TOKENS = 300


def prompt_for(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 10 for i in range(n)]


@pytest.fixture(scope="module")
def fleet(fleet_factory):
    f = fleet_factory
    f.start_kvindex()
    f.start_worker("w0")
    f.start_worker("w1")
    f.start_worker("d0", role="decode", disk=False)
    kv = f.start_proxy("--prefill", f.workers["w0"].url, "--prefill", f.workers["w1"].url,
                       "--replica-max-lag", "2", name="proxy-kv")
    pd = f.start_proxy(name="proxy-pd")  # discovers all three pods from the kvindex
    f.proxy_kv, f.proxy_pd = kv, pd
    wait_for(lambda: len(kvindex_get(f, "/v1/pods").json()["pods"]) == 3,
             what="three pods registered")
    return f


def client(proxy, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=kw.pop("api_key", "unused"),
                         max_retries=0, timeout=120, **kw)


def turn(c: openai.OpenAI, session: str, prompt: list[int], *, max_tokens: int = 4,
         headers: dict | None = None, extra: dict | None = None):  # type: ignore[no-untyped-def]
    raw = c.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens,
        extra_headers={"x-session-id": session, **(headers or {})},
        extra_body={"forced_output_token_ids": list(range(100, 100 + max_tokens)),
                    **(extra or {})})
    return raw.parse(), raw.headers


def chunk_hashes_of(resp) -> list[str]:  # type: ignore[no-untyped-def]
    return (resp.model_extra or {})["kv_transfer_params"]["chunk_hashes"]


def kvindex_get(fleet, path, tenant=None):  # type: ignore[no-untyped-def]
    scope = {TENANT_HEADER: tenant} if tenant else {}
    return httpx.get(fleet.kvindex.url + path, headers={**fleet.headers, **scope}, timeout=5)


def all_in_tier(fleet, chunks: list[str], pod: str, tier: str) -> bool:  # type: ignore[no-untyped-def]
    return all({"pod": pod, "tier": tier} in kvindex_get(fleet, f"/v1/chunks/{h}").json()[
        "locations"] for h in chunks)


def evict_from_dram(fleet, chunks: list[str]) -> dict:  # type: ignore[no-untyped-def]
    """Drop the chunks' DRAM copies on every pod, keeping them on disk (as an LRU would)."""
    return httpx.post(fleet.kvindex.url + "/v1/evict", headers=fleet.headers, json={
        "chunk_hashes": chunks, "locations": ["cpu"], "force": True}, timeout=5).json()


def test_models_list_through_the_sdk(fleet):
    models = client(fleet.proxy_kv).models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_only_the_deployments_token_opens_the_kvindex_and_memory_apis(fleet):
    """Every component here holds the fleet's internal token: the pods registered and the
    proxies route with the index (the tests below), and a caller without it is turned away."""
    w0 = fleet.workers["w0"]
    for url in (fleet.kvindex.url + "/v1/pods", w0.memory_url + "/memory/chunks",
                w0.engine_memory_url + "/memory/chunks"):
        missing = httpx.get(url, timeout=5)
        assert missing.status_code == 401, (url, missing.text)
        assert missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["param"] == "authorization"
        wrong = httpx.get(url, headers={"authorization": "Bearer not-the-token"}, timeout=5)
        assert wrong.status_code == 403, (url, wrong.text)
        assert httpx.get(url, headers=fleet.headers, timeout=5).status_code == 200, url
    evict = httpx.post(fleet.kvindex.url + "/v1/evict", json={"chunk_hashes": ["0" * 32],
                                                               "force": True}, timeout=5)
    assert evict.status_code == 401
    # probes and scrapes stay open; the OpenAPI document says which routes need the token
    for base in (fleet.kvindex.url, w0.memory_url, w0.engine_memory_url):
        assert httpx.get(base + "/healthz", timeout=5).status_code == 200
    for base in (fleet.kvindex.url, w0.engine_memory_url):  # the worker's own: on w0.url
        assert httpx.get(base + "/metrics", timeout=5).status_code == 200
    doc = httpx.get(fleet.kvindex.url + "/openapi.json", timeout=5).json()
    assert doc["components"]["securitySchemes"]["internalToken"]["scheme"] == "bearer"
    assert "401" in doc["paths"]["/v1/lookup"]["post"]["responses"]
    assert "security" not in doc["paths"]["/healthz"]["get"]


def test_three_turn_session_reuses_its_kv(fleet):
    c = client(fleet.proxy_kv)
    prompt = prompt_for(1, 700)
    pods, cached, hashes = [], [], []
    for k in range(3):
        resp, headers = turn(c, "three-turns", prompt)
        pods.append(headers["x-agentserving-prefill-pod"])
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        hashes.append(chunk_hashes_of(resp))
        assert len(hashes[-1]) == resp.usage.prompt_tokens // 256
        prompt = prompt + list(range(100, 104)) + prompt_for(10 + k, TURN_TOKENS)
    assert cached[0] == 0
    assert cached[1] >= 512 and cached[2] >= cached[1] + 256, cached
    assert len(set(pods)) == 1  # kv-aware: every turn went back to where its KV was
    assert hashes[1][: len(hashes[0])] == hashes[0]  # the chain extends, prefix unchanged
    assert headers["x-agentserving-routing"] == "kv-aware"


def test_streaming_carries_chunk_hashes_and_usage(fleet):
    c = client(fleet.proxy_kv)
    prompt = prompt_for(2, 600)
    turn(c, "stream", prompt)
    events = list(c.completions.create(
        model="tiny", prompt=prompt + prompt_for(3, 100), max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_headers={"x-session-id": "stream"}))
    finals = [e for e in events if (e.model_extra or {}).get("kv_transfer_params")]
    assert finals and len(finals[-1].model_extra["kv_transfer_params"]["chunk_hashes"]) == 2
    usage = [e.usage for e in events if e.usage is not None][-1]
    assert usage.prompt_tokens == 700 and usage.prompt_tokens_details.cached_tokens == 512


def test_prefill_decode_disaggregation_matches_one_pod(fleet):
    prompt = prompt_for(4, 500)
    single = client(fleet.proxy_kv).completions.create(
        model="tiny", prompt=prompt, max_tokens=12, extra_headers={"x-session-id": "pd-1"})
    raw = client(fleet.proxy_pd).completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=12, extra_headers={"x-session-id": "pd-2"})
    split = raw.parse()
    assert raw.headers["x-agentserving-decode-pod"] == "d0"
    assert raw.headers["x-agentserving-prefill-pod"] in ("w0", "w1")
    assert split.choices[0].text == single.choices[0].text
    assert split.usage.completion_tokens == 12
    assert chunk_hashes_of(split) == chunk_hashes_of(single)


def test_short_appends_prefill_on_the_sessions_decode_pod(fleet):
    """Conditional disaggregation: turn 1 goes P/D; a 100-token append runs whole on the decode
    pod that holds the session (its prefix cached there); a 2200-token append (over the
    proxy's default 2048) goes P/D again.
    Every answer matches the same prompt served by one pod."""
    pd, single = client(fleet.proxy_pd), client(fleet.proxy_kv)
    prompt = prompt_for(40, 600)
    paths, cached = [], []
    for k, grow in enumerate((100, 2200)):
        resp, headers = turn(pd, "cond-pd", prompt)
        paths.append((headers["x-agentserving-pd"], headers["x-agentserving-prefill-pod"],
                      headers["x-agentserving-decode-pod"]))
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        ref, _ = turn(single, f"cond-ref-{k}", prompt)
        assert resp.choices[0].text == ref.choices[0].text
        assert chunk_hashes_of(resp) == chunk_hashes_of(ref)
        prompt = prompt + list(range(100, 104)) + prompt_for(41 + k, grow)
    resp, headers = turn(pd, "cond-pd", prompt)
    paths.append((headers["x-agentserving-pd"], headers["x-agentserving-prefill-pod"],
                  headers["x-agentserving-decode-pod"]))
    assert paths[0][0] == "disaggregated" and paths[0][1] in ("w0", "w1")
    assert paths[1] == ("local", "d0", "d0"), paths
    assert paths[2][0] == "disaggregated" and paths[2][1] in ("w0", "w1"), paths
    assert cached[1] == 512  # the decode pod's own copy of turn 1's two full chunks
    metrics = httpx.get(fleet.proxy_pd.url + "/metrics").text
    assert 'stage="local"' in metrics


def test_fork_shares_the_parents_kv(fleet):
    c = client(fleet.proxy_kv)
    base = prompt_for(5, 800)
    parent, headers = turn(c, "parent", base, extra={"agent_memory": {"intent": "root"}})
    wait_for(lambda: kvindex_get(fleet, "/v1/sessions/parent").status_code == 200,
             what="parent session written")
    child, child_headers = turn(c, "child", base + prompt_for(6, 200),
                                headers={"x-parent-session-id": "parent"})
    info = kvindex_get(fleet, "/v1/sessions/child").json()
    assert info["parent"] == "parent" and info["intents"]["root"] == chunk_hashes_of(parent)
    assert child_headers["x-agentserving-prefill-pod"] == headers["x-agentserving-prefill-pod"]
    assert child.usage.prompt_tokens_details.cached_tokens >= 768


def test_memory_hooks_evict_old_topic_and_prefetch_the_next(fleet):
    c = client(fleet.proxy_kv)
    a, _ = turn(c, "mem", prompt_for(7, 520), extra={"agent_memory": {"intent": "topic-a"}})
    topic_a = chunk_hashes_of(a)
    stored = wait_for(lambda: kvindex_get(fleet, "/v1/sessions/mem/intents/topic-a").json(),
                      what="intent write-back")
    assert stored["chunk_hashes"] == topic_a
    wait_for(lambda: kvindex_get(fleet, f"/v1/chunks/{topic_a[0]}").json()["locations"],
             what="topic-a resident")

    b, headers = turn(c, "mem", prompt_for(8, 520), extra={
        "agent_memory": {"intent": "topic-b", "evict_intents": ["topic-a"]}})
    topic_b = chunk_hashes_of(b)
    pod = headers["x-agentserving-prefill-pod"]
    # the old topic's chunks leave every tier of every pod
    wait_for(lambda: not kvindex_get(fleet, f"/v1/chunks/{topic_a[0]}").json()["locations"],
             what="topic-a evicted")

    # drop topic-b's DRAM copies, keep them on disk; a prefetch hook brings them back
    wait_for(lambda: all_in_tier(fleet, topic_b[:1], pod, "disk"), what="topic-b on disk")
    assert evict_from_dram(fleet, topic_b)["results"][pod]["ok"]
    wait_for(lambda: kvindex_get(fleet, f"/v1/chunks/{topic_b[0]}").json()["locations"] == [
        {"pod": pod, "tier": "disk"}], what="topic-b only on disk")
    turn(c, "mem", prompt_for(9, 300), extra={"agent_memory": {"prefetch_intents": ["topic-b"]}})
    wait_for(lambda: all_in_tier(fleet, topic_b[:1], pod, "cpu"), what="topic-b prefetched")
    metrics = httpx.get(fleet.proxy_kv.url + "/metrics").text
    assert 'proxy_memory_hook_calls_total{ok="true",op="evict"}' in metrics
    assert 'proxy_memory_hook_calls_total{ok="true",op="prefetch"}' in metrics


def test_tool_gap_prefetch_is_warm_on_arrival(fleet):
    c = client(fleet.proxy_kv)
    prompt = prompt_for(11, 520)
    chunks_found = "proxy_tool_gap_prefetch_chunks_total"
    for attempt in range(3):  # a loaded host may evict after the prefetch fired: once more
        session, started = f"tools-{attempt}", time.monotonic()
        on_disk_before = metric(fleet.proxy_kv, chunks_found, found="disk")
        first, headers = turn(c, session, prompt, headers={"x-agentserving-next-tool": "bash"})
        chunks, pod = chunk_hashes_of(first)[:2], headers["x-agentserving-prefill-pod"]
        # the session's KV leaves DRAM during the tool call, as a busy pod's LRU would take it
        wait_for(functools.partial(all_in_tier, fleet, chunks, pod, "disk"), what="on disk")
        evict_from_dram(fleet, chunks)
        evicted_in_time = time.monotonic() - started < 1.3
        # the default prediction is 2 s; the prefetch fires 0.5 s before and reads them back
        time.sleep(max(0.0, 2.2 - (time.monotonic() - started)))
        resp, announced = turn(c, session, prompt + list(range(100, 104)) + prompt_for(12, 50))
        assert resp.usage.prompt_tokens_details.cached_tokens >= 512
        if evicted_in_time:
            break
    else:
        pytest.fail("the host never evicted within 1.3 s of a turn")
    assert metric(fleet.proxy_kv, chunks_found, found="disk") - on_disk_before == 2
    # the turn says where its KV was when it was announced: on disk, both chunks
    assert announced["x-agentserving-kv-at-announce"] == "disk=2"
    wait_for(lambda: all_in_tier(fleet, chunks, pod, "cpu"), what="back in DRAM")
    assert metric(fleet.proxy_kv, "proxy_tool_gap_prefetch_total", outcome="warm") == attempt + 1
    assert metric(fleet.proxy_kv, "proxy_tool_gap_prediction_error_seconds_count") == attempt + 1
    # --no-tool-prefetch: the same tool call, and no turn announced during it
    off = fleet.start_proxy("--prefill", fleet.workers["w0"].url, "--no-tool-prefetch",
                            name="proxy-no-tool-prefetch")
    c = client(off)
    turn(c, "tools-off", prompt, headers={"x-agentserving-next-tool": "bash"})
    time.sleep(2.2)
    _, unannounced = turn(c, "tools-off", prompt + list(range(100, 104)) + prompt_for(12, 50))
    assert "x-agentserving-kv-at-announce" not in unannounced
    metrics = httpx.get(off.url + "/metrics").text
    assert 'proxy_tool_gap_prefetch_total{outcome="warm"}' not in metrics
    assert 'proxy_memory_hook_calls_total{ok="true",op="tool_prefetch"}' not in metrics
    # --announce-hold: the pod also holds what the announce found until the turn is due
    held = fleet.start_proxy("--prefill", fleet.workers["w0"].url, "--announce-hold", "10",
                             name="proxy-announce-hold")
    c = client(held)
    turn(c, "tools-held", prompt, headers={"x-agentserving-next-tool": "bash"})
    time.sleep(2.2)
    _, announced = turn(c, "tools-held", prompt + list(range(100, 104)) + prompt_for(12, 50))
    assert announced["x-agentserving-kv-at-announce"] == "dram=2,held=2"
    assert metric(held, chunks_found, found="held") == 2


def _turn_behind_a_long_one(fleet, flag: str, seed: int):  # type: ignore[no-untyped-def]
    """Through a proxy admitting one turn at a time over w1: a session's turn, its KV then
    left on disk only (as a busy pod's LRU leaves it), and its next turn sent while a long
    turn holds the only place (longer until the next turn had to wait). Returns the proxy,
    the waiting turn's answer, and the session's chunks and pod."""
    proxy = fleet.start_proxy("--prefill", fleet.workers["w1"].url, "--admit-per-pod", "1",
                              "--announce-hold", "10", flag,
                              name=f"proxy-admission{flag.removeprefix('-')}")
    c, prompt = client(proxy), prompt_for(seed, 520)
    first, headers = turn(c, f"queued{flag}", prompt)
    chunks, pod = chunk_hashes_of(first)[:2], headers["x-agentserving-prefill-pod"]
    free = functools.partial(metric, proxy, "proxy_admission_wait_seconds_count", how="free")
    for output_tokens in (300, 1200, 4000):
        wait_for(functools.partial(all_in_tier, fleet, chunks, pod, "disk"), what="on disk")
        evict_from_dram(fleet, chunks)
        wait_for(lambda: not any(all_in_tier(fleet, [h], pod, "cpu") for h in chunks),
                 what="out of DRAM")
        admitted = free()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(turn, c, f"busy{flag}{output_tokens}", prompt_for(40, 300),
                               max_tokens=output_tokens)
            wait_for(lambda: free() > admitted, what="the long turn admitted")  # noqa: B023
            resp, queued = turn(c, f"queued{flag}", prompt + prompt_for(12, 50))
            busy.result()
        if queued["x-agentserving-admission"].startswith("shortest"):
            return proxy, resp, chunks, pod
    pytest.fail("the session's turn never waited behind a 4,000-token answer")


def test_a_turn_waiting_for_admission_has_its_kv_read_and_held_meanwhile(fleet):
    """--admit-per-pod 1 over one pod: a session's turn that waits for its place has its pod
    read the session's KV back into DRAM meanwhile, and hold it there; the turn then reuses
    it. --no-queued-prefetch: the same wait reads nothing."""
    found = "proxy_queued_prefetch_chunks_total"
    proxy, resp, chunks, pod = _turn_behind_a_long_one(fleet, "--queued-prefetch", 31)
    assert metric(proxy, found, found="disk") == metric(proxy, found, found="held") == 2
    assert resp.usage.prompt_tokens_details.cached_tokens >= 512
    wait_for(lambda: all_in_tier(fleet, chunks, pod, "cpu"), what="back in DRAM")
    proxy.kill()
    off, *_ = _turn_behind_a_long_one(fleet, "--no-queued-prefetch", 32)
    assert metric(off, found, found="disk") == metric(off, found, found="held") == 0
    assert 'op="queued_prefetch"' not in httpx.get(off.url + "/metrics").text
    off.kill()


def test_proxy_replicas_share_each_sessions_routing(fleet):
    """A session's turns spread round-robin over three proxies with
    --shared-sessions route turn for turn as one proxy routes them (P/D first, short appends
    whole on the session's decode pod, a long append P/D again) with the same prefix hits, and
    a proxy killed mid-session and started afresh routes its next turn as the others would.
    The control: two plain proxies, whose second never saw the session, send the first short
    append P/D (the very decision the shared record keeps)."""
    shared = [fleet.start_proxy("--shared-sessions", name=f"proxy-shared-{i}")
              for i in range(3)]
    plain = [fleet.start_proxy(name=f"proxy-plain-{i}") for i in range(2)]

    def run(proxies, sid: str, seed: int, restart_before: int | None = None):  # type: ignore[no-untyped-def]
        prompt, out = prompt_for(seed, 600), []
        for k, grow in enumerate((100, 100, 2200, 100, None)):
            if k == restart_before:  # the replica that serves turn k dies and comes back
                i = k % len(proxies)
                proxies[i].kill()
                proxies[i] = fleet.start_proxy("--shared-sessions", name=f"proxy-shared-r{i}")
            resp, headers = turn(client(proxies[k % len(proxies)]), sid, prompt)
            out.append((headers["x-agentserving-pd"], headers["x-agentserving-decode-pod"],
                        resp.usage.prompt_tokens_details.cached_tokens))
            if grow is not None:
                prompt = prompt + list(range(100, 104)) + prompt_for(seed + 1 + k, grow)
        return out

    one = run([fleet.proxy_pd], "one-proxy", 90)
    assert [pd for pd, _, _ in one] == ["disaggregated", "local", "local", "disaggregated",
                                        "local"], one
    assert run(shared, "three-proxies", 100, restart_before=4) == one
    metrics = httpx.get(shared[1].url + "/metrics", timeout=5).text
    assert 'proxy_shared_session_records_total{op="read",result="adopted"}' in metrics
    control = run(plain, "two-plain-proxies", 110)
    assert control[1][0] == "disaggregated" and control != one, control


def test_agent_apis_continue_across_proxy_replicas_on_pd(fleet):
    """A Responses chain started through one proxy replica continues through another (the
    conversation in the kvindex's store) on the session's decode pod, its prompt reused; an
    Anthropic Messages turn with teacher forcing runs P/D and answers the forced tokens."""
    other = fleet.start_proxy(name="proxy-responses-b")
    forced = {"forced_output_token_ids": [100, 101, 102, 103]}
    question = " ".join(f"word{i}" for i in range(600))
    first = client(fleet.proxy_pd).responses.with_raw_response.create(
        model="tiny", input=question, max_output_tokens=4, extra_body=forced)
    first_headers, first = first.headers, first.parse()
    assert first_headers["x-agentserving-pd"] == "disaggregated"
    follow = client(other).responses.with_raw_response.create(
        model="tiny", input="and then " * 20, max_output_tokens=4, extra_body=forced,
        previous_response_id=first.id)
    headers, follow = follow.headers, follow.parse()
    assert headers["x-agentserving-session-source"] == "previous_response_id"
    assert headers["x-agentserving-decode-pod"] == first_headers["x-agentserving-decode-pod"]
    assert follow.usage.input_tokens_details.cached_tokens >= 256, follow.usage
    r = httpx.post(fleet.proxy_pd.url + "/v1/messages", timeout=120, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": question}],
        "metadata": {"user_id": "anthropic-pd"}, **forced})
    assert r.status_code == 200, r.text
    assert r.headers["x-agentserving-pd"] == "disaggregated"
    chat = client(fleet.proxy_pd).chat.completions.create(
        model="tiny", max_tokens=4, messages=[{"role": "user", "content": question}],
        extra_body=forced)
    assert r.json()["content"][0]["text"] == chat.choices[0].message.content
    other.kill()


def metric(proc, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    """One sample of a service's /metrics (0 when absent)."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
                   if labels else "")
    for line in httpx.get(proc.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def tenant_prompt_tokens(proc) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """A worker's prompt tokens by tenant label."""
    text = httpx.get(proc.url + "/metrics", timeout=5).text
    return {s.labels["tenant"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "agentserving_worker_prompt_tokens_total"}


def subtract(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """The labels that grew, by how much."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def test_kv_aware_routing_reads_the_in_process_replica(fleet):
    """With two prefill pods every turn of a session is looked up, and the proxy's
    residency replica answers: the kvindex serves no lookup, and the session still goes
    where its KV is (each append reuses all but its new suffix)."""
    c = client(fleet.proxy_kv)
    before = metric(fleet.kvindex, "kvindex_lookups_total", result="hit")
    before += metric(fleet.kvindex, "kvindex_lookups_total", result="miss")
    replica_before = metric(fleet.proxy_kv, "proxy_kv_lookups_total", source="replica")
    prompt, pods, previous = prompt_for(17, 700), [], 0
    for k in range(4):
        resp, headers = turn(c, "replica", prompt)
        pods.append(headers["x-agentserving-prefill-pod"])
        # every whole chunk (256 tokens) of the previous turn's prompt was cached where it went
        assert resp.usage.prompt_tokens_details.cached_tokens >= previous // 256 * 256, k
        previous = len(prompt)
        prompt = prompt + list(range(100, 104)) + prompt_for(40 + k, 200)
        time.sleep(0.3)  # the turn's residency reaches the kvindex, then its feed
    assert len(set(pods)) == 1, pods
    assert metric(fleet.proxy_kv, "proxy_kv_lookups_total", source="replica") \
        >= replica_before + 3
    after = metric(fleet.kvindex, "kvindex_lookups_total", result="hit")
    after += metric(fleet.kvindex, "kvindex_lookups_total", result="miss")
    assert after == before
    assert metric(fleet.proxy_kv, "proxy_residency_replica_chunks") > 0


def test_tenants_never_share_prefixes(fleet, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-tenant-a-0001", "tenant": "a"},
                                         {"key": "sk-tenant-b-0001", "tenant": "b"}]}))
    proxy = fleet.start_proxy("--prefill", fleet.workers["w0"].url, "--api-keys", str(keys),
                              name="proxy-auth")
    prompt = prompt_for(13, 520)
    w0_prompt_tokens = tenant_prompt_tokens(fleet.workers["w0"])
    ra, _ = turn(client(proxy, api_key="sk-tenant-a-0001"), "t", prompt,
                 extra={"agent_memory": {"intent": "plan"}})
    after_a = tenant_prompt_tokens(fleet.workers["w0"])
    wait_for(lambda: kvindex_get(fleet, "/v1/sessions/t", "a").status_code == 200,
             what="a's intent written back")

    def w0_holds(chunk: str) -> bool:  # the pod's own tiers, not the index's lagging view
        held = httpx.get(fleet.workers["w0"].memory_url + "/memory/chunks",
                         headers=fleet.headers, timeout=5).json()["chunks"]
        return any(chunk in chunks for chunks in held.values())

    wait_for(lambda: w0_holds(chunk_hashes_of(ra)[0]), what="a's chunks stored on w0")
    # b names a's session id and asks to evict its "plan" and close it: b's memory verbs act
    # on b's own session "t" (the kvindex scopes sessions by tenant), never on a's
    before_b = tenant_prompt_tokens(fleet.workers["w0"])
    rb, _ = turn(client(proxy, api_key="sk-tenant-b-0001"), "t", prompt,
                 extra={"agent_memory": {"evict_intents": ["plan"], "intent": "plan",
                                         "close_session": True}})
    after_b = tenant_prompt_tokens(fleet.workers["w0"])
    assert set(chunk_hashes_of(ra)).isdisjoint(chunk_hashes_of(rb))
    assert rb.usage.prompt_tokens_details.cached_tokens == 0  # a's KV is invisible to b
    closed = 'proxy_memory_hook_calls_total{ok="true",op="close"} 1.0'
    wait_for(lambda: closed in httpx.get(proxy.url + "/metrics", timeout=5).text,
             what="b's verbs carried out")
    assert kvindex_get(fleet, "/v1/sessions/t", "b").status_code == 404  # b's own, closed
    assert kvindex_get(fleet, "/v1/sessions/t", "a").json()["intents"] == {
        "plan": chunk_hashes_of(ra), "~context": chunk_hashes_of(ra)}
    assert w0_holds(chunk_hashes_of(ra)[0])  # b's evict of "plan" and its close took b's own

    # a caller that reaches the pod itself cannot probe a's prefixes by guessing a's salt:
    # the old default, 'tenant:<name>', found them; the proxy's own salt for a still does
    def probe(salt: str) -> int:
        r = httpx.post(fleet.workers["w0"].url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 1, "cache_salt": salt})
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert probe("tenant:a") == 0
    real = ApiKeys.load(keys).authenticate("Bearer sk-tenant-a-0001").cache_salt
    assert probe(real) >= 512
    # the proxy tells the pod whose turn it runs: w0's reuse metrics are per tenant by name,
    # each turn's prompt under its own tenant and no other's
    assert subtract(after_a, w0_prompt_tokens) == {"a": len(prompt)}, (w0_prompt_tokens, after_a)
    assert subtract(after_b, before_b) == {"b": len(prompt)}, (before_b, after_b)
    with pytest.raises(openai.AuthenticationError):
        client(proxy, api_key="sk-wrong-key-000").models.list()


def test_bad_requests_name_the_field(fleet):
    c = client(fleet.proxy_kv)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2,
                             extra_body={"agent_memory": {"evict_intents": "not-a-list"}})
    assert err.value.body["param"] == "agent_memory.evict_intents"
    r = httpx.post(fleet.proxy_kv.url + "/v1/completions", content=b"{oops",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


def test_a_clients_own_hand_off_parameters_never_reach_a_pod(fleet):
    # a pod given these would pull KV from wherever they point: the proxy alone sets them
    r = httpx.post(fleet.proxy_kv.url + "/v1/completions", timeout=60,
                   headers={"x-session-id": "hand-off-forger"},
                   json={"model": "tiny", "prompt": prompt_for(41, 300), "max_tokens": 2,
                         "kv_transfer_params": {"do_remote_prefill": True,
                                                "remote_host": "10.0.0.9"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    assert "proxy's to set" in r.json()["error"]["message"]  # the proxy's answer, not a pod's
    schema = httpx.get(fleet.proxy_kv.url + "/openapi.json", timeout=10).json()
    assert "kv_transfer_params" not in schema["components"]["schemas"]["CompletionTurn"][
        "properties"]


def test_kvindex_stopped_turns_still_answer_degraded(fleet):
    """While its residency replica is fresh the proxy routes as before; once it is stale
    (--replica-max-lag 2) it asks the kvindex, finds it gone and routes by affinity."""
    c = client(fleet.proxy_kv)
    prompt = prompt_for(16, 600)
    turn(c, "degraded", prompt)
    fleet.kvindex.kill()
    wait_for(lambda: metric(fleet.proxy_kv, "proxy_residency_replica_staleness_seconds") > 2,
             what="the replica to go stale")
    resp, headers = turn(c, "degraded", prompt + list(range(100, 104)))
    assert resp.usage.completion_tokens == 4
    assert "kvindex-unavailable" in headers["x-agentserving-degraded"]
    assert "proxy_degraded_total 1.0" in httpx.get(fleet.proxy_kv.url + "/metrics").text


def test_a_prefill_pool_that_is_down_costs_the_speed_up_not_the_turn(fleet):
    """Every prefill pod unreachable (a rolling or restarting pool): after the P/D attempts,
    the decode pod computes the whole turn, with the answer one pod gives."""
    from testkit.servers import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    proxy = fleet.start_proxy("--prefill", dead, "--decode", fleet.workers["d0"].url,
                              name="proxy-no-prefill")
    prompt = prompt_for(16, 500)
    raw = client(proxy).completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=12, extra_headers={"x-session-id": "np-1"})
    alone = client(fleet.proxy_kv).completions.create(
        model="tiny", prompt=prompt, max_tokens=12, extra_headers={"x-session-id": "np-2"})
    resp = raw.parse()
    assert resp.choices[0].text == alone.choices[0].text
    assert chunk_hashes_of(resp) == chunk_hashes_of(alone)
    assert "proxy_retries_total" in httpx.get(proxy.url + "/metrics").text


def test_a_killed_worker_mid_session_still_answers(fleet):
    c = client(fleet.proxy_kv)
    prompt = prompt_for(14, 600)
    _, headers = turn(c, "survivor", prompt)
    victim = headers["x-agentserving-prefill-pod"]
    fleet.workers[victim].kill()
    resp, headers = turn(c, "survivor", prompt + list(range(100, 104)) + prompt_for(15, 100))
    assert headers["x-agentserving-prefill-pod"] != victim
    assert resp.usage.completion_tokens == 4
    assert "proxy_retries_total" in httpx.get(fleet.proxy_kv.url + "/metrics").text
