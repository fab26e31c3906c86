"""vLLM's server surface through the proxy — ``/tokenize``, ``/detokenize``, ``/version``,
``/health`` — answered by real reference workers (tiny model) on loopback: the round trip,
the chat template, bad input named, failover to the next pod, and a 503 when none is left.
The tests that kill workers run last."""

from __future__ import annotations

import json

import httpx
import pytest

from agentserving.engine.model.tokenizer import BOS_TEXT, ByteTokenizer
from testkit.worker import metric_sum

TEXTS = ["hello world", "héllo ✓ — unicode and emoji 🚀", "text naming <|user|> a special"]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"}]


@pytest.fixture(scope="module")
def fleet(fleet_factory):
    f = fleet_factory
    f.start_worker("w0", disk=False)
    f.start_worker("w1", disk=False)
    f.proxy = f.start_proxy("--prefill", f.workers["w0"].url, "--prefill", f.workers["w1"].url)
    return f


def post(fleet, path: str, body: object) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(fleet.proxy.url + path, json=body, timeout=60)


def tokenize(fleet, **body: object) -> dict:  # type: ignore[no-untyped-def]
    r = post(fleet, "/tokenize", {"model": "tiny", **body})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["count"] == len(out["tokens"])
    assert out["max_model_len"] > out["count"]
    return out


def detokenize(fleet, tokens: list[int]) -> str:  # type: ignore[no-untyped-def]
    r = post(fleet, "/detokenize", {"model": "tiny", "tokens": tokens})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


@pytest.mark.parametrize("text", TEXTS)
def test_detokenize_gives_back_the_tokenized_text(fleet, text):
    plain = tokenize(fleet, prompt=text, add_special_tokens=False)
    assert detokenize(fleet, plain["tokens"]) == text
    with_bos = tokenize(fleet, prompt=text)  # a completion's default: the BOS first
    assert with_bos["tokens"] == [1, *ByteTokenizer(32000).encode(text, add_bos=False)]
    assert detokenize(fleet, with_bos["tokens"]) == BOS_TEXT + text  # specials written out


def test_tokenize_counts_what_a_completion_computes(fleet):
    done = post(fleet, "/v1/completions", {"model": "tiny", "prompt": TEXTS[1], "max_tokens": 1,
                                           "return_token_ids": True})
    assert done.status_code == 200, done.text
    counted = tokenize(fleet, prompt=TEXTS[1])
    assert counted["tokens"] == done.json()["prompt_token_ids"]
    assert counted["count"] == done.json()["usage"]["prompt_tokens"]


def test_chat_form_applies_the_chat_template(fleet):
    counted = tokenize(fleet, messages=CHAT)
    done = post(fleet, "/v1/chat/completions", {"model": "tiny", "messages": CHAT,
                                                "max_tokens": 1, "return_token_ids": True})
    assert done.status_code == 200, done.text
    assert counted["tokens"] == done.json()["prompt_token_ids"]
    rendered = ByteTokenizer(32000).render_chat(CHAT, add_generation_prompt=True)
    assert detokenize(fleet, counted["tokens"]) == rendered
    assert rendered.endswith("<|user|>And 3 + 3?<|end|><|assistant|>")

    bare = tokenize(fleet, messages=CHAT, add_generation_prompt=False)
    assert detokenize(fleet, bare["tokens"]) == rendered.removesuffix("<|assistant|>")
    cont = tokenize(fleet, messages=CHAT, add_generation_prompt=False,
                    continue_final_message=True)
    assert detokenize(fleet, cont["tokens"]).endswith("<|user|>And 3 + 3?")


def test_token_strs_spell_the_tokens(fleet):
    out = tokenize(fleet, prompt="hi é", return_token_strs=True)
    assert out["token_strs"] == ["<s>", "h", "i", " ", "<0xC3>", "<0xA9>"]
    assert tokenize(fleet, prompt="hi")["token_strs"] is None


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", [1, 2], "body"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [5, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": [5, 32000]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(fleet, path, body, param):
    r = post(fleet, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_malformed_json_and_an_unknown_model(fleet):
    r = httpx.post(fleet.proxy.url + "/tokenize", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = post(fleet, "/detokenize", {"model": "no-such-model", "tokens": [5]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


def test_version_health_and_openapi(fleet):
    r = httpx.get(fleet.proxy.url + "/version", timeout=30)
    assert r.status_code == 200 and r.json()["version"], r.text
    assert r.headers["x-agentserving-pod"] in (fleet.workers["w0"].url, fleet.workers["w1"].url)
    r = httpx.get(fleet.proxy.url + "/health", timeout=30)
    assert r.status_code == 200 and r.content == b""
    paths = httpx.get(fleet.proxy.url + "/openapi.json", timeout=30).json()["paths"]
    assert {"/tokenize", "/detokenize", "/version", "/health"} <= set(paths)


def test_api_keys_guard_tokenize_and_leave_the_probes_open(fleet, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-tenant-a-0001", "tenant": "a"}]}))
    proxy = fleet.start_proxy("--prefill", fleet.workers["w1"].url, "--api-keys", str(keys),
                              name="proxy-keys")
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
        r = httpx.post(proxy.url + path, json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = httpx.post(proxy.url + path, json=body, timeout=30,
                       headers={"authorization": "Bearer sk-tenant-a-0001"})
        assert r.status_code == 200, r.text
    assert httpx.get(proxy.url + "/version", timeout=30).status_code == 200
    assert httpx.get(proxy.url + "/health", timeout=30).status_code == 200


def test_a_dead_pod_fails_over_then_none_is_a_503(fleet):
    fleet.workers["w0"].kill()
    r = post(fleet, "/tokenize", {"prompt": "still served"})
    assert r.status_code == 200, r.text
    assert r.headers["x-agentserving-pod"] == fleet.workers["w1"].url
    metrics = httpx.get(fleet.proxy.url + "/metrics", timeout=30).text
    assert metric_sum(metrics, "proxy_engine_route_requests_total", route="/tokenize",
                      outcome="failover") == 1
    fleet.workers["w1"].kill()
    r = post(fleet, "/detokenize", {"tokens": [5]})
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert fleet.workers["w0"].url in message and fleet.workers["w1"].url in message, message
    assert httpx.get(fleet.proxy.url + "/health", timeout=30).status_code == 503
