"""A stand-in worker pod for control-plane load benches: OpenAI-compatible, answers at once.

It measures the control plane alone (proxy, kvindex, Redis): 1,000 real agent sessions cannot
decode on 2 cores, so this process does no model work at all. What it does do is everything the
control plane sees of a real pod:

- it answers ``POST /v1/completions`` (token-id prompts) and ``POST /v1/chat/completions`` with
  a valid OpenAI body: a few output tokens, ``usage`` with ``prompt_tokens``,
  ``completion_tokens`` and ``prompt_tokens_details.cached_tokens`` (the leading full chunks it
  already held), and ``kv_transfer_params.chunk_hashes``, the prompt's chunk hashes, which the
  proxy reads (``TurnOutcome.absorb``) to look the session's next turn up in the kvindex;
  ``"stream": true`` answers as SSE, usage and hashes on the last event, as the real workers do;
- it hashes prompts with the project's own ``agentserving.core.hashing`` (blake3 scheme, chunks
  of ``--chunk-size``), so its hashes are what a real worker would publish;
- it registers with the kvindex as a pod (``api_url`` set, so the proxy discovers it), renews
  its lease and publishes a ``stored`` residency event for every chunk it "computed", through
  the worker's own ``ResidencyBook`` and ``KvindexReporter`` (``agentserving.engine.reporter``:
  numbered batches, snapshots on resync, deregistration on exit);
- ``/memory/prefetch`` and ``/memory/evict`` accept the kvindex's fan-out calls; ``GET
  /standin/stats`` says what it holds and served (the bench checks the index against it).

A chat prompt has no token ids: its messages' UTF-8 bytes stand in for them (pseudo tokens, so
that chat turns publish chunks too). Nothing is ever evicted: the index grows with the run.

    python -m bench.standin_worker --port 9101 --pod-name standin-0 --kvindex URL
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from typing import Any

import msgspec
from aiohttp import web

from agentserving.core.clients import KvindexClient
from agentserving.core.hashing import DEFAULT_CHUNK_SIZE, ChunkHasher, HashScheme
from agentserving.core.schemas import PodRegistration, PodRole, Tier
from agentserving.engine.reporter import KvindexReporter, ResidencyBook

MODEL = "standin"
OUTPUT_TEXT = " ok"

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()


class StandIn:
    """The pod's state: what it holds (one tier, device) and what it has served."""

    def __init__(self, pod: str, chunk_size: int, max_output_tokens: int,
                 us_per_computed_token: float = 0.0) -> None:
        self.pod = pod
        self.us_per_computed_token = us_per_computed_token
        self.chunk_size = chunk_size
        self.max_output_tokens = max_output_tokens
        self.hasher = ChunkHasher(HashScheme.BLAKE3, chunk_size)
        self.book = ResidencyBook(chunk_bytes=0)
        self.reporter: KvindexReporter | None = None
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def serve(self, tokens: list[int], salt: str | None) -> tuple[list[str], int]:
        """Hash the prompt, say how much of it was held, hold all of it, publish the change."""
        hasher = self.hasher if not salt else ChunkHasher(HashScheme.BLAKE3, self.chunk_size,
                                                          cache_salt=salt)
        hashes = hasher.hashes(tokens)
        held = 0
        for h in hashes:
            if not self.book.holds(Tier.DEVICE, h):
                break
            held += 1
        changes = self.book.apply(0, {Tier.DEVICE.value: hashes}, {})
        if self.reporter is not None:
            self.reporter.on_changes(changes)
        cached = held * self.chunk_size
        self.requests += 1
        self.prompt_tokens += len(tokens)
        self.cached_tokens += cached
        return hashes, cached

    def output_tokens(self, body: dict[str, Any]) -> int:
        asked = body.get("max_tokens") or body.get("max_completion_tokens") or 1
        return max(1, min(int(asked), self.max_output_tokens))


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _bad_request(message: str, param: str) -> web.Response:
    return web.Response(status=400, content_type="application/json", body=_encode.encode(
        {"error": {"message": message, "type": "invalid_request_error", "param": param}}))


def _chat_pseudo_tokens(messages: list[Any]) -> list[int]:
    text = "\n".join(f"{m.get('role')}:{m.get('content')}" for m in messages
                     if isinstance(m, dict))
    return list(text.encode())


