"""The worker's OpenAI-compatible HTTP API (the API process): tokenize, validate, hand the
request to an engine process, stream the tokens back.

Routes: ``POST /v1/completions`` (prompt text or token ids), ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /healthz`` (liveness), ``GET /readyz`` (engines loaded),
``GET /metrics``, and vLLM's ``/tokenize``, ``/detokenize``, ``/version``, ``/health``
(``tokenization``). Every final response — and the last SSE chunks of a stream — carries
``kv_transfer_params.chunk_hashes``: the prompt's chunk hashes, the ids the proxy and the
kvindex use for this session's KV (seed 000). ``usage.prompt_tokens_details.cached_tokens``
counts prompt tokens whose KV was reused, with a per-tier breakdown beside it.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from agentserving.core.hashing import ChunkHasher
from agentserving.core.logging import get_logger
from agentserving.core.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from agentserving.core.schemas import TENANT_HEADER, PodRole
from agentserving.core.service import (
    ApiError,
    error_responses,
    install_error_handlers,
    install_metrics_route,
)
from agentserving.engine import ipc
from agentserving.engine.api.engine_client import EngineClient, EngineDead
from agentserving.engine.api.tokenization import install_tokenization_routes
from agentserving.engine.metrics import NO_TENANT, WorkerMetrics
from agentserving.engine.model.tokenizer import Tokenizer
from agentserving.engine.settings import WorkerSettings

log = get_logger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16
TOKEN_ID_OUT_OF_VOCABULARY = "token_id_out_of_vocabulary"  # the error code of such a 400

# A completion answers JSON, or an SSE stream with "stream": true; its errors are OpenAI's.
# A 400 with code context_length_exceeded is the one answer a schema-valid body can get: the
# prompt's token count is only known once it is tokenized.
_COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The completion; with `stream`, server-sent events ending in "
                         "`data: [DONE]`. Both carry `kv_transfer_params.chunk_hashes`.",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **error_responses(400, 404, 413, 503),
}
_COMPLETION_RESPONSES[400] = {
    **_COMPLETION_RESPONSES[400],
    "description": "Bad input, `error.param` names the field; or, with code "
                   "`context_length_exceeded`, the prompt plus the tokens to generate exceed "
                   "the model's context.",
}


def _narrow_to_model(app: FastAPI, vocab_size: int) -> None:
    """This worker's OpenAPI says what it accepts: token ids below its vocabulary (the shared
    models allow any model's). The context length stays a runtime 400: no schema can say how
    many tokens a prompt string makes."""
    generate = app.openapi

    def narrow(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "integer" and node.get("minimum") == 0 and "maximum" in node:
                node["maximum"] = vocab_size - 1
            for value in node.values():
                narrow(value)
        elif isinstance(node, list):
            for value in node:
                narrow(value)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            props = schema["components"]["schemas"][name]["properties"]
            narrow(props["forced_output_token_ids"])
            if "prompt" in props:
                narrow(props["prompt"])
        narrow(schema["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"])
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


class WorkerApi:
    """Everything a request handler needs; built once by ``worker.serve``."""

    def __init__(self, settings: WorkerSettings, client: EngineClient, tokenizer: Tokenizer,
                 metrics: WorkerMetrics, max_model_len: int) -> None:
        self.settings = settings
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.model_name = settings.model_name
        self._hashers: dict[str | None, ChunkHasher] = {}

    def chunk_hashes(self, prompt_ids: list[int], cache_salt: str | None) -> list[str]:
        hasher = self._hashers.get(cache_salt)
        if hasher is None:
            hasher = ChunkHasher(self.settings.hash_scheme, self.settings.chunk_size,
                                 cache_salt=cache_salt)
            if len(self._hashers) < 1024:
                self._hashers[cache_salt] = hasher
        return hasher.hashes(prompt_ids)


class _Turn:
    """One request, normalized: prompt ids, budgets, and how to render the answer."""

    def __init__(self, kind: str, body: SamplingFields, prompt_ids: list[int],
                 logprobs: int | None) -> None:
        self.kind = kind
        self.body = body
        self.prompt_ids = prompt_ids
        self.logprobs = logprobs
        self.req_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.max_tokens = 0
        self.stops: list[str] = list(body.stop or [])  # type: ignore[arg-type]
        self.tenant = NO_TENANT  # the metrics' tenant label (WorkerMetrics.tenants)


def create_api_app(api: WorkerApi) -> FastAPI:
    app = FastAPI(title="AgentServing worker", version="v1",
                  summary="OpenAI-compatible serving with tiered KV reuse.")
    install_error_handlers(app, max_body_bytes=api.settings.max_body_bytes)
    install_metrics_route(app, api.metrics.registry)
    app.state.api = api

    def engines_serving() -> None:
        if not api.client.ready:
            raise ApiError(503, api.client.dead or "engines loading",
                           type="service_unavailable")

    @app.get("/healthz", tags=["health"], responses=error_responses(503),
             summary="The worker can serve: every engine process is loaded and alive.")
    async def healthz() -> dict[str, str]:
        engines_serving()
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], responses=error_responses(503),
             summary="Every engine process is loaded and serving.")
    async def readyz() -> dict[str, Any]:
        engines_serving()
        return {"status": "ready", "engines": len(api.client.engines)}

    @app.get("/v1/models", tags=["openai"])
    async def models() -> dict[str, Any]:
        ready = api.client.ready_info if api.client.ready else None
        return {"object": "list", "data": [{
            "id": api.model_name, "object": "model", "created": 0, "owned_by": "agentserving",
            "root": api.settings.model, "max_model_len": api.max_model_len,
            "weights_digest": ready.weights_digest if ready else None,
            "chunk_size": api.settings.chunk_size, "hash_scheme": api.settings.hash_scheme,
            "role": api.settings.role.value,
        }]}

    @app.post("/v1/completions", tags=["openai"], responses=_COMPLETION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        if isinstance(body.prompt, str):
            ids = api.tokenizer.encode(body.prompt)
        else:
            ids = list(body.prompt)
        turn = _Turn("completion", body, ids, body.logprobs)
        turn.tenant = api.metrics.tenants(request.headers.get(TENANT_HEADER), body.cache_salt)
        return await _serve(api, turn, "prompt", t0, DEFAULT_COMPLETION_MAX_TOKENS)

    @app.post("/v1/chat/completions", tags=["openai"], responses=_COMPLETION_RESPONSES)
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        ids = api.tokenizer.apply_chat_template(messages)
        n = (body.top_logprobs or 0) if body.logprobs else None
        turn = _Turn("chat", body, ids, n)
        turn.tenant = api.metrics.tenants(request.headers.get(TENANT_HEADER), body.cache_salt)
        return await _serve(api, turn, "messages", t0, None)

    install_tokenization_routes(app, api.tokenizer, api.model_name,
                                lambda: api.max_model_len, engines_serving)
    _narrow_to_model(app, api.tokenizer.vocab_size)
    return app


# ---------------------------------------------------------------- request handling


def _validate(api: WorkerApi, turn: _Turn, prompt_field: str, default_max: int | None) -> None:
    body = turn.body
    if body.model is not None and body.model != api.model_name:
        raise ApiError(404, f"The model `{body.model}` does not exist; this worker serves "
                       f"`{api.model_name}`.", param="model", type="not_found_error",
                       code="model_not_found")
    n = len(turn.prompt_ids)
    if n == 0:
        raise ApiError(400, f"{prompt_field}: the prompt is empty", param=prompt_field)
    vocab = api.tokenizer.vocab_size
    for i, t in enumerate(turn.prompt_ids):
        if t >= vocab:
            raise ApiError(400, f"{prompt_field}[{i}]: token id {t} is not below the "
                           f"vocabulary size {vocab}", param=prompt_field,
                           code=TOKEN_ID_OUT_OF_VOCABULARY)
    if n >= api.max_model_len:
        raise ApiError(400, f"This model's maximum context length is {api.max_model_len} "
                       f"tokens; the prompt has {n} tokens.", param=prompt_field,
                       code="context_length_exceeded")
    forced = body.forced_output_token_ids
    for i, t in enumerate(forced or []):
        if t >= vocab:
            raise ApiError(400, f"forced_output_token_ids[{i}]: token id {t} is not below "
                           f"the vocabulary size {vocab}", param="forced_output_token_ids",
                           code=TOKEN_ID_OUT_OF_VOCABULARY)
    requested = body.max_completion_tokens or body.max_tokens
    if forced is not None:
        turn.max_tokens = len(forced)
    elif requested is not None:
        turn.max_tokens = requested
    else:
        turn.max_tokens = default_max or (api.max_model_len - n)
    if n + turn.max_tokens > api.max_model_len:
        field = "forced_output_token_ids" if forced is not None else "max_tokens"
        raise ApiError(400, f"This model's maximum context length is {api.max_model_len} "
                       f"tokens; {n} in the prompt plus {turn.max_tokens} to generate "
                       "exceed it.", param=field, code="context_length_exceeded")
    params = body.kv_transfer_params
    if params is not None:
        role = api.settings.role
        if params.get("do_remote_decode") and role is PodRole.DECODE:
            raise ApiError(400, "kv_transfer_params.do_remote_decode: this is a decode pod",
                           param="kv_transfer_params")
        if params.get("do_remote_prefill"):
            if role is PodRole.PREFILL:
                raise ApiError(400, "kv_transfer_params.do_remote_prefill: this is a "
                               "prefill pod", param="kv_transfer_params")
            for field in ("remote_host", "remote_port", "transfer_id"):
                if field not in params:
                    raise ApiError(400, f"kv_transfer_params.{field} is required with "
                                   "do_remote_prefill", param=f"kv_transfer_params.{field}")


async def _serve(api: WorkerApi, turn: _Turn, prompt_field: str, t0: float,
                 default_max: int | None) -> Any:
    endpoint = turn.kind
    if not await api.client.wait_ready(api.settings.ready_wait_s):
        api.metrics.requests.labels(endpoint, "unavailable").inc()
        raise ApiError(503, api.client.dead or "engines loading", type="service_unavailable")
    try:
        _validate(api, turn, prompt_field, default_max)
    except ApiError:
        api.metrics.requests.labels(endpoint, "bad_request").inc()
        raise
    body = turn.body
    add = ipc.AddRequest(
        req_id=turn.req_id, prompt_token_ids=turn.prompt_ids, max_tokens=turn.max_tokens,
        temperature=body.temperature, top_p=body.top_p, seed=body.seed,
        ignore_eos=body.ignore_eos, stop_token_ids=list(body.stop_token_ids or []),
        logprobs=turn.logprobs, forced_output_token_ids=body.forced_output_token_ids,
        cache_salt=body.cache_salt, kv_transfer_params=body.kv_transfer_params,
        arrival_time=time.time())
    hashes = (api.chunk_hashes(turn.prompt_ids, body.cache_salt)
              if len(api.client.engines) > 1 else [])
    events = _generate(api, turn, add, hashes, t0)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(api, turn, events, include_usage),
                                 media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    text, tokens, final = "", [], None
    try:
        async with contextlib.aclosing(events) as stream:
            async for delta, toks, item in stream:
                text += delta
                tokens.extend(toks)
                if isinstance(item, _Final):
                    final = item
    except EngineDead as exc:
        api.metrics.requests.labels(endpoint, "error").inc()
        raise ApiError(503, str(exc), type="service_unavailable") from exc
    assert final is not None
    if final.error:
        api.metrics.requests.labels(endpoint, "error").inc()
        raise ApiError(500, f"engine error: {final.error}", type="internal_error")
    api.metrics.requests.labels(endpoint, "ok").inc()
    return JSONResponse(_full_response(api, turn, text, tokens, final))


class _Final:
    """The end of a request, as the handlers see it (engine item or a stop-string cut)."""

    def __init__(self, item: ipc.OutputItem, finish_reason: str, meta: dict[str, Any]) -> None:
        self.finished = True
        self.finish_reason = finish_reason
        self.meta = meta
        self.kv_transfer_params = item.kv_transfer_params
        self.error = item.error


async def _generate(api: WorkerApi, turn: _Turn, add: ipc.AddRequest, hashes: list[str],
                    t0: float) -> AsyncIterator[tuple[str, list[ipc.TokenItem], Any]]:
    """Engine outputs -> (text delta, tokens, item); applies stop strings; records metrics."""
    decoder = api.tokenizer.decoder()
    held = ""  # text not yet emitted: it may be the start of a stop string
    hold = max((len(s) for s in turn.stops), default=1) - 1
    meta: dict[str, Any] = {}
    first = True
    async with contextlib.aclosing(api.client.generate(add, hashes)) as outputs:
        async for item in outputs:
            if first and item.tokens:
                first = False
                api.metrics.ttft.observe(time.perf_counter() - t0)
                meta.update(item.meta)
                api.metrics.observe_first(item.meta, turn.tenant)
            if item.finished:
                meta.update(item.meta)
            piece = "".join(decoder.push(t.token_id) for t in item.tokens)
            if item.finished:
                piece += decoder.flush()
            held += piece
            if turn.stops:
                cut = min((i for i in (held.find(s) for s in turn.stops) if i >= 0), default=-1)
                if cut >= 0:
                    api.metrics.observe_finish(
                        {**meta, "completion_tokens": meta.get("completion_tokens")
                         or len(item.tokens)}, time.perf_counter() - t0)
                    final = _Final(item, "stop", meta)
                    if final.kv_transfer_params is None:
                        final.kv_transfer_params = {"chunk_hashes": _chunk_hashes(api, turn)}
                    yield held[:cut], item.tokens, final
                    return  # leaving the engine generator aborts the request there
            if item.finished:
                out, held = held, ""
                api.metrics.observe_finish(meta, time.perf_counter() - t0)
                yield out, item.tokens, _Final(item, item.finish_reason or "stop", meta)
                return
            emit_upto = max(0, len(held) - hold) if turn.stops else len(held)
            out, held = held[:emit_upto], held[emit_upto:]
            yield out, item.tokens, item


def _chunk_hashes(api: WorkerApi, turn: _Turn) -> list[str]:
    return api.chunk_hashes(turn.prompt_ids, turn.body.cache_salt)


def _usage(turn: _Turn, completion_tokens: int, meta: dict[str, Any]) -> dict[str, Any]:
    n = len(turn.prompt_ids)
    return {
        "prompt_tokens": n, "completion_tokens": completion_tokens,
        "total_tokens": n + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": int(meta.get("cached_tokens", 0)),
            "cached_tokens_by_tier": dict(meta.get("cached_tokens_by_tier") or {}),
        },
    }


def _logprobs_completion(api: WorkerApi, tokens: list[ipc.TokenItem]) -> dict[str, Any]:
    dec = api.tokenizer
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": [], "token_ids": []}
    offset = 0
    for t in tokens:
        s = dec.decode([t.token_id])
        out["tokens"].append(s)
        out["token_ids"].append(t.token_id)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({dec.decode([i]): lp for i, lp in (t.top_logprobs or [])})
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def _logprobs_chat(api: WorkerApi, tokens: list[ipc.TokenItem]) -> dict[str, Any]:
    dec = api.tokenizer

    def entry(token_id: int, lp: float | None) -> dict[str, Any]:
        s = dec.decode([token_id])
        return {"token": s, "logprob": lp, "bytes": list(s.encode()), "token_id": token_id}

    return {"content": [{**entry(t.token_id, t.logprob),
                         "top_logprobs": [entry(i, lp) for i, lp in (t.top_logprobs or [])]}
                        for t in tokens]}


def _full_response(api: WorkerApi, turn: _Turn, text: str, tokens: list[ipc.TokenItem],
                   final: Any) -> dict[str, Any]:
    ids = [t.token_id for t in tokens]
    choice: dict[str, Any] = {"index": 0, "finish_reason": final.finish_reason}
    if turn.kind == "completion":
        choice["text"] = text
        choice["logprobs"] = (_logprobs_completion(api, tokens)
                              if turn.logprobs is not None else None)
        obj = "text_completion"
    else:
        choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = _logprobs_chat(api, tokens) if turn.logprobs is not None else None
        obj = "chat.completion"
    if turn.body.return_token_ids:
        choice["token_ids"] = ids
    resp: dict[str, Any] = {
        "id": turn.req_id, "object": obj, "created": turn.created, "model": api.model_name,
        "choices": [choice], "usage": _usage(turn, len(ids), final.meta),
        "kv_transfer_params": final.kv_transfer_params,
    }
    if turn.body.return_token_ids:
        resp["prompt_token_ids"] = turn.prompt_ids
    return resp


async def _sse(api: WorkerApi, turn: _Turn, events: AsyncIterator, include_usage: bool
               ) -> AsyncIterator[bytes]:
    obj = "text_completion" if turn.kind == "completion" else "chat.completion.chunk"
    base = {"id": turn.req_id, "object": obj, "created": turn.created, "model": api.model_name}
    n_tokens = 0
    endpoint = turn.kind

    def chunk(payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps({**base, **payload}).encode() + b"\n\n"

    if turn.kind == "chat":
        yield chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}]})
    try:
        async with contextlib.aclosing(events) as stream:
            async for delta, toks, item in stream:
                n_tokens += len(toks)
                done = isinstance(item, _Final)
                if done and item.error:
                    api.metrics.requests.labels(endpoint, "error").inc()
                    yield b"data: " + json.dumps({"error": {
                        "message": f"engine error: {item.error}", "type": "internal_error",
                        "param": None, "code": None}}).encode() + b"\n\n"
                    break
                choice: dict[str, Any] = {"index": 0,
                                          "finish_reason": item.finish_reason if done else None}
                if turn.kind == "completion":
                    choice["text"] = delta
                    choice["logprobs"] = (_logprobs_completion(api, toks)
                                          if turn.logprobs is not None else None)
                else:
                    choice["delta"] = {"content": delta} if delta or not done else {}
                    choice["logprobs"] = (_logprobs_chat(api, toks)
                                          if turn.logprobs is not None else None)
                if turn.body.return_token_ids:
                    choice["token_ids"] = [t.token_id for t in toks]
                payload: dict[str, Any] = {"choices": [choice]}
                if done:
                    payload["kv_transfer_params"] = item.kv_transfer_params
                    if turn.body.return_token_ids:
                        payload["prompt_token_ids"] = turn.prompt_ids
                yield chunk(payload)
                if done:
                    api.metrics.requests.labels(endpoint, "ok").inc()
                    if include_usage:
                        yield chunk({"choices": [], "usage": _usage(turn, n_tokens, item.meta),
                                     "kv_transfer_params": item.kv_transfer_params})
                    break
    except EngineDead as exc:
        api.metrics.requests.labels(endpoint, "error").inc()
        yield b"data: " + json.dumps({"error": {"message": str(exc), "type":
                                                "service_unavailable", "param": None,
                                                "code": None}}).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
