"""`agentserving worker` as real processes (an API process + two engine processes) beside a
real kvindex: the OpenAI API, KV reuse across turns and tiers over HTTP, the memory API with
its forwarding, residency in the kvindex through an outage, metrics."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from agentserving.core.hashing import ChunkHasher
from testkit.servers import AGENTSERVING, free_port, service_process, wait_until
from testkit.worker import metric_sum, metric_value, prompt, worker_process

MAX_LEN = 2048


class Kvindex:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tmp
        self._stack: contextlib.ExitStack | None = None
        self.runs = 0

    def start(self) -> None:
        self._stack = contextlib.ExitStack()
        self.runs += 1
        self._stack.enter_context(service_process(
            [AGENTSERVING, "kvindex", "--port", str(self.port), "--store", "memory",
             "--lease-ttl", "10"], self.url + "/healthz",
            log_path=self.tmp / f"kvindex{self.runs}.log"))

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def locations(self, h: str) -> set[tuple[str, str]]:
        r = httpx.get(f"{self.url}/v1/chunks/{h}", timeout=5)
        return {(loc["pod"], loc["tier"]) for loc in r.json()["locations"]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("worker")
    kv = Kvindex(tmp)
    kv.start()
    try:
        with worker_process(tmp, "--engine-processes", "2", "--max-model-len", str(MAX_LEN),
                            "--disk-cache-dir", str(tmp / "kv"), "--disk-cache-gib", "0.5",
                            "--kvindex", kv.url, "--heartbeat-interval", "0.3",
                            "--event-flush-interval", "0.05", "--residency-interval", "0.05",
                            "--step-log-dir", str(tmp / "steps"), name="w-http") as w:
            yield w, kv
    finally:
        kv.stop()


def steps_logged(w) -> list[dict]:
    import json

    return [json.loads(line) for f in sorted((w.log_path.parent / "steps").glob("w-http-*.jsonl"))
            for line in f.read_text().splitlines()]


def test_help_explains_every_flag():
    out = subprocess.run([AGENTSERVING, "worker", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--role", "--port", "--memory-port-start", "--model", "--pod-name",
                 "--kvindex", "--cpu-cache-gib", "--disk-cache-dir", "--disk-cache-gib",
                 "--chunk-size", "--hash-scheme", "--engine-processes", "--prefill-chunk-tokens",
                 "--kv-transfer-timeout", "--scheduler-policy"):
        assert flag in out, flag
    assert "AGENTSERVING_WORKER_DISK_CACHE_DIR" in out


def test_models_health_ready(stack):
    w, _ = stack
    assert httpx.get(w.url + "/healthz").status_code == 200
    assert httpx.get(w.url + "/readyz").json()["engines"] == 2
    model = httpx.get(w.url + "/v1/models").json()["data"][0]
    assert model["id"] == "tiny" and model["max_model_len"] == MAX_LEN
    assert len(model["weights_digest"]) == 32


def test_second_turn_reuses_kv_with_identical_output(stack):
    w, kv = stack
    ids = prompt(700, seed=100)
    body = {"prompt": ids, "max_tokens": 5, "logprobs": 3, "return_token_ids": True}
    cold = w.complete(**body)
    hashes = ChunkHasher("blake3", 256).hashes(ids)
    assert cold["kv_transfer_params"]["chunk_hashes"] == hashes
    assert cold["usage"]["prompt_tokens"] == 700 and cold["usage"]["completion_tokens"] == 5
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    warm = w.complete(**body)
    details = warm["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] == 512 and details["cached_tokens_by_tier"] == {"cpu": 512}
    a, b = cold["choices"][0], warm["choices"][0]
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"]  # exact floats
    assert a["logprobs"]["top_logprobs"] == b["logprobs"]["top_logprobs"]
    # the same turn as text: byte tokens, its own chunk chain
    text = w.complete(prompt="hello " * 100, max_tokens=3)
    assert len(text["kv_transfer_params"]["chunk_hashes"]) == 2
    # --step-log-dir: each engine step's shape and time, as the simulator's check-steps reads
    # them (a step is written just after its outputs are sent): the cold turn prefilled 700
    # tokens in 512-token chunks, the warm one only the 188 after its cached 512; each
    # decode of their 4 later tokens read the prompt and the tokens before it
    def contexts() -> set[int]:
        return {s["decode_context"] for s in steps_logged(w) if s["decode_tokens"] == 1}
    wait_until(lambda: {701, 702, 703, 704} <= contexts(), what="the decodes' step records")
    steps = steps_logged(w)
    chunks = [tuple(c) for s in steps for c in s["chunks"]]
    # ... and the text turn's 601 tokens in two chunks
    assert sorted(chunks) == sorted([(0, 512), (512, 188), (512, 188), (0, 512), (512, 89)])
    assert all(s["cpu_s"] > 0 and s["forward_s"] > 0 for s in steps)


def test_reuse_from_disk_via_memory_api_is_identical(stack):
    w, _ = stack
    ids = prompt(900, seed=101)
    body = {"prompt": ids, "max_tokens": 4, "logprobs": 1}
    cold = w.complete(**body)
    hashes = cold["kv_transfer_params"]["chunk_hashes"]
    wait_until(lambda: len(httpx.get(w.memory_url + "/memory/chunks").json()["chunks"]
                         .get("disk", [])) >= 3 and all(
        h in httpx.get(w.memory_url + "/memory/chunks").json()["chunks"]["disk"]
        for h in hashes), what="disk writes")
    r = httpx.post(w.memory_url + "/memory/evict",
                   json={"chunk_hashes": hashes + ["ab" * 32], "locations": ["LocalCPUBackend"]})
    assert r.status_code == 200
    assert r.json() == {"status": "success", "num_evicted": 3, "num_missing": 1,
                        "missing": ["ab" * 32], "num_evicted_kv_server": None}
    disk = w.complete(**body)
    assert disk["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"] == {"disk": 768}
    assert disk["choices"][0]["text"] == cold["choices"][0]["text"]
    assert disk["choices"][0]["logprobs"]["token_logprobs"] == \
        cold["choices"][0]["logprobs"]["token_logprobs"]


def test_prefetch_is_async_and_lands_in_dram(stack):
    w, _ = stack
    ids = prompt(800, seed=102)
    hashes = w.complete(prompt=ids, max_tokens=2)["kv_transfer_params"]["chunk_hashes"]
    wait_until(lambda: set(hashes) <= set(httpx.get(w.memory_url + "/memory/chunks").json()
                                        ["chunks"].get("disk", [])), what="disk writes")
    assert httpx.post(w.memory_url + "/memory/evict",
                      json={"chunk_hashes": hashes, "locations": ["cpu"]}).json()[
        "num_evicted"] == 3
    t0 = time.perf_counter()
    r = httpx.post(w.memory_url + "/memory/prefetch",
                   json={"chunk_hashes": hashes + ["cd" * 32], "lookup_id": "turn-7"})
    assert time.perf_counter() - t0 < 2.0
    body = r.json()
    assert body["status"] == "prefetch_started" and body["lookup_id"] == "turn-7"
    assert body["num_chunks"] == 4 and body["num_to_load"] == 3 and body["num_missing"] == 1
    wait_until(lambda: httpx.get(w.memory_url + "/memory/prefetch/turn-7").json()["state"]
             == "done", what="prefetch")
    status = httpx.get(w.memory_url + "/memory/prefetch/turn-7").json()
    assert status["loaded"] == 3 and status["corrupt"] == 0
    chunks = httpx.get(w.memory_url + "/memory/chunks").json()["chunks"]
    assert set(hashes) <= set(chunks["cpu"])
    again = w.complete(prompt=ids, max_tokens=2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"] == {"cpu": 768}
    # the forwarding API process merges both engine processes' answers
    per_engine = [httpx.post(w.engine_url(k) + "/memory/prefetch",
                             json={"chunk_hashes": hashes}).json()["num_in_cpu"]
                  for k in (0, 1)]
    assert sorted(per_engine) == [0, 3]


def test_validation_errors_name_the_field(stack):
    w, _ = stack

    def err(path, body, status=400):
        r = httpx.post(w.url + path, json=body, timeout=30)
        assert r.status_code == status, r.text
        return r.json()["error"]["param"]

    c, chat = "/v1/completions", "/v1/chat/completions"
    assert err(c, {"prompt": list(range(3, 3 + MAX_LEN))}) == "prompt"
    assert err(c, {"prompt": [5] * 100, "max_tokens": MAX_LEN}) == "max_tokens"
    assert err(chat, {"messages": [{"role": "user", "content": "x" * MAX_LEN}]}) == "messages"
    assert err(c, {"prompt": ""}) == "prompt"
    assert err(c, {"prompt": []}) == "prompt"
    assert err(c, {"prompt": [1, "a"]}) == "prompt"
    assert err(c, {"prompt": [40000]}) == "prompt"
    assert err(c, {"prompt": "x", "max_tokens": "4"}) == "max_tokens"
    assert err(c, {"prompt": "x", "temperature": "hot"}) == "temperature"
    assert err(c, {"prompt": "x", "n": 2}) == "n"
    assert err(c, {}) == "prompt"
    assert err(chat, {"messages": []}) == "messages"
    assert err(chat, {"messages": [{"role": "wizard", "content": "x"}]}) == "messages[0].role"
    assert err(c, {"prompt": "x", "forced_output_token_ids": [1, -2]}) == \
        "forced_output_token_ids"
    assert err(c, {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}) == \
        "kv_transfer_params.remote_host"
    assert err(c, {"prompt": "x", "model": "gpt-9"}, status=404) == "model"
    r = httpx.post(w.memory_url + "/memory/evict",
                   json={"chunk_hashes": ["ab"], "locations": ["cpu", "GPU"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "locations[1]"
    r = httpx.post(w.memory_url + "/memory/prefetch", json={"chunk_hashes": ["XYZ"]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("chunk_hashes")


def test_streaming_matches_non_streaming(stack):
    w, _ = stack
    ids = prompt(300, seed=103)
    whole = w.complete(prompt=ids, max_tokens=6)
    events = w.stream("/v1/completions", prompt=ids, max_tokens=6,
                      stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        whole["choices"][0]["text"]
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    assert final["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
    assert final["kv_transfer_params"]["chunk_hashes"] == ChunkHasher("blake3", 256).hashes(ids)
    chat = w.stream("/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
                    max_tokens=3)
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat[-2]["choices"][0]["finish_reason"] == "length"
    assert chat[-2]["kv_transfer_params"] == {"chunk_hashes": []}
    assert chat[-1] == "[DONE]"
    full = httpx.post(w.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).json()
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["content"] == "".join(
        c["choices"][0]["delta"].get("content", "") for c in chat[:-1])


def test_teacher_forcing_and_stop_strings(stack):
    w, _ = stack
    forced = [300 + i for i in range(7)]
    r = w.complete(prompt=prompt(50, seed=104), forced_output_token_ids=forced,
                   return_token_ids=True)
    assert r["choices"][0]["token_ids"] == forced and r["usage"]["completion_tokens"] == 7
    text = r["choices"][0]["text"]
    stop = text.split()[2]
    cut = w.complete(prompt=prompt(50, seed=104), forced_output_token_ids=forced, stop=[stop])
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[: text.index(stop)]


def test_kvindex_tracks_residency_through_an_outage(stack):
    w, kv = stack
    ids = prompt(600, seed=105)
    hashes = w.complete(prompt=ids, max_tokens=2)["kv_transfer_params"]["chunk_hashes"]
    wait_until(lambda: kv.locations(hashes[0]) == {("w-http", "cpu"), ("w-http", "disk")},
             what="residency in the kvindex")
    pod = httpx.get(f"{kv.url}/v1/pods/w-http").json()
    assert pod["role"] == "both" and pod["memory_api_url"] == w.memory_url
    assert pod["capacity_bytes"]["cpu"] == 2 * int(0.25 * 1024**3)
    httpx.post(w.memory_url + "/memory/evict", json={"chunk_hashes": hashes[:1]})
    wait_until(lambda: kv.locations(hashes[0]) == set(), what="eviction in the kvindex")
    assert kv.locations(hashes[1]) == {("w-http", "cpu"), ("w-http", "disk")}
    kv.stop()  # the kvindex goes away: the worker keeps serving
    ids2 = prompt(600, seed=106)
    during = w.complete(prompt=ids2, max_tokens=2)["kv_transfer_params"]["chunk_hashes"]
    again = w.complete(prompt=ids2, max_tokens=2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
    kv.start()  # back, empty: the worker re-registers and sends a snapshot
    wait_until(lambda: ("w-http", "cpu") in kv.locations(during[0]), timeout_s=15,
             what="resync after the outage")
    assert kv.locations(hashes[1]) == {("w-http", "cpu"), ("w-http", "disk")}
    assert kv.locations(hashes[0]) == set()
    assert metric_value(w.metrics(), "agentserving_worker_kvindex_up") == 1
    assert metric_value(w.metrics(), "agentserving_worker_kvindex_resyncs_total") >= 2


def test_metrics_cover_tokens_tiers_time_and_queue(stack):
    w, _ = stack
    text = w.metrics()
    assert metric_value(text, "agentserving_worker_ttft_seconds_count") >= 5
    assert metric_sum(text, "agentserving_worker_cached_tokens_total", tier="cpu") > 0
    assert metric_sum(text, "agentserving_worker_cached_tokens_total", tier="disk") > 0
    assert metric_sum(text, "agentserving_worker_prompt_tokens_total") > 3000
    assert metric_value(text, "agentserving_worker_prefill_seconds_count") >= 5
    assert metric_value(text, "agentserving_worker_decode_seconds_sum") > 0
    assert metric_value(text, "agentserving_worker_kv_bytes", 'tier="cpu"') > 0
    assert metric_value(text, "agentserving_worker_kv_capacity_bytes", 'tier="disk"') > 0
    assert 'agentserving_worker_queue_length{state="waiting"}' in text
    assert metric_value(text, "agentserving_worker_kv_prefetched_chunks_total") >= 3
    assert metric_value(text, "agentserving_worker_requests_total",
                        'endpoint="completion",outcome="bad_request"') >= 5


def test_concurrent_requests_match_sequential_ones(stack):
    import concurrent.futures

    w, _ = stack
    bodies = [{"prompt": prompt(200 + 90 * i, seed=300 + i), "max_tokens": 4 + i}
              for i in range(4)]
    alone = [w.complete(**b)["choices"][0]["text"] for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda b: w.complete(**b)["choices"][0]["text"], bodies))
    assert together == alone


def test_client_disconnect_aborts_the_engine_request(stack):
    w, _ = stack
    with httpx.stream("POST", w.url + "/v1/completions", timeout=60, json={
            "prompt": prompt(100, seed=400), "max_tokens": 1500, "ignore_eos": True,
            "stream": True}) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        wait_until(lambda: metric_value(w.metrics(), "agentserving_worker_queue_length",
                                      'state="running"') == 1, what="the request running")
    # the client hung up after one token: the engine drops the request instead of decoding on
    wait_until(lambda: metric_value(w.metrics(), "agentserving_worker_queue_length",
                                  'state="running"') == 0, timeout_s=10, what="the abort")
    assert metric_value(w.metrics(), "agentserving_worker_completion_tokens_total") < 5000
