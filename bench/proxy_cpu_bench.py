"""The proxy's own CPU per turn, which machine load does not blur as it blurs latency.

A trivial upstream stands in for the workers (it answers prefill and decode at once), so what
is measured is the proxy alone: decoding the caller's body, routing, two upstream calls on the
P/D path (prefill with ``max_tokens: 1``, then the streamed decode), relaying the SSE events.
The proxy runs as its own process; its CPU seconds come from ``/proc/<pid>/stat``. Also the
added wall time at P50 (through the proxy minus straight to the upstream, interleaved), which
includes the upstream's second call and so overstates the proxy's share.

    python -m bench proxy_cpu [--quick] [--turns N] [--prompt-tokens N]   (from the repo root)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.common import add_out_args, percentile, write_result
from testkit.servers import AGENTSERVING, free_port, service_process


def make_upstream() -> FastAPI:
    """An OpenAI-shaped completions server that answers at once (1 token, P/D params)."""
    app = FastAPI()

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request):  # type: ignore[no-untyped-def]
        body = json.loads(await request.body())
        n = len(body["prompt"])
        usage = {"prompt_tokens": n, "completion_tokens": 1,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        params = {"chunk_hashes": [f"{i:064x}" for i in range(n // 256)], "handle": "h"}
        choice = {"index": 0, "text": "a", "finish_reason": "length"}
        if not body.get("stream"):
            return JSONResponse({"object": "text_completion", "choices": [choice],
                                 "usage": usage, "kv_transfer_params": params})

        async def events():  # type: ignore[no-untyped-def]
            yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": usage,
                                         "kv_transfer_params": params}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench proxy_cpu", description=__doc__)
    parser.add_argument("--turns", type=int, default=400)
    parser.add_argument("--prompt-tokens", type=int, default=5000)
    add_out_args(parser, Path("bench/results/proxy_cpu.json"))
    parser.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.turns = 40
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_upstream is not None:  # the stand-in worker, in its own process
        import uvicorn

        uvicorn.run(make_upstream(), host="127.0.0.1", port=args.serve_upstream,
                    log_level="error")
        return 0
    report: dict = {"turns": args.turns, "prompt_tokens": args.prompt_tokens, "paths": {}}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        up = free_port()
        upstream = f"http://127.0.0.1:{up}"
        stack.enter_context(service_process(
            [sys.executable, "-m", "bench.proxy_cpu_bench", "--serve-upstream", str(up)],
            upstream + "/healthz", log_path=Path(tmp) / "up.log"))
        proxies = {}
        # P/D: the same upstream under two names (the pool is keyed by URL)
        for name, extra in (("pd", ["--prefill", upstream, "--decode",
                                    f"http://localhost:{up}"]),
                            ("colocated", ["--prefill", upstream])):
            port = free_port()
            proc = stack.enter_context(service_process(
                [AGENTSERVING, "proxy", "--port", str(port), *extra, "--log-level", "warning"],
                f"http://127.0.0.1:{port}/healthz", log_path=Path(tmp) / f"proxy-{name}.log"))
            proxies[name] = (f"http://127.0.0.1:{port}", proc)
        body = {"model": "tiny", "prompt": list(range(16, 16 + args.prompt_tokens)),
                "max_tokens": 1, "stream": True}
        with httpx.Client(timeout=60) as http:
            def send(url: str, i: int) -> float:
                start = time.perf_counter()
                with http.stream("POST", url + "/v1/completions", json=body,
                                 headers={"x-session-id": f"s{i % 8}"}) as resp:
                    resp.raise_for_status()
                    for _ in resp.iter_lines():
                        pass
                return (time.perf_counter() - start) * 1e3

            for url in [upstream, *(u for u, _ in proxies.values())]:
                for i in range(10):
                    send(url, i)
            for name, (url, proc) in proxies.items():
                direct, through = [], []
                cpu0 = cpu_seconds(proc.pid)
                for i in range(args.turns):
                    through.append(send(url, i))
                cpu = (cpu_seconds(proc.pid) - cpu0) / args.turns
                for i in range(args.turns):
                    direct.append(send(upstream, i))
                added = [t - d for t, d in zip(through, direct, strict=True)]
                report["paths"][name] = {
                    "proxy_cpu_ms_per_turn": round(cpu * 1e3, 3),
                    "direct_p50_ms": round(percentile(direct, 0.5), 3),
                    "through_p50_ms": round(percentile(through, 0.5), 3),
                    "added_p50_ms": round(statistics.median(added), 3)}
    print(f"{'path':<11}{'proxy CPU ms/turn':>19}{'direct p50':>12}{'proxy p50':>11}")
    for name, r in report["paths"].items():
        print(f"{name:<11}{r['proxy_cpu_ms_per_turn']:>19.2f}{r['direct_p50_ms']:>12.2f}"
              f"{r['through_p50_ms']:>11.2f}")
    write_result(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
