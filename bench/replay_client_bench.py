"""How much load the replay client itself drives, and what preparing a trace costs.

    python -m bench replay_client [--quick] [--out bench/results/replay_client.json]

The main job's numbers describe the serving system only if the replay client is never the
bottleneck. This replays the bundled workload (tool gaps removed, every session at once)
against the fake completions server (no per-token delay, same process, loopback) and reports
the turns and prompt tokens per second the client sustains and its latency floor; it also
times resolving traces to token ids and computing their ideal hit rate (bench-small, and a
2,000-request Mooncake sample when the shared trace is present).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from agentserving.replay.client import Replayer, ReplayOptions
from agentserving.replay.fake_server import FakeState, make_fake_app
from agentserving.replay.ideal import ideal_hit
from agentserving.replay.mooncake import MooncakeOptions, read_mooncake
from agentserving.replay.synthetic import generate_preset
from agentserving.replay.trace import Session, Trace, resolve_all
from bench.common import add_out_args, write_result
from testkit.servers import ThreadedServer

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = ROOT.parent / "shared/data/mooncake/conversation_trace.jsonl"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench replay_client", description=__doc__)
    add_out_args(parser, Path("bench/results/replay_client.json"))
    return parser.parse_args(argv)


def without_gaps(trace: Trace) -> Trace:
    """Every root session at t=0, no tool or branch gaps: the client as fast as it can go."""
    sessions = [Session.model_validate({
        **s.model_dump(), "start_s": 0.0 if s.parent is None else None,
        "parent": (s.parent.model_dump() | {"gap_s": 0.0}) if s.parent else None,
        "turns": [t.model_dump() | {"tool_gap_s": 0.0} for t in s.turns]})
        for s in trace.sessions]
    return Trace(header=trace.header, sessions=sessions)


def timed(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, round(time.perf_counter() - t, 4)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sessions = 12 if args.quick else 48
    out: dict = {"cpus": os.cpu_count(), "quick": args.quick, "sessions": sessions}
    trace = generate_preset("bench-small", sessions=sessions)
    resolved, out["bench_small_resolve_s"] = timed(resolve_all, trace)
    _, out["bench_small_ideal_s"] = timed(ideal_hit, resolved)
    if MOONCAKE.exists() and not args.quick:
        mc, out["mooncake_2000_read_s"] = timed(read_mooncake, MOONCAKE,
                                                MooncakeOptions(max_requests=2000))
        _, out["mooncake_2000_resolve_and_ideal_s"] = timed(
            lambda: ideal_hit(resolve_all(mc), chunk_size=256))

    server = ThreadedServer(make_fake_app(FakeState(chunk=256, token_delay_s=0.0)))
    try:
        replayer = Replayer(without_gaps(trace), ReplayOptions(target=server.url,
                                                               progress=False))
        s = asyncio.run(replayer.run()).summary
    finally:
        server.stop()
    out.update({
        "turns": s["turns_completed"], "failed_turns": s["turns_failed"],
        "client_turns_per_s": round(s["req_per_s"], 1),
        "client_prompt_tokens_per_s": round(s["prompt_tokens"] / s["makespan_s"]),
        "client_e2e_p50_ms": round(1000 * s["e2e_p50_s"], 2),
        "note": "fake server in the same process (shares the CPU); all sessions at once",
    })
    print(f"{'metric':<36}{'value':>14}")
    for key, value in out.items():
        if key != "note":
            print(f"{key:<36}{value!s:>14}")
    write_result(args.out, out)
    return 0 if s["turns_failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
