"""P -> D KV transfer on vLLM: point to point (each pod's own KV server) vs one central KV
server, for long prompts.

    python -m bench pd_transfer [--quick] [--sizes 4096,16384,32000] [--reps 2]

For each transfer mode a fresh 1P1D vLLM fleet (``agentserving up --engine vllm --kv-transfer
p2p|server``), and for each prompt size ``--reps`` distinct prompts, each handed over as the
proxy does it:

1. the prefill pod computes the prompt (``max_tokens: 1``, ``do_remote_decode``) and answers
   once its KV is written to its KV server (its own, or the central one): ``prefill_s``;
2. the decode pod gets the prefill's ``kv_transfer_params`` and streams the answer; its first
   token needs the KV moved and loaded (p2p: its ranks read the chunks from the prefill pod's
   server into their DRAM tier first): ``decode_ttft_s``;
3. the same prompt again on the decode pod after its device prefix cache is reset: the KV now
   comes from its own DRAM tier, the reload any hand-off would end with: ``local_ttft_s``.

``added_ttft_s`` = decode_ttft - local_ttft is what fetching the KV from elsewhere adds to a
turn's first token; ``throughput_gbps`` = the KV's bytes over it. With p2p the decode pod's
own pull is timed too (``pull_s``, its ``/metrics``). The JSON
(``bench/results/pd_transfer.json``) has both modes side by side and their ratios; a PNG
beside it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import httpx

from agentserving.engine.vllm.prefix_cache import reset_prefix_cache
from agentserving.replay.fleet.supervisor import Fleet
from agentserving.replay.fleet.topology import FleetSpec, build
from bench.common import add_run_args, fleet_work_dir, percentile, save_figure, write_result

OUT = Path("bench/results/pd_transfer.json")
MODES = ("p2p", "server")
CHUNK = 256


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench pd_transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="Model both pods serve. Default tiny.")
    p.add_argument("--sizes", default=None, help="Prompt sizes in tokens, comma-separated "
                   "(default 4096,16384,32000; 4096,16384 with --quick).")
    p.add_argument("--reps", type=int, default=None, help="Prompts per size and mode "
                   "(default 2; 1 with --quick).")
    p.add_argument("--kv-transfer-gib", type=float, default=1.0,
                   help="Each KV server's bound, GiB. Default 1.0.")
    p.add_argument("--seed", type=int, default=5, help="Seed of the prompts. Default 5.")
    add_run_args(p, "4k and 16k prompts, one each", OUT, plot=True)
    args = p.parse_args(argv)
    sizes = args.sizes or ("4096,16384" if args.quick else "4096,16384,32000")
    args.sizes = [int(s) for s in sizes.split(",")]
    args.reps = args.reps or (1 if args.quick else 2)
    return args


def fleet_spec(args: argparse.Namespace, mode: str) -> FleetSpec:
    longest = max(args.sizes)
    worker_args = ["--enforce-eager", "--max-model-len", str(min(32768, longest + 64)),
                   "--kv-cache-gib", "1", "--prefill-chunk-tokens", "4096"]
    # LMCache stages two whole prompts in DRAM (the worker's floor): fp32 tiny is 8 KiB/token
    dram = max(0.5, round(2.5 * longest * 8192 / (1 << 30), 2))
    return FleetSpec(engine="vllm", prefill=1, decode=1, model=args.model, kv_transfer=mode,
                     kv_transfer_gib=args.kv_transfer_gib, cpu_cache_gib=dram,
                     disk_cache_gib=0.0, worker_args=worker_args, startup_timeout_s=600.0)


def completion(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, dict]:
    sent = time.perf_counter()
    resp = client.post(url + "/v1/completions", json=body)
    resp.raise_for_status()
    return time.perf_counter() - sent, resp.json()


def first_token_s(client: httpx.Client, url: str, body: dict[str, Any]) -> float:
    sent = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if any(c.get("text") for c in json.loads(line[6:]).get("choices", ())):
                    return time.perf_counter() - sent
    raise RuntimeError("the decode pod streamed no token")


PULL = re.compile(r"^agentserving_kv_handoff_pull_(seconds_sum|bytes_total) (\S+)$", re.M)


def pull_figures(memory_url: str) -> dict[str, float]:
    text = httpx.get(memory_url + "/metrics", timeout=10).text
    return {name: float(value) for name, value in PULL.findall(text)}


def hand_over(client: httpx.Client, fleet: Fleet, prompt: list[int], model: str
              ) -> dict[str, Any]:
    prefill, decode = fleet.url("prefill"), fleet.url("decode")
    memory = next(mp.spec.memory_url for mp in fleet.procs if mp.spec.name == "decode-0")
    assert prefill and decode and memory
    base = {"model": model, "prompt": prompt, "temperature": 0}
    prefill_s, answer = completion(client, prefill, {
        **base, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = answer.get("kv_transfer_params") or {}
    before = pull_figures(memory)
    decode_ttft = first_token_s(client, decode, {
        **base, "max_tokens": 2, "kv_transfer_params": {
            **params, "do_remote_prefill": True, "do_remote_decode": False}})
    after = pull_figures(memory)
    reset_prefix_cache(decode, 60, client)
    local_ttft = first_token_s(client, decode, {**base, "max_tokens": 2})
    pulled = after.get("bytes_total", 0.0) - before.get("bytes_total", 0.0)
    return {"tokens": len(prompt), "chunks": len(params.get("chunk_hashes") or ()),
            "prefill_s": round(prefill_s, 4), "decode_ttft_s": round(decode_ttft, 4),
            "local_ttft_s": round(local_ttft, 4),
            "added_ttft_s": round(decode_ttft - local_ttft, 4),
            "pulled_bytes": int(pulled),
            "pull_s": round(after.get("seconds_sum", 0.0) - before.get("seconds_sum", 0.0), 4)}


def run_mode(args: argparse.Namespace, mode: str, work: Path, progress: Any
             ) -> dict[str, Any]:
    run_dir = work / mode
    fleet = Fleet(build(fleet_spec(args, mode), run_dir), run_dir, stop_grace_s=5.0)
    rng = random.Random(args.seed)
    out: dict[str, Any] = {}
    with fleet, httpx.Client(timeout=900) as client:
        out["central_server"] = any(mp.spec.name == "kvserver" for mp in fleet.procs)
        for size in args.sizes:
            samples = []
            for _ in range(args.reps):
                prompt = [1] + [rng.randrange(3, 250) for _ in range(size - 1)]
                samples.append(hand_over(client, fleet, prompt, args.model))
                progress()
            out[str(size)] = summarise(samples)
    return out


def summarise(samples: list[dict[str, Any]]) -> dict[str, Any]:
    def p50(key: str) -> float:
        return round(percentile([s[key] for s in samples], 0.5), 4)

    out = {k: p50(k) for k in ("prefill_s", "decode_ttft_s", "local_ttft_s", "added_ttft_s",
                               "pull_s")}
    out["pulled_bytes"] = max(s["pulled_bytes"] for s in samples)
    out["samples"] = samples
    return out


def kv_bytes(result: dict[str, Any], size: str) -> int:
    """The hand-off's bytes: what the p2p decode pod pulled (the same chunks either way)."""
    return int(result["p2p"].get(size, {}).get("pulled_bytes") or 0)


