"""A stalled decode pod during an agent replay, with real processes on loopback: kvindex, one
prefill and two decode workers (reference engine, tiny model), the proxy. The session's own
decode pod is ``SIGSTOP``ped between its turns (an agent's tool call): the process keeps its
listening socket, so the next turn is accepted and never answered -- a stall, not a death.
Its lease is long (30 s), so the registry keeps listing it: only the stall deadline can move
the turn. Every turn must still succeed, the affected one answered by the other decode pod
within the deadline plus about one normal turn, and after ``SIGCONT`` the pod must answer the
proxy's probe and take turns again. Also here: the context-length check, through the same
proxy, before any pod works on the turn."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from agentserving.proxy.settings import ProxySettings
from testkit.servers import wait_until

FIRST_TOKEN_S = 3.0  # the test's fixed deadlines (the default follows the pods' P99)
INTER_TOKEN_S = 2.0
PROBE_TIMEOUT_S = 1.0  # the silent pod's probe: a stall is called this long after a deadline
MAX_TOKENS = 8

pytestmark = pytest.mark.timeout(300)


def prompt_for(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 10 for i in range(n)]


@pytest.fixture(scope="module")
def fleet(fleet_factory):
    f = fleet_factory
    f.start_kvindex("--lease-ttl", "30")
    f.start_worker("p0", role="prefill", disk=False)
    f.start_worker("d0", role="decode", disk=False)
    f.start_worker("d1", role="decode", disk=False)
    f.proxy = f.start_proxy(
        "--stall-prefill-first-token", str(FIRST_TOKEN_S),
        "--stall-decode-first-token", str(FIRST_TOKEN_S),
        "--stall-prefill-inter-token", str(INTER_TOKEN_S),
        "--stall-decode-inter-token", str(INTER_TOKEN_S),
        "--stall-probe-timeout", str(PROBE_TIMEOUT_S), "--probe-interval", "0.5",
        "--upstream-timeout", "120")
    wait_until(lambda: len(httpx.get(f.kvindex.url + "/v1/pods", headers=f.headers,
                                     timeout=5).json()["pods"]) == 3,
               timeout_s=60, what="three pods registered")
    return f


def turn(proxy_url: str, session: str, prompt: list[int], stream: bool = True,
         max_tokens: int | None = MAX_TOKENS) -> tuple[float, dict[str, str], list[dict]]:
    """One turn: (seconds, the proxy's headers, the SSE events or the one JSON answer). The
    answer is forced, MAX_TOKENS long: without ``max_tokens`` that is its only bound."""
    body = {"model": "tiny", "prompt": prompt, "stream": stream,
            "forced_output_token_ids": list(range(100, 100 + MAX_TOKENS))}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    t0 = time.perf_counter()
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", proxy_url + "/v1/completions", json=body,
            headers={"x-session-id": session}) as resp:
        assert resp.status_code == 200, resp.read()
        if stream:
            events = [json.loads(line[5:]) for line in resp.iter_lines()
                      if line.startswith("data:") and line[5:].strip() != "[DONE]"]
        else:
            events = [json.loads(resp.read())]
        return time.perf_counter() - t0, dict(resp.headers), events


def answered(events: list[dict]) -> bool:
    """Every token came and no error event."""
    if any("error" in e for e in events):
        return False
    texts = [c.get("text") for e in events for c in e.get("choices", [])]
    return sum(1 for t in texts if t) >= 1 and events[-1].get("usage", {}).get(
        "completion_tokens", MAX_TOKENS) == MAX_TOKENS


def metric(proxy_url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(proxy_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def signal_pod(fleet, name: str, sig: int) -> None:  # type: ignore[no-untyped-def]
    os.killpg(fleet.workers[name].proc.pid, sig)


def test_a_turn_past_the_context_is_refused_before_any_pod_works_on_it(fleet):
    url = fleet.proxy.url
    limit = httpx.get(fleet.workers["d0"].url + "/v1/models", timeout=5).json()["data"][0][
        "max_model_len"]
    routed = metric(url, "proxy_routing_decisions_total")
    too_long = httpx.post(url + "/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": prompt_for(1, 100), "max_tokens": limit - 99})
    assert too_long.status_code == 400, too_long.text
    error = too_long.json()["error"]
    assert error["param"] == "max_tokens" and str(limit) in error["message"]
    chat = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": limit + 1})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_tokens"
    assert metric(url, "proxy_routing_decisions_total") == routed  # no pod was asked
    assert metric(url, "proxy_failed_turns_total", reason="context_length") == 2
    # one that fits goes through
    fits = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt_for(1, 100), "max_tokens": 4})
    assert fits.status_code == 200, fits.text


def test_a_stalled_decode_pod_costs_no_turn_and_comes_back(fleet):
    url = fleet.proxy.url
    sessions = {f"s{i}": prompt_for(10 + i, 700) for i in range(4)}
    normal, own = [], {}
    for sid, prompt in sessions.items():  # first turns, P/D, spread over both decode pods
        seconds, headers, events = turn(url, sid, prompt)
        assert answered(events), events
        normal.append(seconds)
        own[sid] = headers["x-agentserving-decode-pod"]
        sessions[sid] = prompt + list(range(100, 100 + MAX_TOKENS)) + prompt_for(50, 100)
    for sid, prompt in sessions.items():  # appends run on the session's own decode pod
        seconds, headers, events = turn(url, sid, prompt)
        assert answered(events) and headers["x-agentserving-decode-pod"] == own[sid]
        normal.append(seconds)
        sessions[sid] = prompt + list(range(100, 100 + MAX_TOKENS)) + prompt_for(60, 100)
    victim = own["s0"]
    # a blocking turn on the same pod: it shows no token before its last, so its own deadline
    # is long; it moves as soon as the stream beside it finds the pod stalled
    blocking = next(sid for sid in sorted(own) if sid != "s0" and own[sid] == victim)
    failed_before = metric(url, "proxy_failed_turns_total")

    signal_pod(fleet, victim, signal.SIGSTOP)  # between turns: the agent runs a tool
    try:
        with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
            futures = {sid: pool.submit(turn, url, sid, prompt, sid != blocking)
                       for sid, prompt in sessions.items()}
            results = {sid: f.result() for sid, f in futures.items()}
        for sid, (seconds, headers, _events) in sorted(results.items()):
            print(sid, f"{seconds:.2f}s", own[sid], headers.get("x-agentserving-pd"),
                  headers.get("x-agentserving-decode-pod"), headers.get("x-agentserving-retried"))
        for sid, (_seconds, headers, events) in results.items():
            assert answered(events), (sid, events)  # no failed turn
            assert headers["x-agentserving-decode-pod"] != victim, sid
        affected = {sid: r for sid, r in results.items()
                    if victim in r[1].get("x-agentserving-retried", "").split(",")}
        # the pod is still listed: a deadline moved the turns sent to it (s0's own, unless
        # another turn's deadline had already marked the pod stalled when s0 was routed, as
        # happens when the four turns start unevenly on a busy machine)
        assert affected and ("s0" in affected or results["s0"][0] < FIRST_TOKEN_S), affected
        for sid, (seconds, _h, _e) in {**affected, blocking: results[blocking]}.items():
            # the first-token deadline and the probe it raises, then about one normal turn
            # elsewhere (the machine is shared: twice the slowest normal turn, plus a second)
            assert seconds <= FIRST_TOKEN_S + PROBE_TIMEOUT_S + 2 * max(normal) + 1.0, \
                (sid, seconds, normal)
            print(f"affected {sid}{' (blocking)' if sid == blocking else ''}: {seconds:.2f}s "
                  f"(deadline {FIRST_TOKEN_S}s, slowest normal turn {max(normal):.2f}s)")
        assert metric(url, "proxy_stalls_total", kind="first_token") >= 1
        assert metric(url, "proxy_stalled_pods") == 1
        assert metric(url, "proxy_failed_turns_total") == failed_before
        seconds, headers, events = turn(url, "s0", sessions["s0"] + prompt_for(70, 50))
        assert answered(events) and victim not in headers.get("x-agentserving-retried", "")
    finally:
        signal_pod(fleet, victim, signal.SIGCONT)
    resumed = time.perf_counter()
    wait_until(lambda: metric(url, "proxy_stalled_pods") == 0, timeout_s=15,
               what="the resumed pod answering the proxy's probe")
    print(f"back in rotation {time.perf_counter() - resumed:.2f}s after SIGCONT")
    back = []
    for i in range(6):  # new sessions: the least busy decode pod is the resumed one
        _s, headers, events = turn(url, f"new{i}", prompt_for(80 + i, 600))
        assert answered(events)
        back.append(headers["x-agentserving-decode-pod"])
    assert victim in back, back


def test_a_busy_pool_is_never_cut_however_short_its_deadlines(fleet):
    """Deadlines of 50 ms, far under any first token or gap here: every turn goes silent past
    them, and every pod answers the probe that silence raises, so no turn is moved or cut
    (as on a machine many times slower than the one deadlines were learned on)."""
    proxy = fleet.start_proxy(
        *(arg for stage in ("prefill", "decode") for kind in ("first-token", "inter-token")
          for arg in (f"--stall-{stage}-{kind}", "0.05")),
        "--upstream-timeout", "120", name="proxy-short-deadlines")
    sessions = {f"busy{i}": prompt_for(200 + i, 1200) for i in range(6)}
    for round_ in range(2):
        with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
            futures = {sid: pool.submit(turn, proxy.url, sid, prompt, i % 2 == 0)
                       for i, (sid, prompt) in enumerate(sessions.items())}
            results = {sid: f.result() for sid, f in futures.items()}
        for sid, (_seconds, headers, events) in results.items():
            assert answered(events), (round_, sid, events)
            assert not headers.get("x-agentserving-retried"), (round_, sid, headers)
            sessions[sid] += list(range(100, 100 + MAX_TOKENS)) + prompt_for(300, 80)
    assert metric(proxy.url, "proxy_stalls_total") == 0
    assert metric(proxy.url, "proxy_failed_turns_total") == 0
    assert metric(proxy.url, "proxy_silent_pod_probes_total", answer="answered") > 0
    assert metric(proxy.url, "proxy_silent_pod_probes_total", answer="silent") == 0


def test_a_fresh_proxy_moves_a_blocking_turn_off_a_stopped_pod_without_max_tokens(fleet):
    """A proxy with its default (adaptive) deadlines, right after start: a session of 1,500
    tokens with two turns served, its decode pod stopped, then its third turn, blocking and
    without max_tokens (no token count to bound the wait): moved within the initial
    first-token deadline and the probe, not left to the client's timeout."""
    proxy = fleet.start_proxy("--upstream-timeout", "120", name="proxy-defaults")
    prompt = prompt_for(400, 1500)
    normal = []
    for _ in range(2):
        seconds, headers, events = turn(proxy.url, "fresh", prompt, stream=False,
                                        max_tokens=None)
        assert answered(events), events
        normal.append(seconds)
        prompt = prompt + list(range(100, 100 + MAX_TOKENS)) + prompt_for(410, 60)
    victim = headers["x-agentserving-decode-pod"]
    signal_pod(fleet, victim, signal.SIGSTOP)
    try:
        seconds, headers, events = turn(proxy.url, "fresh", prompt, stream=False,
                                        max_tokens=None)
        print(f"third turn {seconds:.2f}s on {headers.get('x-agentserving-decode-pod')} "
              f"({headers.get('x-agentserving-pd')}), moved off {victim}")
        assert answered(events), events
        assert victim in headers.get("x-agentserving-retried", "").split(",")
        initial = ProxySettings().stall_first_token_initial_s
        probe = ProxySettings().stall_probe_timeout_s
        assert seconds <= initial + probe + 2 * max(normal) + 2.0, (seconds, normal)
        assert metric(proxy.url, "proxy_stalls_total", kind="first_token") == 1
    finally:
        signal_pod(fleet, victim, signal.SIGCONT)
    wait_until(lambda: metric(proxy.url, "proxy_stalled_pods") == 0, timeout_s=15,
               what="the resumed pod answering the proxy's probe")
