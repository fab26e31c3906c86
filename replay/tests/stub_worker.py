"""A stand-in for `agentserving worker` (tests only): same flags, same HTTP contract, no model.

It lets the fleet, the real proxy and kvindex, the replay client and the bench run end to end
while the real worker is being built, and keeps the bench's wiring tested without torch:

- accepts the worker's command line (``--role --port --memory-port-start --model --pod-name
  --kvindex --cpu-cache-gib --disk-cache-dir --disk-cache-gib --chunk-size --hash-scheme``);
- registers with the kvindex (``api_url``, role), heartbeats, and reports the chunks it stores;
- ``POST /v1/completions`` honours ``forced_output_token_ids``, streams SSE with usage and
  ``cached_tokens``, and returns ``kv_transfer_params.chunk_hashes``; a prefill request for a
  remote decode (``kv_transfer_params.do_remote_decode``) answers with transfer params, and a
  decode request (``do_remote_prefill``) skips the prefill;
- simulated costs: prefill ``--stub-prefill-us`` per uncached token (one request at a time),
  decode ``--stub-decode-ms`` per token; an LRU chunk cache sized from ``--cpu-cache-gib`` at
  the tiny model's 8 KiB per token (so 0.001 GiB holds nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from collections import OrderedDict
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from agentserving.core.clients import KvindexClient, ServiceUnavailable
from agentserving.core.hashing import chunk_hashes
from agentserving.core.internal_auth import TOKEN_ENV
from agentserving.core.schemas import EventBatch, PodRegistration, ResidencyEvent

KV_BYTES_PER_TOKEN = 8192


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("worker", nargs="?")  # tolerate being called as "<cmd> worker ..."
    p.add_argument("--role", default="both")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--memory-port-start", type=int, default=6999)
    p.add_argument("--model", default="tiny")
    p.add_argument("--pod-name", default="worker-0")
    p.add_argument("--kvindex", default=None)
    p.add_argument("--cpu-cache-gib", type=float, default=2.0)
    p.add_argument("--disk-cache-dir", default=None)
    p.add_argument("--disk-cache-gib", type=float, default=0.0)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--hash-scheme", default="blake3")
    p.add_argument("--stub-prefill-us", type=float, default=20.0)
    p.add_argument("--stub-decode-ms", type=float, default=2.0)
    args, _unknown = p.parse_known_args()
    return args


def make_app(args: argparse.Namespace) -> FastAPI:
    capacity = int(args.cpu_cache_gib * 1024**3 // (KV_BYTES_PER_TOKEN * args.chunk_size))
    cache: OrderedDict[str, None] = OrderedDict()
    engine = asyncio.Lock()
    state: dict[str, Any] = {"seq": 0}
    url = f"http://127.0.0.1:{args.port}"
    # the fleet's internal token, as the real worker reads it (core.internal_auth)
    kv = (KvindexClient(args.kvindex, token=os.environ.get(TOKEN_ENV))
          if args.kvindex else None)

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(3)
            with contextlib.suppress(ServiceUnavailable, Exception):
                await kv.heartbeat(args.pod_name)  # type: ignore[union-attr]

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):  # type: ignore[no-untyped-def]
        task = None
        if kv is not None:
            await kv.register(PodRegistration(
                pod=args.pod_name, memory_api_url=f"http://127.0.0.1:{args.memory_port_start}",
                api_url=url, role=args.role, model=args.model, chunk_size=args.chunk_size))
            task = asyncio.create_task(heartbeat())
        yield
        if task:
            task.cancel()

    app = FastAPI(lifespan=lifespan)

    def cached_prefix(hashes: list[str], n_tokens: int) -> int:
        hit = 0
        limit = (n_tokens - 1) // args.chunk_size
        while hit < min(len(hashes), limit) and hashes[hit] in cache:
            cache.move_to_end(hashes[hit])
            hit += 1
        return hit * args.chunk_size

    async def store(hashes: list[str]) -> None:
        if capacity <= 0:
            return
        new = [h for h in hashes if h not in cache]
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)
        if kv is not None and new:
            state["seq"] += 1
            with contextlib.suppress(Exception):
                await kv.events(EventBatch(pod=args.pod_name, seq=state["seq"], events=[
                    ResidencyEvent(op="stored", tier="cpu", chunk_hashes=new)]))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": args.model, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):  # type: ignore[no-untyped-def]
        body = await request.json()
        prompt: list[int] = body["prompt"]
        forced: list[int] = body.get("forced_output_token_ids") or [17] * body["max_tokens"]
        forced = forced[: body.get("max_tokens", len(forced))]
        params = body.get("kv_transfer_params") or {}
        hashes = chunk_hashes(prompt, chunk_size=args.chunk_size)
        if params.get("do_remote_prefill"):  # decode: the KV came from the prefill pod
            cached = len(prompt)
            await asyncio.sleep(len(prompt) * 1e-6)
        else:
            async with engine:
                cached = cached_prefix(hashes, len(prompt))
                await asyncio.sleep((len(prompt) - cached) * args.stub_prefill_us * 1e-6)
            await store(hashes)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(forced),
                 "total_tokens": len(prompt) + len(forced),
                 "prompt_tokens_details": {"cached_tokens": cached}}
        out_params = {"chunk_hashes": hashes, "remote_pod": args.pod_name}
        if params.get("do_remote_decode"):
            return JSONResponse({"object": "text_completion", "choices": [
                {"index": 0, "text": "", "finish_reason": "length"}], "usage": usage,
                "kv_transfer_params": out_params})
        if not body.get("stream"):
            return JSONResponse({"object": "text_completion", "choices": [
                {"index": 0, "text": "".join(f" t{t}" for t in forced),
                 "finish_reason": "length"}], "usage": usage, "kv_transfer_params": out_params})

        async def stream():  # type: ignore[no-untyped-def]
            for i, tok in enumerate(forced):
                await asyncio.sleep(args.stub_decode_ms * 1e-3)
                yield "data: " + json.dumps({"object": "text_completion", "choices": [{
                    "index": 0, "text": f" t{tok}",
                    "finish_reason": "length" if i == len(forced) - 1 else None}]}) + "\n\n"
            yield "data: " + json.dumps({"object": "text_completion", "choices": [],
                                         "usage": usage, "kv_transfer_params": out_params}) \
                + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


if __name__ == "__main__":
    a = parse()
    uvicorn.run(make_app(a), host=a.host, port=a.port, log_level="warning")
