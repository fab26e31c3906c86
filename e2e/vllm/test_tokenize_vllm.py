"""vLLM's server surface through the proxy on the vLLM engine: ``/tokenize`` and
``/detokenize`` answered by ``vllm serve`` pods (natively), ``/version`` and ``/health``
forwarded — the same answers the reference worker gives (e2e/proxy/test_tokenize_e2e.py), so a
client sees one surface whichever engine serves."""

from __future__ import annotations

import httpx
import pytest

from agentserving.engine.model.tokenizer import BOS_TEXT, ByteTokenizer

from .conftest import VllmFleet, post

pytestmark = pytest.mark.timeout(900)

TOKENIZER = ByteTokenizer(32000)  # the tiny model's folder tokenizes as this does
TEXTS = ["hello world", "héllo ✓ — unicode and emoji 🚀"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]


@pytest.mark.parametrize("text", TEXTS)
def test_vllm_tokenize_round_trip_through_the_proxy(vllm_fleet: VllmFleet, text: str) -> None:
    plain = post(vllm_fleet.proxy, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == 20000
    assert plain["tokens"] == TOKENIZER.encode(text, add_bos=False)
    assert post(vllm_fleet.proxy, "/detokenize", {"tokens": plain["tokens"]})["prompt"] == text
    with_bos = post(vllm_fleet.proxy, "/tokenize", {"prompt": text})
    assert with_bos["tokens"] == TOKENIZER.encode(text)
    assert post(vllm_fleet.proxy, "/detokenize",
                {"tokens": with_bos["tokens"]})["prompt"] == BOS_TEXT + text


def test_vllm_chat_tokenize_applies_the_template(vllm_fleet: VllmFleet) -> None:
    counted = post(vllm_fleet.proxy, "/tokenize", {"messages": CHAT})
    assert counted["tokens"] == TOKENIZER.apply_chat_template(CHAT)
    done = post(vllm_fleet.proxy, "/v1/chat/completions",
                {"model": "tiny", "messages": CHAT, "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == counted["count"]
    text = post(vllm_fleet.proxy, "/detokenize", {"tokens": counted["tokens"]})["prompt"]
    assert text == TOKENIZER.render_chat(CHAT, add_generation_prompt=True)


def test_vllm_bad_input_version_and_health(vllm_fleet: VllmFleet) -> None:
    r = httpx.post(vllm_fleet.proxy + "/tokenize", json={"model": "tiny"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.get(vllm_fleet.proxy + "/version", timeout=60)
    assert r.status_code == 200 and r.json()["version"], r.text
    r = httpx.get(vllm_fleet.proxy + "/health", timeout=60)
    assert r.status_code == 200 and r.content == b""