def derive(result: dict[str, Any], sizes: list[int]) -> None:
    for size in map(str, sizes):
        nbytes = kv_bytes(result, size)
        for mode in MODES:
            row = result[mode][size]
            row["kv_bytes"] = nbytes
            added = row["added_ttft_s"]
            row["throughput_gbps"] = round(nbytes / added / 1e9, 3) if added > 0 else None
        p2p, server = result["p2p"][size], result["server"][size]
        result["ratios"][size] = {
            "decode_ttft_p2p_vs_server": round(p2p["decode_ttft_s"] / server["decode_ttft_s"],
                                               3),
            "prefill_p2p_vs_server": round(p2p["prefill_s"] / server["prefill_s"], 3)}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [str(s) for s in result["sizes"]]
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.2))
    width = 0.38
    for ax, key, title in ((axes[0], "decode_ttft_s", "decode pod's first token (s)"),
                           (axes[1], "added_ttft_s", "added by fetching the KV (s)")):
        for i, mode in enumerate(MODES):
            xs = [j + (i - 0.5) * width for j in range(len(sizes))]
            ax.bar(xs, [result[mode][s][key] for s in sizes], width, label=mode,
                   color=["#3b7dd8", "#bbbbbb"][i])
        ax.set_xticks(range(len(sizes)), [f"{round(int(s) / 1000)}k" for s in sizes])
        ax.set_xlabel("prompt tokens")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(f"P/D hand-off on vLLM ({result['model']}): point to point vs central server",
                 fontsize=10)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    work = fleet_work_dir("pd-transfer")
    from tqdm import tqdm

    with tqdm(total=len(MODES) * len(args.sizes) * args.reps, desc="pd_transfer hand-offs",
              disable=args.no_progress) as bar:
        modes = {mode: run_mode(args, mode, work, lambda: bar.update(1)) for mode in MODES}
    result: dict[str, Any] = {
        "bench": "pd_transfer", "quick": args.quick, "model": args.model,
        "sizes": args.sizes, "reps": args.reps, "kv_transfer_gib": args.kv_transfer_gib,
        **modes, "ratios": {}, "seconds": round(time.time() - started, 1)}
    derive(result, args.sizes)
    write_result(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    for size in map(str, args.sizes):
        p, s = result["p2p"][size], result["server"][size]
        print(f"{size} tokens: decode TTFT p2p {p['decode_ttft_s']} s vs server "
              f"{s['decode_ttft_s']} s; added {p['added_ttft_s']} vs {s['added_ttft_s']} s; "
              f"pull {p['pull_s']} s for {p['kv_bytes'] / 1e6:.0f} MB")
    return 0 if not result["p2p"]["central_server"] and result["server"]["central_server"] \
        else 1