def make_app(state: StandIn) -> web.Application:
    async def answer(request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = _decode.decode(await request.read())
        except msgspec.DecodeError as exc:
            return _bad_request(f"malformed JSON: {exc}", "body")
        if not isinstance(body, dict):
            return _bad_request("body must be a JSON object", "body")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list):
                return _bad_request("messages: field required", "messages")
            tokens = _chat_pseudo_tokens(messages)
        else:
            tokens = body.get("prompt")
            if not (isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)):
                return _bad_request("prompt: this stand-in takes token-id prompts", "prompt")
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        hashes, cached = state.serve(tokens, salt)
        if state.us_per_computed_token:  # prefill's cost: the tokens not held already
            await asyncio.sleep((len(tokens) - cached) * state.us_per_computed_token / 1e6)
        n_out = state.output_tokens(body)
        usage = _usage(len(tokens), n_out, cached)
        params = {"chunk_hashes": hashes}
        created = int(time.time())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{state.pod}-{state.requests}"
        obj = "chat.completion" if chat else "text_completion"
        if chat:
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "message": {
                "role": "assistant", "content": OUTPUT_TEXT * n_out}}
        else:
            choice = {"index": 0, "text": OUTPUT_TEXT * n_out, "logprobs": None,
                      "finish_reason": "length"}
        if not body.get("stream"):
            return web.Response(content_type="application/json", body=_encode.encode(
                {"id": rid, "object": obj, "created": created, "model": MODEL,
                 "choices": [choice], "usage": usage, "kv_transfer_params": params}))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            delta = {"index": 0, "finish_reason": "length",
                     "delta": {"role": "assistant", "content": OUTPUT_TEXT * n_out}}
        else:
            delta = choice
        for event in ({"id": rid, "object": chunk_obj, "created": created, "model": MODEL,
                       "choices": [delta]},
                      {"id": rid, "object": chunk_obj, "created": created, "model": MODEL,
                       "choices": [], "usage": usage, "kv_transfer_params": params}):
            await resp.write(b"data: " + _encode.encode(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def completions(request: web.Request) -> web.StreamResponse:
        return await answer(request, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await answer(request, chat=True)

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]})

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(_request: web.Request) -> web.Response:
        # ready once the kvindex knows the pod (the proxy discovers pods there)
        if state.reporter is not None and not state.reporter.registered:
            return web.json_response({"status": "registering"}, status=503)
        return web.json_response({"status": "ready"})

    async def memory_prefetch(request: web.Request) -> web.Response:
        body = _decode.decode(await request.read())
        n = len(body.get("chunk_hashes") or [])
        return web.json_response({"status": "prefetch_started",
                                  "lookup_id": body.get("lookup_id"), "num_chunks": n,
                                  "num_in_cpu": n})

    async def memory_evict(request: web.Request) -> web.Response:
        body = _decode.decode(await request.read())  # nothing is ever evicted here
        return web.json_response({"status": "success", "num_evicted": 0,
                                  "num_missing": len(body.get("chunk_hashes") or [])})

    async def stats(_request: web.Request) -> web.Response:
        reporter = state.reporter
        return web.json_response({
            "pod": state.pod, "requests": state.requests, "prompt_tokens": state.prompt_tokens,
            "cached_tokens": state.cached_tokens, "chunks": state.book.counts().get(
                Tier.DEVICE, 0),
            "pending_events": len(reporter._pending) if reporter else 0,  # noqa: SLF001
            "kvindex_seq": reporter.seq if reporter else None,
            "kvindex_up": reporter.up if reporter else None})

    app = web.Application(client_max_size=64 * 2**20)
    app.add_routes([web.post("/v1/completions", completions),
                    web.post("/v1/chat/completions", chat_completions),
                    web.get("/v1/models", models), web.get("/healthz", health),
                    web.get("/readyz", ready), web.post("/memory/prefetch", memory_prefetch),
                    web.post("/memory/evict", memory_evict), web.get("/standin/stats", stats)])
    return app


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.standin_worker",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="HTTP port (loopback)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--pod-name", required=True, help="the pod's name in the kvindex")
    parser.add_argument("--kvindex", default=None,
                        help="kvindex base URL to register with and publish residency to "
                             "(default: none, a plain responder)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                        help=f"tokens per KV chunk (default {DEFAULT_CHUNK_SIZE})")
    parser.add_argument("--max-output-tokens", type=int, default=16,
                        help="most output tokens an answer carries (default 16)")
    parser.add_argument("--us-per-computed-token", type=float, default=0.0,
                        help="microseconds an answer waits per prompt token not already held, "
                             "as prefill would take (default 0: answer at once); the proxy "
                             "then sees turns in flight and balances by them")
    parser.add_argument("--heartbeat-interval", type=float, default=2.0,
                        help="seconds between kvindex lease renewals (default 2)")
    parser.add_argument("--flush-interval", type=float, default=0.05,
                        help="seconds between residency event batches (default 0.05)")
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    state = StandIn(args.pod_name, args.chunk_size, args.max_output_tokens,
                    args.us_per_computed_token)
    base = f"http://{args.host}:{args.port}"
    if args.kvindex:
        registration = PodRegistration(
            pod=args.pod_name, memory_api_url=base, api_url=base, role=PodRole.BOTH,
            model=MODEL, hash_scheme=HashScheme.BLAKE3, chunk_size=args.chunk_size,
            labels={"bench": "standin"})
        state.reporter = KvindexReporter(
            KvindexClient(args.kvindex, timeout_s=5.0), lambda: registration, state.book,
            heartbeat_interval_s=args.heartbeat_interval, flush_interval_s=args.flush_interval)
    runner = web.AppRunner(make_app(state), access_log=None, keepalive_timeout=75)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=4096)
    await site.start()
    if state.reporter is not None:
        state.reporter.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        if state.reporter is not None:
            await state.reporter.close(deregister=True)
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
